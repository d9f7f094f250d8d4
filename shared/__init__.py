"""What every Shoal service uses: messages and NATS names, the bus, configuration,
logging, metrics, and the pure policies (`placement`, `kv_cache`, `model_memory`).

Where to look first:

    messages.py      every Struct that crosses NATS (one union per channel)
    subjects.py      every NATS name, and the model-key <-> subject-token mapping
    config.py        shoal.toml: every setting and its default, declared once
    placement/       where a replica goes, and who is evicted (the scheduler's policy)
    kv_cache/        KV blocks: allocated, shared, freed (the worker engine's policy)
    model_memory.py  what a model needs in memory, and how many KV blocks fit
"""
