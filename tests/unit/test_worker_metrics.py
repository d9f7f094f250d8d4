"""The workers' stats at a gateway: which replicas are current, and their Prometheus samples."""

from __future__ import annotations

from shoal.services.gateway.worker_metrics import WORKER_METRICS, WorkerMetricsCollector, WorkerStatsStore
from shoal.shared.messages import KvCacheStats, SessionStats, WorkerStats
from shoal.shared.metrics import Registry
from tests.integration.gateway_harness import find_sample, parse_samples


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stats(replica_id: str = "r1", model: str = "org/m", **fields: object) -> WorkerStats:
    values: dict[str, object] = {"node_id": "n1", "at": 1.0, "interval_s": 2.0, "engine": "paged"} | fields
    return WorkerStats(replica_id=replica_id, model=model, **values)  # type: ignore[arg-type]


def test_a_replica_silent_for_three_intervals_or_unknown_is_dropped() -> None:
    clock = Clock()
    store = WorkerStatsStore(clock)
    store.put(stats("r1", interval_s=2.0))
    store.put(stats("r2", interval_s=10.0))
    clock.now += 5.9
    assert [s.replica_id for s in store.get_current()] == ["r1", "r2"]
    clock.now += 0.2  # r1: 6.1 s > max(5, 3 x 2)
    assert [s.replica_id for s in store.get_current()] == ["r2"]
    assert [s.replica_id for s in store.get_current(lambda s: s.replica_id != "r2")] == []
    store.put(stats("r2", interval_s=10.0))
    assert store.get_current() != [], "dropped for good only until it speaks again"


def test_batch_size_is_the_mean_over_the_last_interval() -> None:
    store = WorkerStatsStore(Clock())
    store.put(stats(num_steps=10, num_step_seqs=20))
    assert store.get_batch_size("r1") is None
    store.put(stats(num_steps=14, num_step_seqs=40))
    assert store.get_batch_size("r1") == 5.0
    store.put(stats(num_steps=14, num_step_seqs=40))
    assert store.get_batch_size("r1") == 0.0


def test_collector_serves_every_figure_labelled_by_model_replica_and_node() -> None:
    store = WorkerStatsStore(Clock())
    store.put(stats("r1", "org/a", num_requests_running=3, num_requests_waiting=1,
                    num_requests_by_outcome={"ok": 5, "cancelled": 1}, num_prompt_tokens=70,
                    num_generated_tokens=120, last_request_at=50.0, num_preemptions=2, num_steps=30,
                    num_step_seqs=60, step_seconds=1.5,
                    kv_cache=KvCacheStats(num_blocks=100, num_used_blocks=25, num_free_blocks=75, block_bytes=1024,
                                          num_cache_queries=8, num_cache_hits=6)))
    store.put(stats("r2", "org/b", engine="hf", serving=False))
    registry = Registry()
    registry.register_collector(WorkerMetricsCollector(store, lambda s: True))
    text = registry.render()
    a = 'model="org/a",replica="r1",node="n1"'
    expected = {
        f"shoal_worker_requests_running{{{a}}}": 3,
        f"shoal_worker_requests_waiting{{{a}}}": 1,
        f'shoal_worker_requests_total{{{a},outcome="ok"}}': 5,
        f'shoal_worker_requests_total{{{a},outcome="cancelled"}}': 1,
        f"shoal_worker_prompt_tokens_total{{{a}}}": 70,
        f"shoal_worker_generation_tokens_total{{{a}}}": 120,
        f"shoal_worker_last_request_timestamp_seconds{{{a}}}": 50,
        f"shoal_worker_serving{{{a}}}": 1,
        f"shoal_worker_kv_cache_blocks{{{a}}}": 100,
        f"shoal_worker_kv_cache_used_blocks{{{a}}}": 25,
        f"shoal_worker_kv_cache_free_blocks{{{a}}}": 75,
        f"shoal_worker_kv_cache_usage_ratio{{{a}}}": 0.25,
        f"shoal_worker_kv_cache_bytes{{{a}}}": 102400,
        f"shoal_worker_prefix_cache_queries_total{{{a}}}": 8,
        f"shoal_worker_prefix_cache_hits_total{{{a}}}": 6,
        f"shoal_worker_preemptions_total{{{a}}}": 2,
        f"shoal_worker_step_duration_seconds_count{{{a}}}": 30,
        f"shoal_worker_step_duration_seconds_sum{{{a}}}": 1.5,
        'shoal_worker_serving{model="org/b",replica="r2",node="n1"}': 0,
    }
    for sample, value in expected.items():
        assert find_sample(text, sample) == value, sample
    b_names = {s.name for s in parse_samples(text) if s.labels.get("model") == "org/b"}
    assert "shoal_worker_kv_cache_blocks" not in b_names, "an engine without a pool reports none"
    served = {s.name.removesuffix("_count").removesuffix("_sum") for s in parse_samples(text)}
    assert served <= {m.name for m in WORKER_METRICS}, "every served metric is declared (and documented)"


def test_collector_leaves_out_replicas_whose_record_is_gone() -> None:
    store = WorkerStatsStore(Clock())
    store.put(stats("r1"))
    store.put(stats("r2"))
    registry = Registry()
    registry.register_collector(WorkerMetricsCollector(store, lambda s: s.replica_id == "r1"))
    replicas = {s.labels["replica"] for s in parse_samples(registry.render())}
    assert replicas == {"r1"}


def test_the_session_cache_figures_by_tier_result_source_and_direction() -> None:
    store = WorkerStatsStore(Clock())
    sessions = SessionStats(num_sessions=7, gpu_bytes=4096, cpu_bytes=2048, host_pool_bytes=8192, num_hits=9,
                            num_misses=3, num_gpu_reused_tokens=500, num_cpu_restored_tokens=64,
                            num_prefix_cached_tokens=16, num_recomputed_tokens=32, num_new_tokens=90,
                            swap_in_bytes=1024, swap_out_bytes=3072, exposed_swap_seconds=0.25,
                            num_demoted_chunks=5, num_dropped_chunks=2, num_expired_sessions=1)
    store.put(stats("r1", sessions=sessions))
    store.put(stats("r2"))
    registry = Registry()
    registry.register_collector(WorkerMetricsCollector(store, lambda s: True))
    text = registry.render()
    a = 'model="org/m",replica="r1",node="n1"'
    expected = {
        f"shoal_worker_sessions{{{a}}}": 7,
        f'shoal_worker_session_bytes{{{a},tier="gpu"}}': 4096,
        f'shoal_worker_session_bytes{{{a},tier="cpu"}}': 2048,
        f"shoal_worker_session_host_pool_bytes{{{a}}}": 8192,
        f'shoal_worker_session_turns_total{{{a},result="hit"}}': 9,
        f'shoal_worker_session_turns_total{{{a},result="miss"}}': 3,
        f'shoal_worker_session_tokens_total{{{a},source="gpu"}}': 500,
        f'shoal_worker_session_tokens_total{{{a},source="cpu"}}': 64,
        f'shoal_worker_session_tokens_total{{{a},source="prefix_cache"}}': 16,
        f'shoal_worker_session_tokens_total{{{a},source="recomputed"}}': 32,
        f'shoal_worker_session_tokens_total{{{a},source="new"}}': 90,
        f'shoal_worker_session_swap_bytes_total{{{a},direction="in"}}': 1024,
        f'shoal_worker_session_swap_bytes_total{{{a},direction="out"}}': 3072,
        f"shoal_worker_session_swap_exposed_seconds_total{{{a}}}": 0.25,
        f'shoal_worker_session_chunks_total{{{a},event="demoted"}}': 5,
        f'shoal_worker_session_chunks_total{{{a},event="dropped"}}': 2,
        f"shoal_worker_session_expired_total{{{a}}}": 1,
    }
    for sample, value in expected.items():
        assert find_sample(text, sample) == value, sample
    r2 = {s.name for s in parse_samples(text) if s.labels.get("replica") == "r2"}
    assert not {n for n in r2 if "session" in n}, "a replica without a session cache reports none"


def test_the_latest_stats_of_a_replica_only_while_fresh() -> None:
    clock = Clock()
    store = WorkerStatsStore(clock)
    store.put(stats("r1", interval_s=2.0, num_requests_waiting=4))
    latest = store.get_latest("r1")
    assert latest is not None and latest.num_requests_waiting == 4
    assert store.get_latest("r2") is None
    clock.now += 6.1
    assert store.get_latest("r1") is None
