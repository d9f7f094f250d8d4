"""Sleep, wake and fair preemption (seed 001) with real workers on a GPU that holds two of
three models: the right model sleeps, popular and young replicas are spared, nothing is lost."""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from pathlib import Path

import aiohttp
import msgspec

from shoal.shared import subjects
from shoal.shared.bus import cas_update
from shoal.shared.messages import PreemptionIntent
from shoal.shared.model_settings import FairnessSettings, SleepSettings
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.integration.sleep_wake_harness import CHECKPOINT, REPLICA_BYTES, model, sleep_wake_cluster

ACTIVITY_S = 1.2
"""A worker writes its activity at most once a second: wait this long for it to land."""


async def test_the_least_recently_used_model_sleeps(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    async with sleep_wake_cluster(nats_server.url, demo_models_root, tmp_path, [model("a"), model("b"), model("c")]
                                  ) as cluster:
        await cluster.complete("a")
        await cluster.complete("b")
        await asyncio.sleep(ACTIVITY_S)
        await cluster.complete("a")  # a is now the most recently used: b must be the victim
        await asyncio.sleep(ACTIVITY_S)
        await cluster.expect_serving({"a", "b"})
        await cluster.complete("c")
        await cluster.expect_serving({"a", "c"})
        (b,) = await cluster.replicas("b")
        assert (b.level, b.state) == ("WARM", "sleeping"), "b, the least recently used, sleeps"
        gpu = await cluster.gpu()
        assert {o.model: o.state for o in gpu.occupants}["b"] == "sleeping"
        assert gpu.intents == [] and gpu.wake_lock is None, "the wake cleaned up after itself"

        # Alternate once more: b wakes, and a (used less recently than c now) sleeps.
        await asyncio.sleep(ACTIVITY_S)
        await cluster.complete("c")
        await asyncio.sleep(ACTIVITY_S)
        await cluster.complete("b")
        await cluster.expect_serving({"b", "c"})
        assert cluster.max_reserved_seen[0] <= (await cluster.gpu()).total_bytes


async def test_a_wake_waits_for_a_model_about_to_sleep_and_resident_models_never_wait(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    """The fairness wait: b will sleep by itself (idle) within c's max_wait_s, so c waits for it
    instead of preempting anyone, and meanwhile a resident model answers at once."""
    sleepy = model("b", sleep=SleepSettings(idle_timeout_s=3.0, drain_timeout_s=5.0))
    patient_waker = model("c", fairness=FairnessSettings(min_runtime_s=0.5, max_wait_s=20.0))
    async with sleep_wake_cluster(nats_server.url, demo_models_root, tmp_path, [model("a"), sleepy, patient_waker],
                                  reconcile_interval_s=0.5) as cluster:
        await cluster.complete("a")
        await cluster.complete("b")  # b's idle clock starts now: it sleeps by itself within c's wait
        waking = asyncio.create_task(cluster.complete("c"))
        await cluster.wait_for(_c_is_waking(cluster), "c's wake")
        await cluster.complete("a")
        assert not any(r.serving for r in await cluster.replicas("c")), "a answered while c waited"
        await waking
        await cluster.expect_serving({"a", "c"})
        (b,) = await cluster.replicas("b")
        assert b.level == "WARM", "b went to sleep by itself"
        preempted = await cluster.metric_total("shoal_scheduler_preemptions_total")
        assert preempted == 0, "nobody was preempted: the wait found memory freed voluntarily"


def _c_is_waking(cluster):  # type: ignore[no-untyped-def]
    async def check() -> bool:
        return cluster.schedulers[0].wakes.phase_of("c") is not None and any(
            i.model == "c" for i in (await cluster.gpu()).intents)

    return check


async def test_a_popular_model_is_never_preempted(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    popular = FairnessSettings(min_runtime_s=0.5, max_wait_s=0.2, popular=True)
    models = [model("pop", fairness=popular), model("b"), model("c")]
    async with sleep_wake_cluster(nats_server.url, demo_models_root, tmp_path, models) as cluster:
        await cluster.complete("pop")
        await cluster.complete("b")
        await asyncio.sleep(ACTIVITY_S)
        await cluster.complete("b")  # pop is the least recently used, yet stays
        await asyncio.sleep(ACTIVITY_S)
        await cluster.complete("c")
        await cluster.expect_serving({"pop", "c"})
        await asyncio.sleep(ACTIVITY_S)
        await cluster.complete("b")
        await cluster.expect_serving({"pop", "b"})


async def test_no_eligible_victim_is_a_503_that_says_why(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    patient = FairnessSettings(min_runtime_s=600.0, max_wait_s=0.2)
    models = [model("a", fairness=patient), model("b", fairness=patient), model("c")]
    async with sleep_wake_cluster(nats_server.url, demo_models_root, tmp_path, models) as cluster:
        await cluster.complete("a")
        await cluster.complete("b")
        status, body, headers = await cluster.post("c")
        assert status == 503, body
        assert "inside their minimum runtime" in body["error"]["message"]
        assert 500 < float(headers["Retry-After"]) <= 600
        await cluster.expect_serving({"a", "b"}, "nobody inside its min runtime was preempted")
        async with aiohttp.ClientSession() as session, session.get(cluster.url + "/metrics") as response:
            metrics = await response.text()
        # Capacity, not a server error: the page alert on 5xx does not count it.
        assert 'shoal_gateway_requests_total{kind="completion",model="c",outcome="no_capacity"} 1.0' in metrics


async def test_a_gateway_that_waits_for_capacity_answers_once_a_victim_may_be_preempted(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    """With `gateway.capacity_wait_s` the request that found every occupant inside its minimum
    runtime is held (as Ollama queues one while models swap) and answered once one of them may
    be preempted, instead of a 503."""
    young = FairnessSettings(min_runtime_s=60.0, max_wait_s=0.2)
    models = [model("a", fairness=young), model("b", fairness=young), model("c")]
    async with sleep_wake_cluster(nats_server.url, demo_models_root, tmp_path, models,
                                  capacity_wait_s=60.0) as cluster:
        await cluster.complete("a")
        await cluster.complete("b")
        await cluster.eligible_in("a", 4.0)
        await cluster.eligible_in("b", 5.0)
        status, body, _ = await cluster.post("c")
        assert status == 200, body
        serving = await cluster.serving()
        assert "c" in serving and len(serving & {"a", "b"}) == 1, serving
        async with aiohttp.ClientSession() as session, session.get(cluster.url + "/metrics") as response:
            metrics = await response.text()
        assert re.search(r'^shoal_gateway_capacity_waits_total\{model="c"\} [1-9]', metrics, re.M), [line for line in metrics.splitlines() if 'capacity' in line or 'placement' in line]


async def test_a_blocked_waker_keeps_its_place_in_line_over_a_newer_one(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    """c and then d find both occupants inside their minimum runtime (503). Once a may be
    preempted, d asks first, yet c, which has waited longer, gets a's memory: d's wake sees c's
    intent (its first `since` kept through the block) as taken, and b is still too young. d,
    next in line, is then served once c may be preempted, not after b's 600 s."""
    models = [model("a", fairness=FairnessSettings(min_runtime_s=60.0, max_wait_s=0.2)),
              model("b", fairness=FairnessSettings(min_runtime_s=600.0, max_wait_s=0.2)), model("c"), model("d")]
    async with sleep_wake_cluster(nats_server.url, demo_models_root, tmp_path, models) as cluster:
        await cluster.complete("a")
        await cluster.complete("b")
        await cluster.eligible_in("a", 4.0)
        c_status, _, _ = await cluster.post("c")
        await asyncio.sleep(0.05)  # d's wake starts in a later millisecond than c's
        d_status, _, _ = await cluster.post("d")
        assert (c_status, d_status) == (503, 503)
        intents = {i.model: i for i in (await cluster.gpu()).intents}
        assert set(intents) == {"c", "d"}, "both blocked wakers keep a place on the GPU"
        assert intents["c"].since < intents["d"].since
        blocked_until = [(await cluster.spec(key)).wake_blocked_until for key in ("c", "d")]
        await asyncio.sleep(max(u or 0.0 for u in blocked_until) - time.time() + 0.1)

        asking_first = asyncio.create_task(cluster.post("d"))  # d asks first once a may be preempted
        await asyncio.sleep(0.3)
        c_status, c_body, _ = await cluster.post("c")
        d_status, d_body, _ = await asking_first
        assert c_status == 200, c_body
        assert d_status == 503, d_body
        assert "older wakers wait ahead of it" in d_body["error"]["message"]
        await cluster.expect_serving({"b", "c"}, "c, first in line, took a's memory")

        await cluster.complete("d")  # retried on its 503s: seconds, not b's 600 s minimum runtime
        await cluster.expect_serving({"b", "d"})


async def test_a_waiting_request_whose_queued_message_was_purged_is_published_again(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    """A streamed request is queued at once, before its model is placed. Removing a model
    purges its queued requests; registered again at once, the model is placed and serves, but
    the purged request is not in its queue: the gateway notices its message gone and publishes
    it again, instead of waiting out its deadline (found by a soak that removed and registered
    models under load)."""
    young = FairnessSettings(min_runtime_s=60.0, max_wait_s=0.2)
    models = [model("a", fairness=young), model("b", fairness=young), model("c")]
    async with sleep_wake_cluster(nats_server.url, demo_models_root, tmp_path, models,
                                  capacity_wait_s=60.0) as cluster:
        await cluster.complete("a")
        await cluster.complete("b")
        await cluster.eligible_in("a", 3.0)
        await cluster.eligible_in("b", 4.0)
        body = {"model": "c", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "stream": True}

        async def streamed() -> str:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session, \
                    session.post(cluster.url + "/v1/completions", json=body) as response:
                assert response.status == 200
                return (await response.read()).decode()

        answer = asyncio.create_task(streamed())
        stream, subject = subjects.REQUESTS_STREAM, subjects.infer_subject("c")
        while (await cluster.bus.js.stream_info(stream)).state.messages == 0:  # queued, waiting for capacity
            await asyncio.sleep(0.05)
        await cluster.bus.js.purge_stream(stream, subject=subject)  # as a removal purges it
        text = await answer
        assert "data: [DONE]" in text and '"finish_reason":"length"' in text, text[-500:]


async def test_requests_in_flight_when_the_barrier_rises_all_complete(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    # b is popular: a, busy with requests (which counts as recently used), is the only victim.
    models = [model("a"), model("b", fairness=FairnessSettings(min_runtime_s=0.5, max_wait_s=0.2, popular=True)),
              model("c")]
    async with sleep_wake_cluster(nats_server.url, demo_models_root, tmp_path, models) as cluster:
        await cluster.complete("a")
        await cluster.complete("b")
        await asyncio.sleep(ACTIVITY_S)
        long_ones = [asyncio.create_task(cluster.complete("a", max_tokens=300)) for _ in range(3)]
        await asyncio.sleep(0.5)  # they are generating on a when c's wake preempts a
        waking = asyncio.create_task(cluster.complete("c"))
        finished = await asyncio.gather(*long_ones)
        assert [r["usage"]["completion_tokens"] for r in finished] == [300, 300, 300]
        await waking
        # a was the victim although it was busy: it drained first, and nothing was cut short.
        await cluster.expect_serving({"b", "c"})


async def test_a_hundred_requests_that_force_swaps_are_all_answered(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    async with sleep_wake_cluster(nats_server.url, demo_models_root, tmp_path, [model("a"), model("b"), model("c")]
                                  ) as cluster:
        gate = asyncio.Semaphore(8)

        async def one(index: int) -> int:
            async with gate:
                body = await cluster.complete("abc"[index % 3], max_tokens=3)
                return body["usage"]["completion_tokens"]

        results = await asyncio.gather(*(one(i) for i in range(100)))
        assert results == [3] * 100
        models_served = {
            m for m in "abc" for r in await cluster.replicas(m) if r.level in ("HOT", "WARM")
        }
        assert models_served == {"a", "b", "c"}, "every model was woken at least once"
        assert cluster.max_reserved_seen[0] <= (await cluster.gpu()).total_bytes


async def test_an_idle_model_sleeps_after_its_timeout_and_wakes_on_the_next_request(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    sleepy = model("a", sleep=SleepSettings(idle_timeout_s=2.0, drain_timeout_s=5.0))
    async with sleep_wake_cluster(nats_server.url, demo_models_root, tmp_path, [sleepy, model("b")],
                                  reconcile_interval_s=0.5) as cluster:
        await cluster.complete("a")
        await cluster.complete("b")  # b has no idle timeout: it stays

        async def a_asleep() -> bool:
            return any(r.level == "WARM" for r in await cluster.replicas("a"))

        await cluster.wait_for(a_asleep, "a to sleep after 2 s idle", timeout_s=30)
        await cluster.expect_serving({"b"})
        body = await cluster.complete("a")
        assert body["usage"]["completion_tokens"] == 4
        await cluster.expect_serving({"a", "b"})


async def test_two_wakers_racing_for_one_gpu_never_both_claim_it(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    # 150 MiB: one resident (96) and room for one more only once it sleeps. b and c wake at once,
    # each through its own scheduler.
    models = [model("a"), model("b"), model("c")]
    async with sleep_wake_cluster(nats_server.url, demo_models_root, tmp_path, models, num_schedulers=2,
                                  gpus="virtual:1x150MiB") as cluster:
        await cluster.complete("a")
        await asyncio.sleep(1.0)  # past a's min runtime
        replies = await asyncio.gather(cluster.schedulers[0].ensure("b"), cluster.schedulers[1].ensure("c"))
        assert {r.status for r in replies} <= {"waking", "placed", "serving"}, replies

        async def keep_asking() -> None:  # the waiting requests' heartbeats
            while True:
                await asyncio.gather(cluster.schedulers[0].ensure("b"), cluster.schedulers[1].ensure("c"))
                await asyncio.sleep(0.5)

        both_seen: list[set[str]] = []

        async def watch_wakers() -> None:  # the claim is exclusive at every moment, not just at the end
            while True:
                serving = await cluster.serving() & {"b", "c"}
                if len(serving) > 1:
                    both_seen.append(serving)
                await asyncio.sleep(0.05)

        asking = asyncio.create_task(keep_asking())
        watching = asyncio.create_task(watch_wakers())
        try:
            async def one_placed() -> bool:
                return bool(await cluster.serving() & {"b", "c"})

            # Once one serves and passes its min runtime, the other may fairly preempt it: the two
            # take turns, and never hold the GPU together.
            await cluster.wait_for(one_placed, "one of the wakers placed")
            await asyncio.sleep(2.0)
        finally:
            asking.cancel()
            watching.cancel()
        assert not both_seen, f"both wakers served at once: {both_seen[0]}"
        assert cluster.max_reserved_seen[0] <= (await cluster.gpu()).total_bytes


async def test_a_waker_whose_released_memory_went_to_a_waker_ahead_chooses_a_victim_again(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    """c's victim (a, draining a long answer) releases its memory to a waker ahead of c in line
    whose intent came after c chose (another scheduler's, x): c preempts b at once and is
    placed, instead of polling until a's drain deadline (drain_timeout_s + 60 s) and turning
    its requests away. (b is popular until a drains, so that a, busy, is the first victim.)"""
    popular = FairnessSettings(min_runtime_s=0.5, max_wait_s=0.2, popular=True)
    async with sleep_wake_cluster(nats_server.url, demo_models_root, tmp_path,
                                  [model("a"), model("b", fairness=popular), model("c")]) as cluster:
        await cluster.complete("a")
        await cluster.complete("b")
        long_answer = asyncio.create_task(cluster.complete("a", max_tokens=1500))  # a's drain waits for it
        await asyncio.sleep(ACTIVITY_S)
        waking = asyncio.create_task(cluster.complete("c"))

        async def a_draining() -> bool:
            return any(r.state == "draining" for r in await cluster.replicas("a"))

        await cluster.wait_for(a_draining, "c's wake to preempt a", timeout_s=30)
        assert not long_answer.done(), "a's answer must still be in flight when c's wake preempts a"
        now = time.time()
        ahead = PreemptionIntent(model="x", num_bytes=REPLICA_BYTES, since=now - 100, owner="s-elsewhere",
                                 expires_at=now + 300, interest_until=now + 300)
        await cas_update(cluster.bus.gpus, cluster.gpu_key,
                         lambda gpu: msgspec.structs.replace(gpu, intents=[*gpu.intents, ahead]) if gpu else None)
        b = await cluster.spec("b")
        await cluster.bus.models.put(subjects.model_token("b"), msgspec.structs.replace(
            b, fairness=msgspec.structs.replace(b.fairness, popular=False)))
        async with asyncio.timeout(45):  # a's drain deadline is 90 s away
            await waking
        assert (await long_answer)["usage"]["completion_tokens"] == 1500, "a's answer completed"
        states = {r.model: (r.level, r.state) for m in ("a", "b") for r in await cluster.replicas(m)}
        assert states == {"a": ("WARM", "sleeping"), "b": ("WARM", "sleeping")}, states
        assert await cluster.serving() == {"c"}
        assert [i.model for i in (await cluster.gpu()).intents] == ["x"], "x keeps its place; c's intent is gone"


async def test_a_cold_sleep_keeps_the_worker_and_reloads_its_weights_on_wake(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    sleepy = model("a", sleep=SleepSettings(level="cold", idle_timeout_s=2.0, drain_timeout_s=5.0))
    async with sleep_wake_cluster(nats_server.url, demo_models_root, tmp_path, [sleepy],
                                  reconcile_interval_s=0.5) as cluster:
        first = await cluster.complete("a")
        (serving,) = await cluster.replicas("a")

        async def a_asleep() -> bool:
            return any(r.level == "WARM" and r.state == "sleeping" for r in await cluster.replicas("a"))

        await cluster.wait_for(a_asleep, "a to sleep cold after 2 s idle", timeout_s=30)
        (asleep,) = await cluster.replicas("a")
        assert asleep.weights_dropped and asleep.pid == serving.pid, "the process stays, its weights go"
        again = await cluster.complete("a")
        assert again["choices"][0]["text"] == first["choices"][0]["text"], "reloaded weights answer the same"
        (woken,) = await cluster.replicas("a")
        assert (woken.replica_id, woken.pid, woken.weights_dropped) == (serving.replica_id, serving.pid, False)


async def test_a_cold_sleep_that_cannot_drop_its_weights_parks_warm_and_says_so(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    """The model's file is gone by the time it sleeps: dropping the weights would lose them, so
    the worker keeps them, and its record says so (the planner then charges their bytes)."""
    models_root = tmp_path / "models"
    shutil.copytree(demo_models_root / CHECKPOINT, models_root / CHECKPOINT)
    sleepy = model("a", sleep=SleepSettings(level="cold", idle_timeout_s=2.0, drain_timeout_s=5.0))
    async with sleep_wake_cluster(nats_server.url, models_root, tmp_path, [sleepy],
                                  reconcile_interval_s=0.5) as cluster:
        first = await cluster.complete("a")
        (models_root / CHECKPOINT / "model.safetensors").unlink()

        async def a_asleep() -> bool:
            return any(r.level == "WARM" and r.state == "sleeping" for r in await cluster.replicas("a"))

        await cluster.wait_for(a_asleep, "a to sleep after 2 s idle", timeout_s=30)
        (asleep,) = await cluster.replicas("a")
        assert not asleep.weights_dropped, "the weights were kept, and the record says so"
        again = await cluster.complete("a")
        assert again["choices"][0]["text"] == first["choices"][0]["text"], "the kept weights answer the same"
