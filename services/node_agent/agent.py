"""The node agent: one per machine.

Registers the node and its GPUs, heartbeats, spawns and stops one worker
process per replica on the scheduler's command, turns workers' lifecycle
reports into replica state (CAS on ``shoal_replicas``), records each model's
measured serving memory, and restarts a worker that a CUDA error ended (its exit
status `WORKER_EXIT_DEVICE_ERROR`, or a device-side assert in its log), up to
`MAX_ASSERT_RESTARTS` times. Exposed as the ``shoal-node-agent`` micro service on
``shoal.node.<node id>.<verb>``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hmac
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import structlog
from nats.micro import add_service
from nats.micro.service import Service

from shoal.services.node_agent.forkserver import ForkedWorker, ForkServerClient
from shoal.services.node_agent.gpus import NodeGpus, host_ram_bytes, nvml_process_bytes
from shoal.services.node_agent.model_files import ModelInspectionError, inspect_model
from shoal.services.node_agent.processes import (
    WorkerProcess,
    describe_exit,
    spawn_worker,
    tail_log,
    worker_env,
)
from shoal.services.node_agent.reconcile import Repair, plan_repairs
from shoal.services.node_agent.release import record_parked, record_stopped
from shoal.services.node_agent.worker_logs import tidy_worker_logs
from shoal.services.worker.launch import WORKER_EXIT_DEVICE_ERROR, WorkerLaunch
from shoal.shared import subjects
from shoal.shared.bus import Bus, cas_update, publish_event
from shoal.shared.config import LoggingConfig, NatsConfig, NodeConfig, WorkerConfig
from shoal.shared.messages import (
    CacheReplica,
    CreateReplica,
    Event,
    GpuRecord,
    InspectModel,
    ModelFacts,
    ModelSpec,
    NodeRecord,
    NodeReply,
    Occupant,
    OccupantState,
    ReplicaFailed,
    ReplicaRecord,
    RestoreReplica,
    StopReplica,
    WorkerEvent,
    WorkerReply,
    cache_replica_decoder,
    create_replica_decoder,
    inspect_model_decoder,
    now,
    restore_replica_decoder,
    scheduler_reply_decoder,
    stop_replica_decoder,
    worker_event_decoder,
    worker_reply_decoder,
)
from shoal.shared.metrics import Registry
from shoal.shared.micro import RequestError, ServiceCallError, add_json_endpoint, request_json
from shoal.shared.periodic import sleep_or_stop
from shoal.shared.placement.memory_figure import next_measured_figure
from shoal.shared.replica_state import GIVEN_UP, mark_lost
from shoal.shared.version import SHOAL_VERSION

log = structlog.get_logger(__name__)

MAX_ASSERT_RESTARTS = 3
DEVICE_ASSERT_MARKER = "device-side assert triggered"
WORKER_CONTROL_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0
"""A stopping worker is killed this long after its model's drain timeout (it should exit by then)."""
STOPPED_BEFORE_CREATE_S = 600.0
STOPPED_BEFORE_CREATE_MAX = 4096
"""How long, and how many of, the replicas stopped before their create arrived are remembered."""


@dataclass
class _Replica:
    record: ReplicaRecord
    spec: ModelSpec
    process: WorkerProcess | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    num_assert_restarts: int = 0
    event_token: str = ""
    """Given to the worker process in its launch; its events must carry it (`_on_worker_event`)."""


def rebuild_occupants(node_id: str, gpu_index: int, records: list[ReplicaRecord], at: float) -> list[Occupant]:
    """A GPU's occupants as this node's replica records account for them (a GPU record that
    no longer decodes is rebuilt from these, the agent's own copy for the workers it runs):
    every HOT replica's bytes on that GPU, held (draining) unless it serves."""
    occupants = []
    for record in records:
        num_bytes = record.gpu_bytes.get(gpu_index, 0)
        if record.node_id != node_id or record.level != "HOT" or not num_bytes:
            continue
        state: OccupantState = ("serving" if record.state == "ready" else
                                "loading" if record.state == "loading" else "draining")
        occupants.append(Occupant(replica_id=record.replica_id, model=record.model, num_bytes=num_bytes,
                                  state=state, since=at, last_accessed=record.last_request_at))
    return occupants


class NodeAgent:
    """See the module doc. `start()` registers and serves; `stop()` stops every worker."""

    def __init__(
        self,
        bus: Bus,
        gpus: NodeGpus,
        node: NodeConfig,
        worker: WorkerConfig,
        logging: LoggingConfig,
        *,
        nats_url: str,
        log_dir: Path,
        metrics: Registry | None = None,
        nats_config: NatsConfig | None = None,
    ) -> None:
        """Args:
        node: this node's settings, with `node_id` set and `models_root` absolute (workers
            and inspections resolve model paths against it).
        worker: handed to every worker this agent starts.
        nats_url: the URL workers connect to.
        nats_config: the connection settings workers get (in their launch, on stdin: never on a
            command line), with its ``workers`` credentials when set (`NatsConfig.for_workers`).
        log_dir: one log file per worker.
        """
        assert node.node_id, "the node agent needs its node id resolved (NodeConfig.node_id_or_default)"
        assert Path(node.models_root).is_absolute(), "the node agent needs an absolute models root"
        self._bus = bus
        self._gpus = gpus
        self._node = node
        self._worker = worker
        self._logging = logging
        self._nats_url = nats_url
        self._nats_config = nats_config or NatsConfig()
        self._log_dir = log_dir
        self._fork_server = ForkServerClient(log_dir, worker_env()) if node.worker_fork_server else None
        self._inspecting = asyncio.Lock()
        self._replicas: dict[str, _Replica] = {}
        self._stopping: dict[str, WorkerProcess] = {}
        """Workers being stopped (no longer in `_replicas`): a second stop waits for their exit."""
        self._stopped_before_create: collections.OrderedDict[str, float] = collections.OrderedDict()
        """Replicas told to stop while they ran no worker here, oldest first: a create and a stop
        for a pending replica may arrive out of order, and its create must then start nothing."""
        self._tasks: set[asyncio.Task[object]] = set()
        self._service: Service | None = None
        self._started_at = now()
        registry = metrics or Registry()
        self._workers_gauge = registry.gauge("shoal_node_workers", "Worker processes running", ["node"])
        self._failures = registry.counter("shoal_node_worker_failures_total", "Workers that died unasked", ["node"])
        self._failures.inc(0, node=node.node_id)  # a sample from the start: rate() and alerts see the first failure
        self._starts = registry.counter("shoal_node_worker_starts_total",
                                        "Workers started, forked by the fork server or spawned", ["node", "how"])
        self._sleep_seconds = registry.histogram("shoal_node_sleep_duration_seconds",
                                                 "A park: drain, engine closed, weights to CPU RAM", ["model"])
        self._restore_seconds = registry.histogram("shoal_node_restore_duration_seconds",
                                                   "A restore: weights back on the GPU, engine rebuilt", ["model"])

    @property
    def node_id(self) -> str:
        return self._node.node_id

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._fork_server is not None:
            await self._fork_server.start()  # its imports run while the agent registers
        await self._register_gpus()
        await self._heartbeat_once()
        await self._hand_back_orphaned_replicas()
        self._service = await add_service(
            self._bus.nc,
            name="shoal-node-agent",
            version=SHOAL_VERSION,
            description=f"Shoal node agent of {self.node_id}: worker processes, GPUs, model inspection",
            metadata={"node_id": self.node_id},
        )
        service, subject = self._service, functools.partial(subjects.node_subject, self.node_id)
        await add_json_endpoint(service, "create", subject("create"), create_replica_decoder.decode, self._on_create)
        await add_json_endpoint(service, "stop", subject("stop"), stop_replica_decoder.decode, self._on_stop)
        await add_json_endpoint(service, "to_cache", subject("to_cache"), cache_replica_decoder.decode,
                                self._on_to_cache)
        await add_json_endpoint(service, "from_cache", subject("from_cache"), restore_replica_decoder.decode,
                                self._on_from_cache)
        await add_json_endpoint(service, "worker_event", subject("worker_event"), worker_event_decoder.decode,
                                self._on_worker_event)
        # Any node agent can size a model (they all see the models root): one shared, queue-grouped subject.
        await add_json_endpoint(self._service, "inspect", subjects.NODE_INSPECT, inspect_model_decoder.decode,
                                self._on_inspect)
        # NATS may be reconnecting when a round fails: the next one retries.
        self._spawn_task(_every(self._node.heartbeat_interval_s, self._heartbeat_once, "heartbeat_failed"))
        self._spawn_task(_every(self._node.reconcile_interval_s, self.reconcile, "node_reconcile_failed"))
        log.info("node_agent_started", node=self.node_id, gpus=len(self._gpus.gpus), virtual=self._gpus.virtual)

    async def stop(self) -> None:
        """Stop every worker (they drain), then the heartbeat and the service."""
        await asyncio.gather(
            *(r.process.stop() for r in self._replicas.values() if r.process), return_exceptions=True
        )
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._fork_server is not None:
            await self._fork_server.close()
        if self._service is not None:
            await self._service.stop()
        with contextlib.suppress(Exception):
            await self._bus.nodes.delete(self.node_id)
        log.info("node_agent_stopped", node=self.node_id)

    def _spawn_task(self, coro: Coroutine[Any, Any, object]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ registration

    def _node_record(self) -> NodeRecord:
        return NodeRecord(
            node_id=self.node_id,
            hostname=socket.gethostname(),
            gpus=self._gpus.gpus,
            cpu_ram_bytes=self._node.cpu_ram_bytes or host_ram_bytes(),
            virtual=self._gpus.virtual,
            heartbeat_at=now(),
            started_at=self._started_at,
            version=SHOAL_VERSION,
            num_workers=sum(1 for r in self._replicas.values() if r.process),
        )

    async def _heartbeat_once(self) -> None:
        await self._bus.nodes.put(self.node_id, self._node_record())
        self._workers_gauge.set(sum(1 for r in self._replicas.values() if r.process), node=self.node_id)

    async def _register_gpus(self) -> None:
        """Create this node's GPU keys, or bring their capacity up to date (keeping occupants).
        A key whose value does not decode is rebuilt from the replica records of this node
        (CAS at its revision): until then placement leaves that GPU out."""
        records: list[ReplicaRecord] | None = None
        for gpu in self._gpus.gpus:
            key = subjects.gpu_kv_key(self.node_id, gpu.index)
            value, revision = await self._bus.gpus.read(key)
            occupants: list[Occupant] = []
            if value is None and revision is not None:
                if records is None:
                    # The workers this agent runs count as their own records say (a record may
                    # not decode either); the other records of this node as they read.
                    own = {rid: msgspec.structs.replace(r.record, state="ready" if r.ready.is_set() else "loading")
                           for rid, r in self._replicas.items() if r.process is not None}
                    read = {e.value.replica_id: e.value for e in (await self._bus.replicas.get_all()).values()}
                    records = list({**read, **own}.values())
                occupants = rebuild_occupants(self.node_id, gpu.index, records, now())
                log.error("gpu_record_rebuilt", gpu=key, num_occupants=len(occupants))

            def mutate(current: GpuRecord | None, gpu=gpu, occupants=occupants) -> GpuRecord | None:  # type: ignore[no-untyped-def]
                if current is None:
                    return GpuRecord(node_id=self.node_id, index=gpu.index, total_bytes=gpu.total_bytes,
                                     name=gpu.name, virtual=gpu.virtual, occupants=occupants, updated_at=now())
                if current.total_bytes == gpu.total_bytes and current.name == gpu.name:
                    return None
                return msgspec.structs.replace(current, total_bytes=gpu.total_bytes, name=gpu.name, updated_at=now())

            await cas_update(self._bus.gpus, key, mutate)

    # ------------------------------------------------------------------ reconciliation

    async def reconcile(self) -> None:
        """One round of `reconcile.plan_repairs`: workers against records; GPU keys repaired."""
        await self._register_gpus()
        malformed: set[str] = set()
        entries = await self._bus.replicas.get_all(malformed=malformed)
        records = {e.value.replica_id: e.value for e in entries.values()}
        running = {rid for rid, r in self._replicas.items()
                   if r.process is not None and r.process.process.returncode is None}
        # Launching, or exited and in the hands of its watcher (failed, or restarted): not ours to judge.
        starting = set(self._replicas) - running
        malformed_ids = {key.split(".", 1)[-1] for key in malformed}
        for repair in plan_repairs(self.node_id, running, records, malformed_ids=malformed_ids,
                                   starting_ids=starting):
            await self._apply_repair(repair, malformed)
        tidied = await asyncio.to_thread(tidy_worker_logs, self._log_dir, {*self._replicas, *self._stopping})
        if tidied.rotated or tidied.deleted:
            log.info("worker_logs_tidied", rotated=list(tidied.rotated), deleted=len(tidied.deleted))

    async def _apply_repair(self, repair: Repair, malformed_keys: set[str]) -> None:
        log.warning("node_repair", kind=repair.kind, replica=repair.replica_id, reason=repair.reason)
        match repair.kind:
            case "stop_worker":
                replica = self._replicas.get(repair.replica_id)
                if replica is not None and replica.process is not None:
                    replica.process.stopping = True  # asked for: its exit is no failure
                    self._replicas.pop(repair.replica_id, None)
                    self._spawn_task(self._stop_process(repair.replica_id, replica.process,
                                                        replica.spec.sleep.drain_timeout_s + STOP_GRACE_S))
            case "rewrite_record":
                replica = self._replicas.get(repair.replica_id)
                if replica is None:
                    return
                key = subjects.replica_kv_key(replica.record.model, replica.record.replica_id)
                if key not in malformed_keys:
                    return
                _, revision = await self._bus.replicas.read(key)
                if revision is not None:
                    state = "ready" if replica.ready.is_set() else "loading"
                    await self._bus.replicas.update(key, msgspec.structs.replace(replica.record, state=state,
                                                                                 updated_at=now()), revision)
            case "fail_record":
                assert repair.record is not None, "a record to fail"
                await self._mark_failed(repair.record.model, repair.replica_id, repair.reason)
            case "stopped_record":
                assert repair.record is not None, "a record that was stopping"
                await record_stopped(self._bus, repair.record)

    async def _hand_back_orphaned_replicas(self) -> None:
        """Replicas recorded on this node from before a restart have no worker any more: they are
        ``lost``, as on a node that died (the scheduler's reconciler frees their memory once this
        agent confirms, and places the desired ones again), not failed: a restart, planned or
        not, says nothing against the model (its failure count and backoff are its own)."""
        error = "node agent restarted; its worker is gone"
        for entry in (await self._bus.replicas.get_all()).values():
            record = entry.value
            if record.node_id == self.node_id and record.replica_id not in self._replicas \
                    and record.state not in GIVEN_UP:
                await cas_update(self._bus.replicas, subjects.replica_kv_key(record.model, record.replica_id),
                                 lambda current: mark_lost(current, error, now()))
                log.warning("replica_lost", model=record.model, replica=record.replica_id, error=error)
                await publish_event(self._bus.js, Event("replica_stopped", now(), error, record.model,
                                                        record.replica_id, self.node_id))

    # ------------------------------------------------------------------ commands

    async def _on_inspect(self, command: InspectModel) -> ModelFacts:
        try:
            # One at a time: inspections are cheap, and transformers' lazy first import is not
            # safe from several threads at once.
            async with self._inspecting:
                return await asyncio.to_thread(
                    functools.partial(inspect_model, on_cpu=self._gpus.virtual),
                    self._node.models_root, command, self._worker.runtime_overhead_bytes,
                )
        except ModelInspectionError as exc:
            raise RequestError(404, str(exc)) from exc

    async def _on_create(self, command: CreateReplica) -> NodeReply:
        return await self._create(command.replica, command.model)

    async def _on_stop(self, command: StopReplica) -> NodeReply:
        return await self._stop_replica(command.replica_id, command.reason)

    async def _on_to_cache(self, command: CacheReplica) -> NodeReply:
        return await self._to_cache(command.replica_id, drop_weights=command.drop_weights)

    async def _on_from_cache(self, command: RestoreReplica) -> NodeReply:
        return await self._from_cache(command.replica)

    async def _create(self, record: ReplicaRecord, spec: ModelSpec) -> NodeReply:
        if record.node_id != self.node_id:
            raise RequestError(400, f"replica {record.replica_id} is placed on {record.node_id}, not {self.node_id}")
        unknown = [i for i in record.gpu_bytes if i not in {g.index for g in self._gpus.gpus}]
        if unknown:
            raise RequestError(400, f"replica {record.replica_id} names GPUs this node lacks: {unknown}")
        if record.replica_id in self._stopped_before_create:
            log.info("create_after_stop_ignored", replica=record.replica_id, model=record.model)
            return NodeReply(ok=True, message="stopped before its create arrived")
        stored, revision = await self._bus.replicas.read(subjects.replica_kv_key(record.model, record.replica_id))
        if revision is None or (stored is not None and (stored.node_id != self.node_id or stored.state in GIVEN_UP)):
            # Freed before its create arrived (a rolled-back placement, a stalled step sent again
            # from a stale read): a worker started now would hold memory nobody counts.
            log.info("create_without_record_ignored", replica=record.replica_id, model=record.model,
                     state=stored.state if stored else None)
            return NodeReply(ok=True, message="no record to start it for: freed before its create arrived")
        existing = self._replicas.get(record.replica_id)
        if existing is not None and existing.process is None:
            return NodeReply(ok=True, message="already starting")  # a create sent again meanwhile
        if existing and existing.process and existing.process.process.returncode is None:
            return NodeReply(ok=True, message="already running", pid=existing.process.pid)
        replica = _Replica(record=record, spec=spec)
        self._replicas[record.replica_id] = replica
        await self._launch(replica)
        assert replica.process is not None, "_launch must leave a process behind"
        return NodeReply(ok=True, message="spawned", pid=replica.process.pid)

    async def _launch(self, replica: _Replica) -> None:
        replica.event_token = secrets.token_hex(16)  # a new process, a new token
        launch = WorkerLaunch(nats_url=self._nats_url, nats=self._nats_config.for_workers(self._nats_url),
                              event_token=replica.event_token,
                              node_id=self.node_id, models_root=self._node.models_root,
                              device=self._gpus.device, replica=replica.record, model=replica.spec,
                              worker=self._worker, logging=self._logging)
        replica.ready.clear()
        replica.process = process = await spawn_worker(launch, self._log_dir, self._fork_server)
        self._starts.inc(node=self.node_id, how="forked" if isinstance(process.process, ForkedWorker) else "spawned")
        if self._replicas.get(replica.record.replica_id) is not replica:
            # Stopped (or failed) while it started: a fork may wait for its server's imports.
            log.info("worker_stopped_while_starting", replica=replica.record.replica_id, pid=process.pid)
            process.stopping = True
            await self._stop_process(replica.record.replica_id, process, STOP_GRACE_S)
            return
        await self._set_state(replica.record, "loading", pid=replica.process.pid, phase="starting")
        self._spawn_task(self._watch(replica, replica.process))
        self._spawn_task(self._start_deadline(replica, replica.process))

    async def _stop_replica(self, replica_id: str, reason: str) -> NodeReply:
        """Stop a worker (it drains first). A replica evicted to COLD (its record ``draining``,
        leaving to COLD) leaves its GPUs and the records only now, once its process is gone —
        also when it was gone already (a stop sent again after a scheduler died)."""
        replica = self._replicas.pop(replica_id, None)
        if replica is None or replica.process is None:
            self._remember_stopped_before_create(replica_id)
            if (stopping := self._stopping.get(replica_id)) is not None:
                await stopping.process.wait()  # confirmed only once that stop is through
            for entry in (await self._bus.replicas.get_all()).values():
                if entry.value.replica_id == replica_id and entry.value.node_id == self.node_id:
                    await record_stopped(self._bus, entry.value)
            return NodeReply(ok=True, message="not running")
        log.info("worker_stopping", replica=replica_id, reason=reason)
        code = await self._stop_process(replica_id, replica.process, replica.spec.sleep.drain_timeout_s + STOP_GRACE_S)
        await record_stopped(self._bus, replica.record)
        await publish_event(self._bus.js, Event("replica_stopped", now(), reason, replica.record.model, replica_id,
                                                self.node_id, data={"exit_code": code}))
        return NodeReply(ok=True, message=f"stopped (exit {code})", pid=replica.process.pid)

    def _remember_stopped_before_create(self, replica_id: str) -> None:
        """Replica ids are never reused, so a create that comes later is stale: remember the id
        for `STOPPED_BEFORE_CREATE_S` (far beyond any create's time in flight), at most
        `STOPPED_BEFORE_CREATE_MAX` of them."""
        stamp = time.monotonic()
        self._stopped_before_create[replica_id] = stamp
        self._stopped_before_create.move_to_end(replica_id)
        while self._stopped_before_create and (
                len(self._stopped_before_create) > STOPPED_BEFORE_CREATE_MAX
                or next(iter(self._stopped_before_create.values())) < stamp - STOPPED_BEFORE_CREATE_S):
            self._stopped_before_create.popitem(last=False)

    async def _stop_process(self, replica_id: str, process: WorkerProcess, timeout_s: float) -> int | None:
        """Stop a worker no longer in `_replicas`, known as stopping until it has exited."""
        self._stopping[replica_id] = process
        try:
            return await process.stop(timeout_s)
        finally:
            if self._stopping.get(replica_id) is process:
                del self._stopping[replica_id]

    def _running(self, replica_id: str) -> _Replica:
        replica = self._replicas.get(replica_id)
        if replica is None or replica.process is None or replica.process.process.returncode is not None:
            raise RequestError(404, f"replica {replica_id} has no running worker on {self.node_id}")
        return replica

    async def _to_cache(self, replica_id: str, *, drop_weights: bool = False) -> NodeReply:
        """Park a replica WARM: its worker drains, drops its KV pool, moves its weights to CPU RAM
        (or, `drop_weights`, drops them: its record says which happened)."""
        replica = self._running(replica_id)
        started = time.monotonic()
        try:
            reply = await self._ask_worker(replica, "to_cache", CacheReplica(replica_id, drop_weights))
        except ServiceCallError as exc:
            raise RequestError(502, f"worker of {replica_id} did not park: {exc}") from exc
        self._sleep_seconds.observe(time.monotonic() - started, model=replica.record.model)
        pid = replica.process.pid if replica.process else None
        residual_by_gpu = self._measure_residue(replica.record, pid, reply.residual_bytes)
        dropped = drop_weights if reply.weights_dropped is None else reply.weights_dropped
        await record_parked(self._bus, replica.record, residual_by_gpu, weights_dropped=dropped)
        replica.record = msgspec.structs.replace(replica.record, level="WARM", state="sleeping", gpu_bytes={},
                                                 gpu_memory_fraction=None, leaving_to=None, weights_dropped=dropped)
        residual_bytes = sum(residual_by_gpu.values())
        if residual_bytes:
            log.warning("sleep_left_gpu_memory", replica=replica_id, residual_bytes=residual_bytes)
        await publish_event(self._bus.js, Event("replica_cached", now(), model=replica.record.model,
                                                replica_id=replica_id, node_id=self.node_id,
                                                data={"residual_bytes": residual_bytes}))
        return NodeReply(ok=True, message=reply.message, pid=pid)

    async def _ask_worker(self, replica: _Replica, verb: str, command: CacheReplica | RestoreReplica) -> WorkerReply:
        """`command` to `replica`'s worker, answered or failed once its worker exits: a worker
        stopped meanwhile (its model removed while it parked) answers nothing, and waiting out
        `WORKER_CONTROL_TIMEOUT_S` held the memory and every step waiting on it for 2 minutes."""
        assert replica.process is not None, "asked only of a running worker (`_running`)"
        asking = asyncio.ensure_future(request_json(
            self._bus.nc, subjects.worker_subject(replica.record.replica_id, verb), command, worker_reply_decoder,
            timeout_s=WORKER_CONTROL_TIMEOUT_S))
        exited = asyncio.ensure_future(replica.process.exited.wait())
        try:
            done, _ = await asyncio.wait([asking, exited], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in (asking, exited):
                waiting.cancel()  # a no-op on the one that is done
        if asking not in done:
            raise ServiceCallError(f"the worker exited before it answered {verb}")
        return asking.result()

    def _measure_residue(self, record: ReplicaRecord, pid: int | None, reported_bytes: int | None) -> dict[int, int]:
        """What a parked worker still holds on each of its GPUs: NVML per process on real GPUs
        (its CUDA context included), else what the worker reported (nothing on virtual GPUs)."""
        indices = sorted(record.gpu_bytes)
        if not self._gpus.virtual and pid:
            per_gpu = {i: nvml_process_bytes(pid, [i]) for i in indices}
            if all(v is not None for v in per_gpu.values()):
                return {i: int(v or 0) for i, v in per_gpu.items()}
        share = (reported_bytes or 0) // max(1, len(indices))
        return {i: share for i in indices}

    async def _from_cache(self, record: ReplicaRecord) -> NodeReply:
        """Bring a WARM replica back on its new allocation; it serves again once restored.

        A restore that fails stops the worker (its weights are in CPU RAM, its GPUs were
        handed to it: nothing may keep running there), marks the replica failed and answers
        with an error; the scheduler that asked reports the failure (once)."""
        replica = self._running(record.replica_id)
        replica.record = record
        await self._set_state(record, "loading", phase="loading_weights")
        started = time.monotonic()
        try:
            reply = await self._ask_worker(replica, "from_cache", RestoreReplica(record))
        except ServiceCallError as exc:
            await self._fail(replica, f"restore failed: {exc}", tell_scheduler=False)
            raise RequestError(502, f"worker of {record.replica_id} did not restore: {exc}") from exc
        self._restore_seconds.observe(time.monotonic() - started, model=record.model)
        pid = replica.process.pid if replica.process else None
        measured = self._measure(record, pid, reply.measured_bytes)
        await self._became_ready(replica, measured, None, restored=True)
        return NodeReply(ok=True, message=reply.message, pid=pid)

    # ------------------------------------------------------------------ worker lifecycle

    async def _on_worker_event(self, event: WorkerEvent) -> NodeReply:
        replica = self._replicas.get(event.replica_id)
        if replica is None:
            raise RequestError(404, f"replica {event.replica_id} is not managed by node {self.node_id}")
        if not hmac.compare_digest(event.token.encode(), replica.event_token.encode()):
            # Only the worker this agent started knows the token: anyone else on the bus could
            # otherwise report a replica ready, failed, or lower its model's measured memory.
            log.warning("worker_event_refused", replica=event.replica_id, kind=event.kind)
            raise RequestError(403, f"event for replica {event.replica_id} does not come from its worker")
        record = replica.record
        structlog.contextvars.bind_contextvars(model=record.model, replica=record.replica_id)
        if event.kind == "ready":
            replica.ready.set()
            await self._became_ready(replica, self._measure(record, event.pid, event.measured_bytes), event.pid,
                                     kv_cache_tokens=event.kv_cache_tokens)
        elif event.kind == "loading" and event.phase is not None:
            await self._set_state(record, "loading", phase=event.phase)
        elif event.kind == "failed":
            log.error("worker_reported_failure", error=event.message)
            # The worker exits by itself after reporting (and waits for this answer first).
            await self._fail(replica, event.message, wait_stopped=False)
        return NodeReply(ok=True)

    async def _became_ready(self, replica: _Replica, measured: int | None, pid: int | None, *,
                            restored: bool = False, kv_cache_tokens: int | None = None) -> None:
        record = replica.record
        changes: dict[str, object] = {"pid": pid, "measured_bytes": measured}
        if kv_cache_tokens is not None:
            changes["kv_cache_tokens"] = kv_cache_tokens
        if not restored:
            changes["ready_at"] = now()
        await self._set_state(record, "ready", **changes)
        await self._set_occupant_state(record, "serving")
        await self._record_ready_model(record.model, measured, restored=restored)
        await publish_event(self._bus.js, Event("replica_ready", now(), model=record.model,
                                                replica_id=record.replica_id, node_id=self.node_id,
                                                data={"measured_bytes": measured, "restored": restored}))

    def _measure(self, record: ReplicaRecord, pid: int | None, reported_bytes: int | None) -> int | None:
        """What a serving replica holds, the same way after a create and after a restore:
        on real GPUs what NVML says the worker process holds on the replica's GPUs (CUDA
        context included); on virtual GPUs (or when NVML cannot tell) what the worker
        reported (its weights plus its engine's KV pool and reserve)."""
        if not self._gpus.virtual and pid:
            return nvml_process_bytes(pid, record.gpu_bytes.keys()) or reported_bytes
        return reported_bytes

    async def _watch(self, replica: _Replica, process: WorkerProcess) -> None:
        code = await process.process.wait()
        process.exited.set()
        if process.stopping or replica.process is not process:
            return
        tail = tail_log(process.log_path)
        self._failures.inc(node=self.node_id)
        device_error = code == WORKER_EXIT_DEVICE_ERROR or DEVICE_ASSERT_MARKER in tail
        if device_error and replica.num_assert_restarts < MAX_ASSERT_RESTARTS:
            replica.num_assert_restarts += 1
            log.warning("worker_device_assert_restart", replica=replica.record.replica_id, exit_code=code)
            await self._launch(replica)
            return
        await self._fail(replica, describe_exit(code, tail))

    async def _start_deadline(self, replica: _Replica, process: WorkerProcess) -> None:
        try:
            await asyncio.wait_for(replica.ready.wait(), self._node.worker_start_timeout_s)
        except TimeoutError:
            if replica.process is process and process.process.returncode is None:
                log.error("worker_start_timeout", replica=replica.record.replica_id)
                await process.stop(timeout_s=5.0)
                await self._fail(replica, f"not ready after {self._node.worker_start_timeout_s}s")

    async def _fail(self, replica: _Replica, error: str, *, tell_scheduler: bool = True,
                    wait_stopped: bool = True) -> None:
        """A replica failed: its worker is stopped (no orphan keeps its GPU memory), it leaves
        this agent's table, and its record is marked failed.

        Args:
            tell_scheduler: False when the failure is the answer to a scheduler's command
                (that scheduler reports it): each failure is reported once.
            wait_stopped: False when the worker exits by itself and waits for us meanwhile.
        """
        record = replica.record
        if self._replicas.get(record.replica_id) is replica:
            del self._replicas[record.replica_id]
        process = replica.process
        if process is not None and process.process.returncode is None:
            process.stopping = True  # its exit is not another failure (`_watch`)
            if wait_stopped:
                await process.stop()
            else:
                self._spawn_task(process.stop())
        await self._mark_failed(record.model, record.replica_id, error, tell_scheduler=tell_scheduler)

    async def _mark_failed(self, model: str, replica_id: str, error: str, *, tell_scheduler: bool = True) -> None:
        log.error("replica_failed", model=model, replica=replica_id, error=error)
        key = subjects.replica_kv_key(model, replica_id)

        def mutate(current: ReplicaRecord | None) -> ReplicaRecord | None:
            if current is None:
                return None
            return msgspec.structs.replace(current, state="failed", error=error, updated_at=now())

        await cas_update(self._bus.replicas, key, mutate)
        await publish_event(self._bus.js, Event("replica_failed", now(), error, model, replica_id, self.node_id))
        if not tell_scheduler:
            return
        try:
            await request_json(
                self._bus.nc,
                subjects.scheduler_subject("replica_failed"),
                ReplicaFailed(model, replica_id, error),
                scheduler_reply_decoder,
            )
        except ServiceCallError as exc:  # the scheduler's reconciler picks it up later
            log.warning("scheduler_not_told_of_failure", error=str(exc))

    async def _set_state(self, record: ReplicaRecord, state: str, **changes: object) -> None:
        key = subjects.replica_kv_key(record.model, record.replica_id)

        def mutate(current: ReplicaRecord | None) -> ReplicaRecord | None:
            if current is None or current.state in ("failed", "stopping"):
                return None  # the scheduler has given up on it: a late report changes nothing
            fields = {k: v for k, v in changes.items() if v is not None}
            if state != "loading":
                fields["phase"] = None  # a phase says how far a loading replica is, nothing else
            return msgspec.structs.replace(current, state=state, updated_at=now(), **fields)

        await cas_update(self._bus.replicas, key, mutate)

    async def _set_occupant_state(self, record: ReplicaRecord, state: str) -> None:
        """Mark this replica's share of each of its GPUs (reserved -> serving, ...)."""
        for index in sorted(record.gpu_bytes):

            def mutate(current: GpuRecord | None) -> GpuRecord | None:
                if current is None or (occupant := current.find(record.replica_id)) is None:
                    return None
                stamp = now()
                updated = msgspec.structs.replace(occupant, state=state, since=stamp, last_accessed=stamp,
                                                  expires_at=None)
                occupants = [updated if o.replica_id == record.replica_id else o for o in current.occupants]
                return msgspec.structs.replace(current, occupants=occupants, updated_at=stamp)

            await cas_update(self._bus.gpus, subjects.gpu_kv_key(self.node_id, index), mutate)

    async def _record_ready_model(self, model: str, measured_bytes: int | None, *, restored: bool = False) -> None:
        """A replica serves: later placements of `model` use what it really holds (see
        `next_measured_figure` for how a reading changes the figure), and its run of
        failures (which backs placement off) is over."""

        def mutate(current: ModelSpec | None) -> ModelSpec | None:
            if current is None:
                return None
            measured = next_measured_figure(current.measured_serving_bytes, measured_bytes, restored=restored)
            if current.measured_serving_bytes == measured and not current.num_failures and not current.hold_until:
                return None
            changed = measured != current.measured_serving_bytes
            return msgspec.structs.replace(current, measured_serving_bytes=measured,
                                           measured_at=now() if changed else current.measured_at,
                                           num_failures=0, last_error=None, hold_until=None)

        await cas_update(self._bus.models, subjects.model_token(model), mutate)


async def _every(interval_s: float, action: Callable[[], Awaitable[None]], failure_event: str) -> None:
    """Run `action` every `interval_s` for ever; a failed round is logged and the next one runs."""
    while True:
        await sleep_or_stop(interval_s)
        try:
            await action()
        except Exception as exc:
            log.warning(failure_event, error=repr(exc))
