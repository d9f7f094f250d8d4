"""`remove` of a model stops every replica it has — a held one (``stopping``, after a node step
that failed) included, which no placement pass may evict — and deletes its request consumer:
nothing of the model runs or waits afterwards. A command on the model that another scheduler
removes while it runs answers 404; a wake of it ends."""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path

import msgspec
import nats.js.errors
import pytest
from nats.aio.msg import Msg

from shoal.shared import subjects
from shoal.shared.config import NodeConfig
from shoal.shared.messages import ModelSpec
from shoal.shared.micro import RequestError
from shoal.shared.model_settings import FairnessSettings, SleepSettings
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.faults.harness import fault_cluster, model


async def test_remove_stops_held_replicas_and_deletes_the_consumer(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    # Neither the scheduler's reconciler nor the node agent's (which stops the worker of a
    # ``stopping`` record by itself) may act on the held replica before `remove` does.
    node = NodeConfig(node_id="n", models_root=str(demo_models_root), heartbeat_interval_s=1.0,
                      reconcile_interval_s=3600.0)
    async with fault_cluster(nats_server.url, demo_models_root, tmp_path / "logs",
                             [model("m", min_replicas=2), model("keep")],
                             reconcile_interval_s=3600.0, node=node) as cluster:
        first, second = await cluster.wait_serving("m", 2)
        await cluster.wait_serving("keep")
        scheduler = cluster.schedulers[0]
        # A failed park leaves a replica held: memory counted, its worker still running.
        await scheduler.store.hold_replica(second, "to_cache failed")
        assert {r.state for r in await cluster.replicas("m")} == {"ready", "stopping"}
        assert {first.replica_id, second.replica_id} <= (await cluster.worker_pids()).keys()

        reply = await scheduler.remove("m")

        assert reply.ok, reply
        assert await cluster.replicas("m") == []
        assert (await cluster.worker_pids()).keys().isdisjoint({first.replica_id, second.replica_id})
        assert await cluster.bus.models.get(subjects.model_token("m")) is None
        with pytest.raises(nats.js.errors.NotFoundError):
            await cluster.bus.js.consumer_info(subjects.REQUESTS_STREAM, subjects.consumer_name("m"))
        for entry in (await cluster.bus.gpus.get_all()).values():
            assert {o.model for o in entry.value.occupants} == {"keep"}, entry.value
        # The other model is untouched.
        assert (await cluster.complete("keep")).status == 200
        await cluster.assert_no_orphans()
        await cluster.assert_memory_matches_records()


async def test_a_command_racing_a_removal_by_another_scheduler_answers_404(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with fault_cluster(nats_server.url, demo_models_root, tmp_path / "logs", [model("m", min_replicas=0)],
                             num_schedulers=2) as cluster:
        first, second = cluster.schedulers
        inspect = first._registry.inspect

        async def removed_by_the_other_meanwhile(spec: ModelSpec) -> ModelSpec:
            # The command has found `m`; the other scheduler removes it before the placement pass.
            inspected = await inspect(spec)
            assert (await second.remove(spec.key)).ok
            return inspected

        monkeypatch.setattr(first._registry, "inspect", removed_by_the_other_meanwhile)
        for command in (functools.partial(first.scale, "m", 1), functools.partial(first.ensure, "m", 1)):
            await first.register(model("m", min_replicas=0))
            with pytest.raises(RequestError) as raised:
                await command()
            assert raised.value.code == 404, raised.value
            assert "'m' is not registered" in str(raised.value)
            assert await cluster.replicas("m") == []

        monkeypatch.undo()
        await first.register(model("m", min_replicas=0))
        assert (await first.scale("m", 1)).ok
        await cluster.wait_serving("m")
        await cluster.assert_no_orphans()
        await cluster.assert_memory_matches_records()


async def test_a_wake_for_a_model_removed_meanwhile_ends_and_preempts_nobody(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    # `full` fills the GPU and will sleep by itself within `m`'s fairness wait: `m`'s wake waits.
    full = msgspec.structs.replace(model("full", min_replicas=4), sleep=SleepSettings(idle_timeout_s=60.0),
                                   fairness=FairnessSettings(min_runtime_s=0.0))
    waker = msgspec.structs.replace(model("m", min_replicas=0), fairness=FairnessSettings(max_wait_s=120.0))
    async with fault_cluster(nats_server.url, demo_models_root, tmp_path / "logs", [full, waker]) as cluster:
        before = {r.replica_id for r in await cluster.wait_serving("full", 4)}
        scheduler = cluster.schedulers[0]
        cancelled: asyncio.Queue[dict[str, object]] = asyncio.Queue()

        async def on_cancelled(msg: Msg) -> None:
            await cancelled.put(json.loads(msg.data))

        await cluster.bus.nc.subscribe(subjects.event_subject("wake_cancelled"), cb=on_cancelled)

        assert (await scheduler.ensure("m", 1)).status == "waking"
        assert scheduler.wakes.phase_of("m") == "waiting"
        assert (await scheduler.remove("m")).ok

        event = await asyncio.wait_for(cancelled.get(), timeout=10.0)
        assert (event["model"], event["message"]) == ("m", "m was removed")

        async def wake_ended() -> bool:
            return scheduler.wakes.phase_of("m") is None

        await cluster.wait_for(wake_ended, "the wake to end", timeout_s=5.0)
        assert {r.replica_id for r in await cluster.serving("full")} == before
        await cluster.assert_no_orphans()
        await cluster.assert_memory_matches_records()
