"""The per-service NATS users compose ships, enforced by a real nats-server.

The server runs the authorization block rendered from `shared/nats_permissions.py` (what
`deploy/nats/shoal-users.conf` holds); each role connects as its own user and tries what it
must not do. Refused means the server said so (a violation in its log) and nothing changed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest

from shoal.shared import subjects
from shoal.shared.bus import Bus, connect
from shoal.shared.messages import GpuRecord
from shoal.shared.nats_connect import connect_options
from shoal.shared.nats_permissions import ROLES, Role, inbox_prefix, render_users
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.nats_setups import Users

REFUSED: dict[Role, dict[str, list[str]]] = {
    "gateway": {
        "publish": ["$KV.shoal_gpus.n.0", "$KV.shoal_replicas.m.r", "$KV.shoal_models.m", "$KV.shoal_nodes.n",
                    "$JS.API.STREAM.DELETE.SHOAL_REQUESTS", "$JS.API.STREAM.UPDATE.KV_shoal_gpus",
                    "$JS.API.STREAM.PURGE.SHOAL_REQUESTS", "shoal.node.n.create", "shoal.worker.r.to_cache",
                    "shoal.reply.g.r", "shoal.event.replica_ready", "shoal.scheduler.replica_failed"],
        "subscribe": ["_INBOX.>", "_INBOX_scheduler.>", "shoal.infer.>", "shoal.node.>", "shoal.scheduler.>",
                      "$KV.>"],
    },
    "worker": {
        "publish": ["$KV.shoal_gpus.n.0", "$KV.shoal_models.m", "$KV.shoal_nodes.n",
                    "$JS.API.STREAM.CREATE.SHOAL_REQUESTS", "$JS.API.STREAM.MSG.DELETE.SHOAL_REQUESTS",
                    "$JS.API.CONSUMER.DELETE.SHOAL_REQUESTS.infer-m", "shoal.infer.m.r", "shoal.node.n.create",
                    "shoal.scheduler.scale", "shoal.event.replica_ready", "shoal.cancel.m"],
        "subscribe": ["shoal.reply.>", "shoal.infer.>", "shoal.node.>", "_INBOX.>", "shoal.stats.>"],
    },
    "scheduler": {
        "publish": ["$KV.shoal_nodes.n", "shoal.reply.g.r", "shoal.infer.m", "shoal.worker.r.to_cache",
                    "$JS.API.STREAM.DELETE.SHOAL_REQUESTS", "$JS.API.STREAM.UPDATE.SHOAL_REQUESTS"],
        "subscribe": ["shoal.reply.>", "shoal.node.>", "shoal.infer.>", "_INBOX_gateway.>"],
    },
    "node-agent": {
        "publish": ["shoal.reply.g.r", "shoal.infer.m", "shoal.scheduler.scale", "shoal.cancel.m",
                    "$JS.API.STREAM.DELETE.KV_shoal_gpus", "$JS.API.STREAM.PURGE.KV_shoal_models"],
        "subscribe": ["shoal.reply.>", "shoal.scheduler.>", "shoal.infer.>", "_INBOX_worker.>"],
    },
}
"""What each service must never be able to do."""

ALLOWED: dict[Role, dict[str, list[str]]] = {
    "gateway": {"publish": ["shoal.infer.m", "shoal.infer.m.r", "shoal.cancel.m", "shoal.scheduler.ensure",
                            "$KV.shoal_sessions.m.s", "shoal.worker.r.sessions"],
                "subscribe": ["shoal.reply.>", "shoal.stats.>", "_INBOX_gateway.>"]},
    "worker": {"publish": ["shoal.reply.g.r", "shoal.stats.m.r", "shoal.node.n.worker_event",
                           "$KV.shoal_replicas.m.r", "shoal.infer.m"],
               "subscribe": ["shoal.cancel.>", "shoal.worker.>", "$SRV.>", "_INBOX_worker.>"]},
    "scheduler": {"publish": ["$KV.shoal_gpus.n.0", "$KV.shoal_replicas.m.r", "$KV.shoal_models.m",
                              "shoal.node.n.create", "shoal.event.replica_placed"],
                  "subscribe": ["shoal.scheduler.>", "$SRV.>", "_INBOX_scheduler.>"]},
    "node-agent": {"publish": ["$KV.shoal_nodes.n", "$KV.shoal_gpus.n.0", "shoal.worker.r.to_cache",
                               "shoal.scheduler.replica_failed"],
                   "subscribe": ["shoal.node.>", "$SRV.>", "_INBOX_node-agent.>"]},
}
"""A sample of what each must be able to do (the whole of Shoal running under these users is
tests/integration/test_nats_cluster.py)."""


@pytest.fixture
def users() -> Users:
    return Users()


@pytest.fixture
def locked_server(tmp_path: Path, users: Users) -> Iterator[EmbeddedNatsServer]:
    server = EmbeddedNatsServer(store_dir=tmp_path / "js", extra_config=render_users(), env=users.server_env)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def admin_bus(locked_server: EmbeddedNatsServer, users: Users) -> AsyncIterator[Bus]:
    bus = await connect(locked_server.url, "admin", nats_config=users.config(None))
    try:
        yield bus
    finally:
        await bus.close()


def _violations(server: EmbeddedNatsServer, user: str, kind: str) -> set[str]:
    """Subjects the server refused `user` to publish / subscribe to ("Publish" / "Subscription")."""
    found = set()
    for line in server.error_lines:
        if f"user:{user}" in line and f"{kind} Violation" in line:
            found.add(line.rsplit('Subject "', 1)[1].split('"', 1)[0])
    return found


async def _try_everything(server: EmbeddedNatsServer, users: Users, role: Role, subjects_by_verb: dict[str, list[str]]
                          ) -> None:
    nc = await nats.connect(server.url, name=f"probe-{role}", allow_reconnect=False,
                            error_cb=_ignore, **connect_options(users.config(role), role))
    try:
        for subject in subjects_by_verb["publish"]:
            await nc.publish(subject, b"{}")
        for subject in subjects_by_verb["subscribe"]:
            await nc.subscribe(subject)
        await nc.flush()
        await asyncio.sleep(0.2)  # the server's -ERR lines arrive after the flush's PONG
    finally:
        await nc.close()


async def _ignore(_: Exception) -> None:
    pass


@pytest.mark.parametrize("role", ["gateway", "worker", "scheduler", "node-agent"])
async def test_each_service_user_is_refused_what_it_must_never_do(
    locked_server: EmbeddedNatsServer, users: Users, admin_bus: Bus, role: Role
) -> None:
    refused = REFUSED[role]
    await _try_everything(locked_server, users, role, refused)
    user = f"shoal-{role}"
    assert _violations(locked_server, user, "Publish") == set(refused["publish"])
    assert _violations(locked_server, user, "Subscription") == set(refused["subscribe"])
    # And nothing it tried changed the cluster state.
    for bucket in (admin_bus.gpus, admin_bus.models, admin_bus.nodes):
        assert await bucket.get_all() == {}, f"{role} wrote {bucket.name}"


@pytest.mark.parametrize("role", ["gateway", "worker", "scheduler", "node-agent"])
async def test_each_service_user_may_do_its_job(locked_server: EmbeddedNatsServer, users: Users, admin_bus: Bus,
                                                role: Role) -> None:
    await _try_everything(locked_server, users, role, ALLOWED[role])
    assert _violations(locked_server, f"shoal-{role}", "Publish") == set()
    assert _violations(locked_server, f"shoal-{role}", "Subscription") == set()


async def test_a_gateway_cannot_write_gpu_records_through_the_kv_api(
    locked_server: EmbeddedNatsServer, users: Users, admin_bus: Bus
) -> None:
    """The real KV client, as a compromised gateway would use it: the write never lands."""
    scheduler = await connect(locked_server.url, "scheduler", nats_config=users.config("scheduler"), role="scheduler")
    gateway = await connect(locked_server.url, "gateway", nats_config=users.config("gateway"), role="gateway")
    try:
        assert await scheduler.gpus.create("n.0", GpuRecord(node_id="n", index=0, total_bytes=100)) is not None
        with pytest.raises(TimeoutError):  # a refused publish is never answered
            await asyncio.wait_for(gateway.gpus.put("n.0", GpuRecord(node_id="n", index=0, total_bytes=10**15)), 1.0)
        stored = await gateway.gpus.get("n.0")  # it may read
        assert stored is not None and stored.value.total_bytes == 100
    finally:
        await gateway.close()
        await scheduler.close()
    assert _violations(locked_server, "shoal-gateway", "Publish") == {f"$KV.{subjects.GPUS_BUCKET}.n.0"}


async def test_each_role_reads_replies_on_its_own_inbox_prefix(locked_server: EmbeddedNatsServer,
                                                                users: Users, admin_bus: Bus) -> None:
    """Request/reply works for every role: its inbox prefix is the one its user may read."""
    for role in ROLES:
        bus = await connect(locked_server.url, role, nats_config=users.config(role), role=role)
        try:
            assert bus.nc.new_inbox().startswith(inbox_prefix(role) + ".")
            await bus.js.account_info()  # a JetStream API request, answered on that inbox
        finally:
            await bus.close()
    assert not locked_server.error_lines


async def test_a_gateway_started_first_waits_for_a_scheduler_to_create_the_streams(
    locked_server: EmbeddedNatsServer, users: Users
) -> None:
    """Its user may not create streams: it neither fails nor hangs on the refused request, it
    waits, and binds once the scheduler (whose user may) has created them."""
    gateway_connecting = asyncio.create_task(
        connect(locked_server.url, "gateway", nats_config=users.config("gateway"), role="gateway"))
    await asyncio.sleep(1.5)
    assert not gateway_connecting.done()
    scheduler = await connect(locked_server.url, "scheduler", nats_config=users.config("scheduler"), role="scheduler")
    gateway = await asyncio.wait_for(gateway_connecting, 10.0)
    try:
        assert (await gateway.js.stream_info(subjects.REQUESTS_STREAM)).config.name == subjects.REQUESTS_STREAM
    finally:
        await gateway.close()
        await scheduler.close()
    assert _violations(locked_server, "shoal-gateway", "Publish") == {
        f"$JS.API.STREAM.CREATE.{subjects.REQUESTS_STREAM}"}, "one refused attempt, then it waited"
