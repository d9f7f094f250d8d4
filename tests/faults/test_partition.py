"""The node agent cut off from NATS while the scheduler, the gateway and the workers are not
(a partition between one service and the bus): its replicas are ``lost`` — their memory still
counted, never placed onto — while its workers keep serving; once the agent is back it stops
the workers no live record accounts for, the scheduler frees them on its confirmation and
places a replacement. No request is lost, no worker is left without a record."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import msgspec
from nats.aio.msg import Msg

from shoal.shared import subjects
from shoal.shared.messages import gpu_record_decoder
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.faults.harness import REPLICA_BYTES, Answer, FaultCluster, agent_cut_off_cluster

NODE_TTL_S = 3.0
CUT_S = 4 * NODE_TTL_S
"""Long enough for the node to be gone several times over (what a 30 s cut does with the
default 15 s node TTL), short enough for CI."""


def is_running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def held_bytes(cluster: FaultCluster) -> int:
    return sum(e.value.reserved_bytes for e in (await cluster.bus.gpus.get_all()).values())


async def test_an_agent_cut_off_from_nats_leaves_no_orphan_and_loses_no_request(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    async with agent_cut_off_cluster(nats_server.url, demo_models_root, tmp_path / "logs",
                                     node_ttl_s=NODE_TTL_S) as (proxy, cluster):
        (replica,) = await cluster.wait_serving("m")
        pid = (await cluster.worker_pids())[replica.replica_id]
        freed_while_running: list[bool] = []

        async def on_gpu_write(msg: Msg) -> None:  # the instant its bytes stop being counted
            with contextlib.suppress(msgspec.DecodeError):
                gpu = gpu_record_decoder.decode(msg.data)
                if not freed_while_running and replica.replica_id not in {o.replica_id for o in gpu.occupants}:
                    freed_while_running.append(is_running(pid))

        await cluster.bus.nc.subscribe(f"$KV.{subjects.GPUS_BUCKET}.>", cb=on_gpu_write)
        answers: list[asyncio.Task[Answer]] = [asyncio.create_task(cluster.complete("m")) for _ in range(4)]

        proxy.cut()
        cut_at = time.monotonic()

        async def lost() -> bool:
            records = await cluster.replicas("m")
            return any(r.replica_id == replica.replica_id and r.state == "lost" for r in records)

        await cluster.wait_for(lost, "the cut-off node's replica marked lost", timeout_s=30)
        lost_after_s = time.monotonic() - cut_at
        assert await held_bytes(cluster) == REPLICA_BYTES, "a lost replica's memory stays counted"
        # Its worker still runs and still serves (it never lost the bus): requests keep their answers.
        answers += [asyncio.create_task(cluster.complete("m")) for _ in range(4)]
        while time.monotonic() - cut_at < CUT_S:
            for entry in (await cluster.bus.gpus.get_all()).values():
                assert entry.value.reserved_bytes <= entry.value.total_bytes, entry.value
            assert cluster.agent._replicas[replica.replica_id].process is not None
            await asyncio.sleep(0.5)

        proxy.restore()
        restored_at = time.monotonic()
        (replacement,) = await cluster.wait_serving("m", timeout_s=90)
        replaced_after_s = time.monotonic() - restored_at
        assert replacement.replica_id != replica.replica_id

        async def old_replica_gone() -> bool:
            return replica.replica_id not in await cluster.worker_pids() and \
                replica.replica_id not in {r.replica_id for r in await cluster.replicas()}

        await cluster.wait_for(old_replica_gone, "the orphaned worker stopped and freed", timeout_s=60)
        assert cluster.agent._replicas.get(replica.replica_id) is None
        assert pid not in (await cluster.worker_pids()).values()
        for answer in await asyncio.gather(*answers):
            assert answer.status == 200, answer.body
            assert answer.body["usage"]["completion_tokens"] == 48
        assert freed_while_running == [False], "its memory was counted free only once its worker had exited"
        await cluster.assert_no_orphans()
        await cluster.assert_memory_matches_records()
        assert await held_bytes(cluster) == sum(replacement.gpu_bytes.values()), "only the replacement holds memory"
        print(f"\nPARTITION agent cut {CUT_S:.0f}s (node TTL {NODE_TTL_S:.0f}s): replica lost after "
              f"{lost_after_s:.1f}s, replacement serving {replaced_after_s:.1f}s after the cut healed, "
              f"{len(answers)}/{len(answers)} requests answered")
