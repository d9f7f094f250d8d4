"""`shoal inspect` and `shoal status`: what the NATS CLI would show, without the NATS CLI.

`inspect` lists the streams, the KV buckets with their keys and decoded values,
and the micro services answering ``$SRV.PING`` (like ``nats stream ls``,
``nats kv ls`` / ``nats kv get`` and ``nats micro ls``). `status` shows the
cluster as an operator wants it: nodes, each GPU with a usage bar and its
occupants, replicas with their level and state, models with their memory figure,
and each serving replica's session cache (asked of the replicas themselves).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, TextIO

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

from shoal.services.gateway.batch_store import StoredBatch, batch_store_on
from shoal.shared import subjects
from shoal.shared.bus import Bus, TypedBucket
from shoal.shared.messages import (
    GpuRecord,
    ListSessions,
    ModelSpec,
    ReplicaRecord,
    SessionList,
    session_list_decoder,
    session_route_decoder,
)
from shoal.shared.micro import ServiceCallError, request_json
from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.memory_figure import UnknownModelMemory, get_memory_figure

BAR_WIDTH = 30
STATUS_HEADER = "Status"
"""Header nats-py gives a server status message (``NATS/1.0 503``)."""
NO_RESPONDERS_STATUS = "503"


SESSIONS_TIMEOUT_S = 3.0
"""How long `status` waits for a replica's sessions."""


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


async def ping_services(bus: Bus, wait_s: float = 3.0, quiet_s: float = 0.3) -> list[dict[str, Any]]:
    """Every micro service instance that answers ``$SRV.PING``: waits up to `wait_s` for
    the first answer, then until `quiet_s` pass without a new one.

    When nothing answers, nats-server sends an empty "503 no responders" status message to
    the inbox: that (and any other reply that is not a JSON object) is skipped."""
    inbox = bus.nc.new_inbox()
    found: list[dict[str, Any]] = []
    subscription = await bus.nc.subscribe(inbox)
    try:
        await bus.nc.publish("$SRV.PING", b"", reply=inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while (remaining := deadline - loop.time()) > 0:
            try:
                msg = await subscription.next_msg(timeout=min(remaining, quiet_s) if found else remaining)
            except (nats.errors.TimeoutError, TimeoutError):
                break
            if _is_status(msg):
                if _status_of(msg) == NO_RESPONDERS_STATUS:
                    break  # nothing serves $SRV.PING: no need to wait out the deadline
                continue
            try:
                info = json.loads(msg.data)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(info, dict):
                found.append(info)
    finally:
        await subscription.unsubscribe()
    return sorted(found, key=lambda s: (s.get("name", ""), s.get("id", "")))


def _status_of(msg: Msg) -> str | None:
    return (msg.headers or {}).get(STATUS_HEADER)


def _is_status(msg: Msg) -> bool:
    """A status message from the server (e.g. "503 no responders"), not a service's answer."""
    return not msg.data or _status_of(msg) is not None


async def inspect(bus: Bus, out: TextIO) -> None:
    out.write("Streams (nats stream ls):\n")
    for info in await bus.js.streams_info():
        state = info.state
        name = info.config.name or ""
        out.write(f"  {name:<26} messages={state.messages:<8} consumers={state.consumer_count:<4} "
                  f"{info.config.description or ''}\n")
        if name.startswith("KV_"):
            continue
        for consumer in await bus.js.consumers_info(name):
            out.write(f"    consumer {consumer.name:<30} pending={consumer.num_pending} "
                      f"ack_pending={consumer.num_ack_pending} waiting={consumer.num_waiting}\n")
    buckets: list[TypedBucket[Any]] = [bus.models, bus.gpus, bus.replicas, bus.nodes]
    try:  # made by the first gateway that starts
        sessions = await bus.js.key_value(subjects.SESSIONS_BUCKET)
        buckets.append(TypedBucket(sessions, session_route_decoder, subjects.SESSIONS_BUCKET, bus.js))
    except nats.js.errors.BucketNotFoundError:
        pass
    for bucket in buckets:
        entries = await bucket.get_all()
        out.write(f"\nKV bucket {bucket.name} (nats kv ls {bucket.name}; nats kv get {bucket.name} <key>): "
                  f"{len(entries)} keys\n")
        for key in sorted(entries):
            out.write(f"  {key} = {msgspec.json.encode(entries[key].value).decode()}\n")
    out.write("\nMicro services (nats micro ls):\n")
    for service in await ping_services(bus):
        metadata = service.get("metadata") or {}
        out.write(f"  {service.get('name'):<20} {service.get('version'):<8} id={service.get('id')} {metadata}\n")


def _bar(used: int, total: int) -> str:
    filled = round(BAR_WIDTH * used / total) if total else 0
    return "[" + "#" * min(filled, BAR_WIDTH) + "." * max(0, BAR_WIDTH - filled) + "]"


def _ago(at: float, now: float) -> str:
    return "never" if not at else f"{max(0.0, now - at):.0f}s ago"


def replica_state_label(record: ReplicaRecord) -> str:
    """What an operator calls the state: serving, draining, sleeping, waking (a WARM replica
    on its way back), loading (a new one), or the record's own state."""
    if record.serving:
        return "serving"
    if record.state == "draining":
        return f"draining->{(record.leaving_to or 'WARM').lower()}"
    if record.level == "WARM":
        return "sleeping"
    if record.state in ("pending", "loading") and record.ready_at is not None:
        return "waking"
    return record.state


def render_status(nodes: dict[str, Any], gpus: dict[str, GpuRecord], replicas: list[ReplicaRecord],
                  models: list[ModelSpec], out: TextIO, *, config: PlacementConfig | None = None,
                  now: float | None = None, sessions: dict[str, SessionList | str] | None = None,
                  batches: list[StoredBatch] | None = None) -> None:
    """Write the cluster view; memory figures are computed with `config` (the scheduler's
    placement knobs; default the policy's defaults). `sessions`: per serving replica, its
    session list, or why it could not be had. `batches`: the Batch API's batches with work left."""
    config = config or PlacementConfig()
    now = time.time() if now is None else now
    out.write(f"Nodes ({len(nodes)}):\n")
    for node_id in sorted(nodes):
        node = nodes[node_id]
        kind = "virtual" if node.virtual else "nvml"
        out.write(f"  {node_id:<20} {len(node.gpus)} {kind} GPU(s), RAM {_gib(node.cpu_ram_bytes)}, "
                  f"{node.num_workers} worker(s)\n")
    out.write(f"\nGPUs ({len(gpus)}):\n")
    for key in sorted(gpus):
        gpu = gpus[key]
        used = gpu.reserved_bytes
        pct = 100 * used / gpu.total_bytes if gpu.total_bytes else 0.0
        warning = "  OVER-COMMITTED" if used > gpu.total_bytes else ""
        out.write(f"  {key:<22} {_bar(used, gpu.total_bytes)} {_gib(used)} / {_gib(gpu.total_bytes)} "
                  f"({pct:.0f}%){warning}\n")
        for occupant in gpu.occupants:
            held = occupant.residual_bytes if occupant.state == "sleeping" else occupant.num_bytes
            residue = " (residue)" if occupant.state == "sleeping" and held else ""
            out.write(f"      {occupant.model:<28} {occupant.replica_id[:12]} {_gib(held):>11} "
                      f"{occupant.state}{residue}\n")
        for intent in gpu.intents:
            lapsed = " (lapsed)" if intent.expires_at <= now else ""
            out.write(f"      intent: {intent.model} needs {_gib(intent.num_bytes)}, waiting since "
                      f"{_ago(intent.since, now)} (scheduler {intent.owner}){lapsed}\n")
        if gpu.wake_lock is not None and gpu.wake_lock.expires_at > now:
            out.write(f"      wake lock: {gpu.wake_lock.holder}, taken {_ago(gpu.wake_lock.acquired_at, now)}\n")
    out.write(f"\nReplicas ({len(replicas)}):\n")
    for record in sorted(replicas, key=lambda r: (r.model, r.created_at)):
        gpus_text = ",".join(f"{record.node_id}.{i}" for i in sorted(record.gpu_bytes)) or "-"
        in_flight = f", {record.num_in_flight} in flight" if record.num_in_flight else ""
        phase = f" ({record.loading_phase})" if record.loading_phase else ""
        pool = f", KV pool {record.kv_cache_tokens:,} tokens" if record.kv_cache_tokens else ""
        out.write(f"  {record.name:<60} {record.level:<4} {replica_state_label(record) + phase:<30} on {gpus_text:<14} "
                  f"last access {_ago(record.last_request_at, now)}{in_flight}{pool}\n")
    out.write(f"\nModels ({len(models)}):\n")
    for spec in sorted(models, key=lambda m: m.key):
        figure, source = _memory_figure(spec, config)
        flags = " popular" if spec.fairness.popular else ""
        blocked = (f" wake blocked ({spec.wake_blocked_reason})"
                   if spec.wake_blocked_until is not None and spec.wake_blocked_until > now else "")
        out.write(f"  {spec.key:<28} desired={spec.desired_replicas} memory={figure} ({source}){flags}{blocked}\n")
        if spec.num_failures or spec.is_held(now):
            out.write(f"    {_failing(spec, now)}\n")
    if sessions:
        render_sessions(replicas, sessions, out)
    if batches:
        render_batches(batches, out, now)


def _failing(spec: ModelSpec, now: float) -> str:
    """A failing model's line: failures in a row, its placement backoff, the last error."""
    held = f", placement held {spec.hold_until - now:.0f} s more" if spec.hold_until and spec.is_held(now) else ""
    error = " ".join((spec.last_error or "").split())
    error = error if len(error) <= 160 else error[:157] + "..."
    return f"failing: {spec.num_failures} in a row{held}; last error: {error or '-'}"


def render_batches(batches: list[StoredBatch], out: TextIO, now: float) -> None:
    """The Batch API's batches with work left: progress, and which gateway runs each."""
    out.write(f"\nBatches with work left ({len(batches)}):\n")
    for stored in batches:
        batch, counts = stored.batch, stored.batch.request_counts
        held = bool(stored.owner) and stored.lease_until > now
        saved = f", {stored.num_saved_answers} saved" if stored.saved else ""  # what a taker will not ask again
        progress = (f"{counts.completed + counts.failed}/{counts.total} answered ({counts.failed} refused{saved})"
                    if batch.status != "validating" else "file being checked" if held else "not started")
        runner = f"gateway {stored.owner} (claim {stored.lease_until - now:.0f} s left)" if held else \
            "waiting for a gateway"
        out.write(f"  {batch.id:<36} {batch.status:<12} {batch.endpoint:<22} {progress}, {runner}, made "
                  f"{_ago(batch.created_at, now)}\n")


def render_sessions(replicas: list[ReplicaRecord], sessions: dict[str, SessionList | str], out: TextIO) -> None:
    """Each serving replica's session cache: sessions held, bytes per tier, turns that hit,
    where returning turns' prompt tokens came from, swaps."""
    out.write("\nSessions (the session cache of each serving replica):\n")
    for record in sorted(replicas, key=lambda r: (r.model, r.created_at)):
        answer = sessions.get(record.replica_id)
        if answer is None:
            continue
        name = f"{record.model} {record.replica_id[:12]}"
        if isinstance(answer, str):
            out.write(f"  {name:<42} unavailable: {answer}\n")
            continue
        stats = answer.stats
        if not answer.enabled or stats is None:
            out.write(f"  {name:<42} no session cache\n")
            continue
        num_active = sum(1 for s in answer.sessions if s.active)
        running = f" (+{num_active} with a turn running)" if num_active else ""
        turns = stats.num_hits + stats.num_misses
        hit_rate = f"{100 * stats.num_hits / turns:.0f}%" if turns else "-"
        out.write(f"  {name:<42} {stats.num_sessions} cached{running}; GPU {_mib(stats.gpu_bytes)}, "
                  f"CPU {_mib(stats.cpu_bytes)} of {_mib(stats.host_pool_bytes)}; "
                  f"turns {stats.num_hits} hit / {stats.num_misses} miss ({hit_rate})\n")
        out.write(f"  {'':<42} returning-turn tokens: {stats.num_gpu_reused_tokens} reused on GPU, "
                  f"{stats.num_cpu_restored_tokens} from CPU, {stats.num_prefix_cached_tokens} from the prefix "
                  f"cache, {stats.num_recomputed_tokens} recomputed, {stats.num_new_tokens} new; swap-in "
                  f"{_mib(stats.swap_in_bytes)} ({stats.exposed_swap_seconds:.3f} s exposed), swap-out "
                  f"{_mib(stats.swap_out_bytes)}\n")


def _memory_figure(spec: ModelSpec, config: PlacementConfig) -> tuple[str, str]:
    """The figure placement uses for a replica of `spec`, and where it came from."""
    try:
        figure = get_memory_figure(weight_bytes=spec.weight_bytes or 0, config=config,
                                   measured_bytes=spec.measured_serving_bytes,
                                   override_bytes=spec.memory_override_bytes, estimated_bytes=spec.estimated_bytes)
    except UnknownModelMemory:
        return "unknown", "not inspected yet"
    return _gib(figure.required_bytes), figure.source


async def status(bus: Bus, out: TextIO, placement: PlacementConfig | None = None) -> None:
    """`shoal status`; `placement` is the ``[scheduler.placement]`` section of the config
    the scheduler runs with (``shoal status --config shoal.toml``)."""
    nodes = {k: v.value for k, v in (await bus.nodes.get_all()).items()}
    gpus = {k: v.value for k, v in (await bus.gpus.get_all()).items()}
    replicas = [v.value for v in (await bus.replicas.get_all()).values()]
    models = [v.value for v in (await bus.models.get_all()).values()]
    config = placement or PlacementConfig()
    sessions = await get_sessions(bus, [r for r in replicas if r.serving])
    render_status(nodes, gpus, replicas, models, out, config=config, sessions=sessions,
                  batches=await get_batches(bus))


async def get_batches(bus: Bus) -> list[StoredBatch]:
    """The Batch API's batches with work left (none before a gateway made the bucket)."""
    try:
        kv = await bus.js.key_value(subjects.BATCHES_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return []
    return await batch_store_on(bus.js, kv).active(tidy=False)


async def get_sessions(bus: Bus, replicas: list[ReplicaRecord]) -> dict[str, SessionList | str]:
    """Each replica's sessions (``shoal.worker.<replica>.sessions``), or why it did not answer."""

    async def ask(replica_id: str) -> SessionList | str:
        try:
            return await request_json(bus.nc, subjects.worker_subject(replica_id, "sessions"), ListSessions(),
                                      session_list_decoder, timeout_s=SESSIONS_TIMEOUT_S)
        except ServiceCallError as exc:
            return str(exc)

    answers = await asyncio.gather(*(ask(r.replica_id) for r in replicas))
    return {r.replica_id: answer for r, answer in zip(replicas, answers, strict=True)}
