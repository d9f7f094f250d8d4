"""A large generated cluster written into real KV buckets: 8 nodes x 8 GPUs, 100 models,
replicas in every state, worker stats on the stats subject. For the dashboard's tests."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.messages import (
    GpuInfo,
    GpuRecord,
    KvCacheStats,
    LoadPhase,
    ModelSpec,
    NodeRecord,
    Occupant,
    OccupantState,
    ReplicaRecord,
    ReplicaState,
    WorkerStats,
    encode_json,
)

GIB = 2**30
NUM_NODES = 8
GPUS_PER_NODE = 8
NUM_MODELS = 100
GPU_BYTES = 80 * GIB


@dataclass
class GeneratedCluster:
    nodes: list[NodeRecord] = field(default_factory=list)
    gpus: list[GpuRecord] = field(default_factory=list)
    models: list[ModelSpec] = field(default_factory=list)
    replicas: list[ReplicaRecord] = field(default_factory=list)
    stats: list[WorkerStats] = field(default_factory=list)


def generate(seed: int = 7) -> GeneratedCluster:
    """Every model gets 0-3 replicas on some GPU with room; states drawn from a realistic mix."""
    rng = random.Random(seed)
    at = time.time()
    cluster = GeneratedCluster()
    for n in range(NUM_NODES):
        node_id = f"gpu-node-{n:02d}"
        cluster.nodes.append(NodeRecord(node_id=node_id, hostname=f"host{n:02d}.example", heartbeat_at=at,
                                        gpus=[GpuInfo(i, GPU_BYTES, "H100") for i in range(GPUS_PER_NODE)],
                                        cpu_ram_bytes=1024 * GIB, num_workers=0, started_at=at - 3600))
        for i in range(GPUS_PER_NODE):
            cluster.gpus.append(GpuRecord(node_id=node_id, index=i, total_bytes=GPU_BYTES, name="H100"))
    states: list[tuple[ReplicaState, OccupantState, LoadPhase | None]] = [
        ("ready", "serving", None), ("ready", "serving", None), ("ready", "serving", None),
        ("loading", "loading", "loading_weights"), ("loading", "loading", "warming_up"),
        ("pending", "reserved", None), ("draining", "draining", None), ("sleeping", "sleeping", None),
    ]
    for m in range(NUM_MODELS):
        key = f"org-{m % 13:02d}/model-{m:03d}-{rng.choice(['instruct', 'chat', 'base', 'coder-long-name'])}"
        cluster.models.append(ModelSpec(key=key, path=key, registered_at=at - 600, desired_replicas=rng.randint(0, 3)))
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            num_bytes = rng.choice([2, 5, 9, 17, 30]) * GIB
            gpu = rng.choice([g for g in cluster.gpus if g.available_bytes >= num_bytes] or cluster.gpus)
            state, occupant_state, phase = rng.choice(states)
            replica_id = f"{rng.getrandbits(128):032x}"
            level = "WARM" if state == "sleeping" else "HOT"
            gpu.occupants.append(Occupant(replica_id, key, num_bytes, occupant_state, since=at - 100,
                                          last_accessed=at - rng.uniform(0, 900)))
            cluster.replicas.append(ReplicaRecord(
                replica_id=replica_id, model=key, node_id=gpu.node_id, gpu_bytes={gpu.index: num_bytes},
                level=level, state=state, phase=phase if state == "loading" else None, created_at=at - 300))
            if state in ("ready", "draining", "sleeping"):
                num_blocks = 4096
                cluster.stats.append(WorkerStats(
                    replica_id=replica_id, model=key, node_id=gpu.node_id, at=at, interval_s=60.0, engine="paged",
                    serving=state == "ready", num_requests_running=rng.randint(0, 8),
                    num_requests_waiting=rng.randint(0, 3), num_requests_by_outcome={"ok": rng.randint(0, 500)},
                    num_generated_tokens=rng.randint(0, 100_000), last_request_at=at - rng.uniform(0, 600),
                    kv_cache=KvCacheStats(num_blocks, rng.randint(0, num_blocks), 0, 2**20)))
    return cluster


async def write(bus: Bus, cluster: GeneratedCluster) -> None:
    """Into the KV buckets (as node agents and schedulers would) and the stats subject."""
    for node in cluster.nodes:
        await bus.nodes.put(node.node_id, node)
    for gpu in cluster.gpus:
        await bus.gpus.put(subjects.gpu_kv_key(gpu.node_id, gpu.index), gpu)
    for spec in cluster.models:
        await bus.models.put(subjects.model_token(spec.key), spec)
    for record in cluster.replicas:
        await bus.replicas.put(subjects.replica_kv_key(record.model, record.replica_id), record)
    await publish_stats(bus, cluster)


async def publish_stats(bus: Bus, cluster: GeneratedCluster) -> None:
    for stats in cluster.stats:
        await bus.nc.publish(subjects.stats_subject(stats.model, stats.replica_id), encode_json(stats))
    await bus.nc.flush()
