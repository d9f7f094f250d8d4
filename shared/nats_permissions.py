"""Which NATS subjects each Shoal service may publish and subscribe to, declared once.

The nats-server authorization block that compose ships (`deploy/nats/shoal-users.conf`)
and the table in docs/operations.md are rendered from `PERMISSIONS`; tests run a real
nats-server with it (a gateway user cannot write ``shoal_gpus``, a worker cannot
create a stream...) and the whole of Shoal under it.

Each role reads its replies on its own inbox prefix (``_INBOX_<role>``), so no service
reads another's request replies (JetStream API answers, pulled requests included).

Pure data and string building: no NATS import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shoal.shared import subjects

Role = Literal["gateway", "scheduler", "node-agent", "worker"]
ROLES: tuple[Role, ...] = ("gateway", "scheduler", "node-agent", "worker")
DEFAULT_INBOX_PREFIX = "_INBOX"
ADMIN_USER = "shoal-admin"
"""The operator's user (shoal status / inspect / scale / evict, the NATS CLI): every subject."""

STREAMS = (subjects.REQUESTS_STREAM, subjects.EVENTS_STREAM)
CLUSTER_BUCKETS = (subjects.MODELS_BUCKET, subjects.GPUS_BUCKET, subjects.REPLICAS_BUCKET, subjects.NODES_BUCKET)
BUCKETS = (*CLUSTER_BUCKETS, subjects.SESSIONS_BUCKET, subjects.RESPONSES_BUCKET)
GATEWAY_BUCKETS = (*BUCKETS, subjects.BATCHES_BUCKET)
"""The gateways' alone besides: the Batch API's records."""
FILES_STREAM = f"OBJ_{subjects.FILES_BUCKET}"
"""The Batch API's object store (services/gateway/file_store.py)."""
JS_API = "$JS.API"


def inbox_prefix(role: Role | None) -> str:
    """The inbox prefix of `role`'s connections (nats-py's default for None)."""
    return f"{DEFAULT_INBOX_PREFIX}_{role}" if role else DEFAULT_INBOX_PREFIX


def user_name(role: Role) -> str:
    return f"shoal-{role}"


def password_variable(role: Role) -> str:
    """The environment variable the rendered server config reads `role`'s password from."""
    return f"SHOAL_NATS_{role.upper().replace('-', '_')}_PASSWORD"


@dataclass(frozen=True)
class Grant:
    """One line of the permission table: what a role may do, why, and the subjects it takes."""

    what: str
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    shown: str = ""
    """How the docs' table shows `publish` when listing it would drown the table."""


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def _stream_info(names: tuple[str, ...]) -> tuple[str, ...]:
    return (f"{JS_API}.INFO", *(f"{JS_API}.STREAM.INFO.{name}" for name in names))


ALL_STREAMS = (*STREAMS, *(kv_stream(b) for b in GATEWAY_BUCKETS), FILES_STREAM)


def _names(names: tuple[str, ...]) -> str:
    return ", ".join(f"`{name}`" for name in names)


def bind_streams() -> Grant:
    return Grant("find Shoal's streams and buckets", publish=_stream_info(ALL_STREAMS),
                 shown=f"`{JS_API}.INFO`, `{JS_API}.STREAM.INFO.<stream>` of {_names(ALL_STREAMS)}")


def create_streams() -> Grant:
    """Create a missing stream or bucket (never update or delete one: bus.py)."""
    return Grant("create Shoal's streams and buckets when missing (never update nor delete one)",
                 publish=tuple(f"{JS_API}.STREAM.CREATE.{name}" for name in ALL_STREAMS),
                 shown=f"`{JS_API}.STREAM.CREATE.<stream>` of the same")


def _read_stream(stream: str) -> tuple[str, ...]:
    """Direct gets and short-lived consumers (reads of every key, watches) on `stream`."""
    return (
        f"{JS_API}.DIRECT.GET.{stream}", f"{JS_API}.DIRECT.GET.{stream}.>", f"{JS_API}.STREAM.MSG.GET.{stream}",
        f"{JS_API}.CONSUMER.CREATE.{stream}", f"{JS_API}.CONSUMER.CREATE.{stream}.>",
        f"{JS_API}.CONSUMER.DELETE.{stream}.>", f"{JS_API}.CONSUMER.INFO.{stream}.>",
        f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.>", f"$JS.FC.{stream}.>",
    )


_READ_SHOWN = ("`{api}.DIRECT.GET`, `STREAM.MSG.GET`, `CONSUMER.CREATE / INFO / MSG.NEXT / DELETE` and "
               "`$JS.FC` (ephemeral readers and watchers) on {names}")


def read_kv(buckets: tuple[str, ...], what: str) -> Grant:
    streams = tuple(kv_stream(b) for b in buckets)
    return Grant(what, publish=tuple(s for stream in streams for s in _read_stream(stream)),
                 shown=_READ_SHOWN.format(api=JS_API, names=_names(streams)))


def write_kv(buckets: tuple[str, ...], what: str) -> Grant:
    return Grant(what, publish=tuple(f"$KV.{b}.>" for b in buckets))


SERVICE_ENDPOINTS = Grant("answer `nats micro ls / info / stats`", subscribe=("$SRV.>",))
MAX_DELIVERIES_ADVISORY = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES." + subjects.REQUESTS_STREAM + ".>"

PERMISSIONS: dict[Role, tuple[Grant, ...]] = {
    "gateway": (
        bind_streams(),
        Grant("queue requests, take back a cancelled one",
              publish=(f"{subjects.INFER_PREFIX}.>", f"{JS_API}.STREAM.MSG.DELETE.{subjects.REQUESTS_STREAM}")),
        Grant("cancel requests", publish=(f"{subjects.CANCEL_PREFIX}.>",)),
        Grant("ask the scheduler (ensure; the admin API: register, remove, scale, evict)",
              publish=tuple(subjects.scheduler_subject(verb)
                            for verb in ("ensure", "register", "remove", "scale", "evict"))),
        Grant("receive token chunks and final replies", subscribe=(f"{subjects.REPLY_PREFIX}.>",)),
        Grant("receive the workers' stats (/metrics, the dashboard)", subscribe=(subjects.STATS_WILDCARD,)),
        Grant("read the queue's consumers (queue length)",
              publish=(f"{JS_API}.CONSUMER.LIST.{subjects.REQUESTS_STREAM}",
                       f"{JS_API}.CONSUMER.INFO.{subjects.REQUESTS_STREAM}.>")),
        Grant("read SHOAL_EVENTS (the dashboard's event feed)", publish=_read_stream(subjects.EVENTS_STREAM),
              shown=_READ_SHOWN.format(api=JS_API, names=_names((subjects.EVENTS_STREAM,)))),
        Grant("hear of requests that used up their deliveries", subscribe=(MAX_DELIVERIES_ADVISORY,)),
        Grant("fail over: NAK (or TERM) the delivery a dead replica held, check a request is still queued",
              publish=(f"$JS.ACK.{subjects.REQUESTS_STREAM}.>",
                       f"{JS_API}.STREAM.MSG.GET.{subjects.REQUESTS_STREAM}",
                       f"{JS_API}.DIRECT.GET.{subjects.REQUESTS_STREAM}")),
        read_kv(GATEWAY_BUCKETS, "read (and watch) every bucket"),
        Grant("create the session routes', stored responses' and Batch API's buckets when missing",
              publish=(*(f"{JS_API}.STREAM.CREATE.{kv_stream(b)}" for b in (
                  subjects.SESSIONS_BUCKET, subjects.RESPONSES_BUCKET, subjects.BATCHES_BUCKET)),
                  f"{JS_API}.STREAM.CREATE.{FILES_STREAM}")),
        write_kv((subjects.SESSIONS_BUCKET,), "route a session's turns to the replica holding its KV"),
        write_kv((subjects.RESPONSES_BUCKET,), "store Responses API answers (previous_response_id, GET, DELETE)"),
        write_kv((subjects.BATCHES_BUCKET,), "keep the Batch API's files' and batches' records"),
        Grant("keep the Batch API's files (write, read, delete objects in the shoal_files object store)",
              publish=(f"$O.{subjects.FILES_BUCKET}.>", f"{JS_API}.STREAM.PURGE.{FILES_STREAM}",
                       f"{JS_API}.STREAM.NAMES", *_read_stream(FILES_STREAM)),
              shown=f"`$O.{subjects.FILES_BUCKET}.>`, `{JS_API}.STREAM.PURGE.{FILES_STREAM}`, "
                    f"`{JS_API}.STREAM.NAMES` (nats-py finds the stream of an object's chunks by name), and "
                    + _READ_SHOWN.format(api=JS_API, names=_names((FILES_STREAM,)))),
        Grant("list and drop the sessions workers hold (the admin API)",
              publish=(subjects.worker_subject("*", "sessions"), subjects.worker_subject("*", "drop_session"))),
        Grant("tokenize and detokenize with a replica's tokenizer (/tokenize, /detokenize)",
              publish=(subjects.worker_subject("*", "tokenize"), subjects.worker_subject("*", "detokenize"))),
        Grant("ping the worker of a lost replica (fail over its requests if it is gone too)",
              publish=(subjects.worker_subject("*", "ping"),)),
    ),
    "scheduler": (
        bind_streams(),
        create_streams(),
        Grant("serve shoal.scheduler.*", subscribe=(f"{subjects.SCHEDULER_PREFIX}.>",)),
        SERVICE_ENDPOINTS,
        Grant("command node agents (create, stop, park, restore, inspect)",
              publish=(f"{subjects.NODE_PREFIX}.>",)),
        Grant("record events", publish=(f"{subjects.EVENT_PREFIX}.>",)),
        read_kv(BUCKETS, "read every bucket"),
        write_kv((subjects.MODELS_BUCKET, subjects.GPUS_BUCKET, subjects.REPLICAS_BUCKET),
                 "write models, GPUs and replicas (CAS)"),
        Grant("manage the per-model request consumers",
              publish=(f"{JS_API}.CONSUMER.CREATE.{subjects.REQUESTS_STREAM}.>",
                       f"{JS_API}.CONSUMER.DURABLE.CREATE.{subjects.REQUESTS_STREAM}.>",
                       f"{JS_API}.CONSUMER.LIST.{subjects.REQUESTS_STREAM}",
                       f"{JS_API}.CONSUMER.INFO.{subjects.REQUESTS_STREAM}.>",
                       f"{JS_API}.CONSUMER.DELETE.{subjects.REQUESTS_STREAM}.>")),
        Grant("hear of requests that used up their deliveries", subscribe=(MAX_DELIVERIES_ADVISORY,)),
    ),
    "node-agent": (
        bind_streams(),
        create_streams(),
        Grant("serve shoal.node.* (the scheduler's commands, its workers' events, inspections)",
              subscribe=(f"{subjects.NODE_PREFIX}.>",)),
        SERVICE_ENDPOINTS,
        Grant("park and restore its workers", publish=(f"{subjects.WORKER_PREFIX}.>",)),
        Grant("report a failed replica", publish=(subjects.scheduler_subject("replica_failed"),)),
        Grant("record events", publish=(f"{subjects.EVENT_PREFIX}.>",)),
        read_kv(BUCKETS, "read every bucket"),
        write_kv(CLUSTER_BUCKETS, "write its node, its GPUs, its replicas' state, measured memory (CAS)"),
    ),
    "worker": (
        bind_streams(),
        Grant("pull its model's requests, ack them",
              publish=(f"{JS_API}.CONSUMER.CREATE.{subjects.REQUESTS_STREAM}.>",
                       f"{JS_API}.CONSUMER.DURABLE.CREATE.{subjects.REQUESTS_STREAM}.>",
                       f"{JS_API}.CONSUMER.INFO.{subjects.REQUESTS_STREAM}.>",
                       f"{JS_API}.CONSUMER.MSG.NEXT.{subjects.REQUESTS_STREAM}.>",
                       f"$JS.ACK.{subjects.REQUESTS_STREAM}.>")),
        Grant("move the session turns left on its replica's own subject to its model's shared one",
              publish=(f"{subjects.INFER_PREFIX}.*",)),
        Grant("hear cancels", subscribe=(f"{subjects.CANCEL_PREFIX}.>",)),
        Grant("send token chunks and final replies", publish=(f"{subjects.REPLY_PREFIX}.>",)),
        Grant("publish its stats", publish=(f"{subjects.STATS_PREFIX}.>",)),
        Grant("report to its node agent", publish=(f"{subjects.NODE_PREFIX}.*.worker_event",)),
        Grant("serve shoal.worker.* (park, restore, sessions)", subscribe=(f"{subjects.WORKER_PREFIX}.>",)),
        SERVICE_ENDPOINTS,
        read_kv((subjects.REPLICAS_BUCKET,), "read its replica's record"),
        write_kv((subjects.REPLICAS_BUCKET,), "write its replica's activity (CAS)"),
    ),
}
"""Every role's grants. Anything not granted is refused by the server. Every role also
subscribes to its own inbox prefix and may answer the requests it receives
(``allow_responses``)."""


def allowed(role: Role) -> tuple[list[str], list[str]]:
    """(publish, subscribe) subjects `role` may use, without duplicates, in declaration order."""
    publish: dict[str, None] = {}
    subscribe: dict[str, None] = {f"{inbox_prefix(role)}.>": None}
    for grant in PERMISSIONS[role]:
        publish.update(dict.fromkeys(grant.publish))
        subscribe.update(dict.fromkeys(grant.subscribe))
    return list(publish), list(subscribe)


def _quoted(items: list[str], indent: str) -> str:
    return ",\n".join(f'{indent}"{item}"' for item in items)


def render_users(*, admin: bool = True) -> str:
    """The ``authorization`` block of a nats-server config: one user per role (and the
    operator's `ADMIN_USER`), each password read from the environment variable
    `password_variable` names (``SHOAL_NATS_ADMIN_PASSWORD`` for the admin)."""
    lines = [
        "# Shoal's NATS users and what each may do. Rendered from shoal/shared/nats_permissions.py",
        "# (docs/operations.md has the same table); passwords come from the server's environment.",
        "authorization {",
        "  users = [",
    ]
    for role in ROLES:
        publish, subscribe = allowed(role)
        lines += [
            f'    {{user: "{user_name(role)}", password: ${password_variable(role)}, permissions: {{',
            "      publish: {allow: [",
            _quoted(publish, "        "),
            "      ]},",
            "      subscribe: {allow: [",
            _quoted(subscribe, "        "),
            "      ]},",
            "      allow_responses: true",
            "    }},",
        ]
    if admin:
        lines.append(f'    {{user: "{ADMIN_USER}", password: $SHOAL_NATS_ADMIN_PASSWORD}}')
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def render_table() -> str:
    """The permission table of docs/operations.md (markdown)."""
    rows = ["| service (NATS user) | may | publish | subscribe |", "| --- | --- | --- | --- |"]
    for role in ROLES:
        for grant in PERMISSIONS[role]:
            publish = grant.shown or "<br>".join(f"`{s}`" for s in grant.publish)
            subscribe = "<br>".join(f"`{s}`" for s in grant.subscribe)
            rows.append(f"| {role} (`{user_name(role)}`) | {grant.what} | {publish} | {subscribe} |")
        rows.append(f"| {role} (`{user_name(role)}`) | read its request replies | | `{inbox_prefix(role)}.>` |")
    return "\n".join(rows) + "\n"
