"""How the worker hands its session settings to the engine and publishes the session cache's
figures: totals that survive a park and restore, current values that do not."""

from __future__ import annotations

import msgspec

from shoal.services.worker.engine.cost_profile import get_prefill_points
from shoal.services.worker.engine.paged_engine import EngineStats
from shoal.services.worker.launch import WorkerLaunch
from shoal.services.worker.main import get_session_settings
from shoal.services.worker.stats import SESSION_COUNTS, EngineTotals, _engine_counts, _session_stats
from shoal.shared.config import LoggingConfig, SessionConfig, WorkerConfig
from shoal.shared.kv_cache.block_pool import BlockPoolStats
from shoal.shared.kv_cache.cost_model import CostModel, PrefillSample, fit_prefill_costs
from shoal.shared.messages import SESSION_GAUGES, ModelSpec, ReplicaRecord, SessionStats


def launch(**sessions: object) -> WorkerLaunch:
    return WorkerLaunch(nats_url="nats://x", node_id="n1", models_root="/models", device="cpu",
                        replica=ReplicaRecord(replica_id="r1", model="org/m-1", node_id="n1"),
                        model=ModelSpec(key="org/m-1", path="m"),
                        worker=WorkerConfig(sessions=SessionConfig(**sessions)),  # type: ignore[arg-type]
                        logging=LoggingConfig())


def test_the_engine_gets_the_worker_sessions_settings_or_none_when_off() -> None:
    settings = get_session_settings(launch(idle_timeout_s=30.0))
    assert settings is not None and settings.idle_timeout_s == 30.0
    assert get_session_settings(launch(enabled=False)) is None


def test_a_cost_profile_path_is_per_model_with_model_in_it() -> None:
    settings = get_session_settings(launch(cost_profile_path="/cache/{model}.json"))
    assert settings is not None and settings.cost_profile_path == "/cache/org=2Fm-1.json"
    settings = get_session_settings(launch(cost_profile_path="/cache/one.json"))
    assert settings is not None and settings.cost_profile_path == "/cache/one.json"


def test_the_worker_launch_carries_the_session_settings_as_json() -> None:
    original = launch(host_pool_bytes=1 << 20, gpu_fraction=0.5)
    decoded = msgspec.json.decode(msgspec.json.encode(original), type=WorkerLaunch)
    assert decoded.worker.sessions == original.worker.sessions


def _engine_stats(sessions: SessionStats | None) -> EngineStats:
    pool = BlockPoolStats(num_blocks=10, block_size=16, block_bytes=64, num_used_blocks=0, num_peak_used_blocks=0,
                          num_free_blocks=10, num_cached_blocks=0, num_cached_free_blocks=0, num_allocations=0,
                          num_frees=0, num_cache_hits=0, num_cache_misses=0, num_evictions=0)
    return EngineStats(pool=pool, num_running=0, num_waiting=0, num_preemptions=0, sessions=sessions)


def test_session_counts_are_totals_across_engines_and_gauges_are_the_current_engines() -> None:
    assert set(SESSION_COUNTS) | set(SESSION_GAUGES) == set(SessionStats.__struct_fields__)
    totals = EngineTotals()
    first = SessionStats(num_sessions=4, gpu_bytes=100, num_hits=3, num_misses=1, num_gpu_reused_tokens=50,
                         exposed_swap_seconds=0.5)
    counts = totals.update(1, _engine_counts(_engine_stats(first)))
    assert _session_stats(first, counts) == first
    # A park drops the engine; the restored one counts from zero again.
    totals.update(None, None)
    second = SessionStats(num_sessions=1, gpu_bytes=10, num_hits=2, num_gpu_reused_tokens=7, exposed_swap_seconds=0.25)
    published = _session_stats(second, totals.update(2, _engine_counts(_engine_stats(second))))
    assert (published.num_sessions, published.gpu_bytes) == (1, 10)
    assert (published.num_hits, published.num_misses, published.num_gpu_reused_tokens) == (5, 1, 57)
    assert published.exposed_swap_seconds == 0.75 and isinstance(published.num_hits, int)


def test_an_engine_without_a_session_cache_counts_nothing() -> None:
    counts = EngineTotals().update(1, _engine_counts(_engine_stats(None)))
    assert all(counts[f"sessions.{name}"] == 0 for name in SESSION_COUNTS)


def test_the_smallest_pool_still_times_enough_pass_shapes_to_fit_a_cost_model() -> None:
    """Sessions are on by default, so an engine on a one-block pool (16 tokens, the least an
    allocation may leave) measures its cost model too: it needs three distinct passes."""
    points = get_prefill_points(chunk_tokens=64, max_pass_tokens=16, max_context_tokens=16)
    assert len(set(points)) == len(points) >= 3
    assert all(n + ctx <= 16 for n, ctx in points)
    model = CostModel(seconds_per_token=1e-4, seconds_per_token_pair=1e-6, seconds_per_pass=1e-3)
    samples = [PrefillSample(n, ctx, model.get_prefill_seconds(n, ctx)) for n, ctx in points]
    per_pass, per_token, per_pair = fit_prefill_costs(samples)
    assert abs(per_pass - 1e-3) < 1e-9 and abs(per_token - 1e-4) < 1e-9 and abs(per_pair - 1e-6) < 1e-9
    assert get_prefill_points(64, 2048, 2048) == [(64, c) for c in (0, 480, 960)] + [
        (256, c) for c in (0, 384, 768)], "a normal pool times contexts up to PROFILE_MAX_CONTEXT_TOKENS"
