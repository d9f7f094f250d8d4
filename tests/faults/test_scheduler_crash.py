"""A scheduler process killed (SIGKILL) or stopped (SIGTERM) at the steps of a pass: after the
GPU reservation, after the replica record turns ``pending`` (create not yet carried out) or
``draining`` (stop or park not yet carried out). What a SIGKILL leaves, the next scheduler
repairs from the records alone (lapsed reservations go, stalled node steps are sent again); a
SIGTERM leaves nothing to repair (the steps under way finish first). At no instant does any
GPU hold more than its total, and in the end every worker has a live record and every occupant
a record."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
from nats.aio.msg import Msg

from shoal.services.scheduler.liveness import get_live_scheduler_ids
from shoal.shared import subjects
from shoal.shared.messages import (
    GpuRecord,
    RegisterModel,
    ReplicaRecord,
    ScaleModel,
    SchedulerCommand,
    gpu_record_decoder,
    replica_record_decoder,
)
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.faults.harness import FaultCluster, fault_cluster, model

CONFIG = """\
demo_models = false
[nats]
url = "{url}"
[scheduler]
scheduler_id = "{scheduler_id}"
reconcile_interval_s = 0.5
reservation_ttl_s = 2
stalled_step_s = 2
stop_grace_s = 60
[logging]
format = "json"
"""


@contextlib.contextmanager
def scheduler_process(nats_url: str, scheduler_id: str, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`shoal scheduler` as its own process (killed, if still running, on the way out)."""
    config = tmp_path / f"{scheduler_id}.toml"
    config.write_text(CONFIG.format(url=nats_url, scheduler_id=scheduler_id))
    with open(tmp_path / f"{scheduler_id}.log", "wb") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "shoal.cli.main", "scheduler", "--config", str(config)],
                                   stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait(timeout=30)


async def wait_live(cluster: FaultCluster, scheduler_id: str) -> None:
    async def answers() -> bool:
        return scheduler_id in (await get_live_scheduler_ids(cluster.bus.nc) or set())

    await cluster.wait_for(answers, f"scheduler {scheduler_id} up", timeout_s=60)


async def send(cluster: FaultCluster, verb: str, command: SchedulerCommand) -> None:
    """Send a command without waiting for its reply (its scheduler may die first)."""
    await cluster.bus.nc.publish(subjects.scheduler_subject(verb), msgspec.json.encode(command),
                                 reply=cluster.bus.nc.new_inbox())


class Tripwire:
    """Signals a process the moment a KV write matches (a core subscription on the bucket's
    subjects: the message arrives as the write commits), and checks every GPU write against
    its total."""

    def __init__(self) -> None:
        self.over_committed: list[GpuRecord] = []
        self._armed: tuple[int, int, Callable[[ReplicaRecord | GpuRecord], bool]] | None = None
        self.fired = asyncio.Event()

    def arm(self, pid: int, sig: int, matches: Callable[[ReplicaRecord | GpuRecord], bool]) -> None:
        self.fired.clear()
        self._armed = (pid, sig, matches)

    async def on_write(self, msg: Msg) -> None:
        if not msg.data:
            return
        try:
            is_gpu = msg.subject.startswith(f"$KV.{subjects.GPUS_BUCKET}.")
            value: ReplicaRecord | GpuRecord = (gpu_record_decoder if is_gpu else replica_record_decoder).decode(msg.data)
        except Exception:
            return
        if isinstance(value, GpuRecord) and value.reserved_bytes > value.total_bytes:
            self.over_committed.append(value)
        if self._armed is not None and self._armed[2](value):
            pid, sig, _ = self._armed
            self._armed = None
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            self.fired.set()


def reserved_for(model_key: str) -> Callable[[ReplicaRecord | GpuRecord], bool]:
    return lambda v: isinstance(v, GpuRecord) and any(o.model == model_key and o.state == "reserved"
                                                      for o in v.occupants)


def record_in(state: str) -> Callable[[ReplicaRecord | GpuRecord], bool]:
    return lambda v: isinstance(v, ReplicaRecord) and v.state == state and (state != "pending" or v.level == "HOT")


async def settled(cluster: FaultCluster, num_serving: int) -> bool:
    """`num_serving` replicas of m serve, no record waits for a node step, and every record
    (HOT or parked WARM) has its worker."""
    records = await cluster.replicas("m")
    if any(r.state in ("pending", "draining", "stopping", "failed", "lost") for r in records):
        return False
    return len([r for r in records if r.serving]) == num_serving and \
        (await cluster.worker_pids()).keys() == {r.replica_id for r in records}


async def test_a_scheduler_killed_or_stopped_at_each_step_of_a_pass_leaves_state_that_repairs_itself(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    url = nats_server.url
    async with fault_cluster(url, demo_models_root, tmp_path / "logs", [], num_schedulers=0) as cluster:
        tripwire = Tripwire()
        for bucket in (subjects.GPUS_BUCKET, subjects.REPLICAS_BUCKET):
            await cluster.bus.nc.subscribe(f"$KV.{bucket}.>", cb=tripwire.on_write)
        timings: list[str] = []

        async def crash_at(name: str, sig: int, verb: str, command: SchedulerCommand,
                           matches: Callable[[ReplicaRecord | GpuRecord], bool]) -> None:
            """Start a scheduler, send it `command`, signal it at the write `matches`."""
            with scheduler_process(url, name, tmp_path) as process:
                await wait_live(cluster, name)
                tripwire.arm(process.pid, sig, matches)
                await send(cluster, verb, command)
                await asyncio.wait_for(tripwire.fired.wait(), timeout=60)
                await asyncio.to_thread(process.wait, 90)
                assert process.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 0), process.returncode

        async def repaired_by(name: str | None, num_serving: int, what: str) -> None:
            started = time.monotonic()
            with contextlib.ExitStack() as stack:
                if name is not None:  # the next scheduler (a restart) repairs what the last one left
                    stack.enter_context(scheduler_process(url, name, tmp_path))
                await cluster.wait_for(lambda: settled(cluster, num_serving), what, timeout_s=120)
                await cluster.assert_no_orphans()
                await cluster.assert_memory_matches_records()
            timings.append(f"{what}: {time.monotonic() - started:.1f}s")

        # Register through a first scheduler: SIGKILL once the GPU reservation is written.
        spec = msgspec.structs.replace(model("m", min_replicas=0), desired_replicas=1)
        await crash_at("s1", signal.SIGKILL, "register", RegisterModel(spec), reserved_for("m"))
        await repaired_by("s2", 1, "SIGKILL after reserving")
        # SIGKILL once the record is draining (the stop not yet carried out).
        await crash_at("s3", signal.SIGKILL, "scale", ScaleModel("m", 0), record_in("draining"))
        await repaired_by("s4", 0, "SIGKILL while draining")
        # SIGKILL once the new record is pending (the create not yet carried out).
        await crash_at("s5", signal.SIGKILL, "scale", ScaleModel("m", 1), record_in("pending"))
        await repaired_by("s6", 1, "SIGKILL while pending")
        # SIGTERM at the same steps: the step under way finishes, nothing is left to repair.
        await crash_at("s7", signal.SIGTERM, "scale", ScaleModel("m", 0), record_in("draining"))
        await repaired_by(None, 0, "SIGTERM while draining (no scheduler left)")
        await crash_at("s8", signal.SIGTERM, "scale", ScaleModel("m", 1), record_in("pending"))
        await repaired_by(None, 1, "SIGTERM while pending (no scheduler left)")

        assert tripwire.over_committed == []
        print("\nSCHEDULER CRASH repaired: " + "; ".join(timings))
