"""NATS connection settings, the permission table, and what no client may forge (pure parts)."""

from __future__ import annotations

import ssl
from pathlib import Path

import msgspec
import pytest

from shoal.services.node_agent.processes import is_secret_env_var
from shoal.shared import subjects
from shoal.shared.config import ConfigError, NatsConfig, NatsCredentials, load_config
from shoal.shared.messages import (
    SamplingParams,
    WorkerEvent,
    create_replica_decoder,
    encode_json,
    request_decoder,
    scheduler_command_decoders,
    worker_event_decoder,
)
from shoal.shared.nats_connect import connect_options, redacted_url
from shoal.shared.nats_permissions import PERMISSIONS, ROLES, allowed, render_table, render_users

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_credentials_come_from_the_file_or_the_environment_and_never_show_in_a_repr() -> None:
    config = load_config(None, environ={"SHOAL_NATS_URL": "nats://a:4222, nats://b:4222", "SHOAL_NATS_USER": "gw",
                                        "SHOAL_NATS_PASSWORD": "s3cret", "SHOAL_NATS_WORKERS_USER": "w",
                                        "SHOAL_NATS_WORKERS_PASSWORD": "w0rker"})
    assert config.nats.servers == ["nats://a:4222", "nats://b:4222"]
    assert (config.nats.user, config.nats.password) == ("gw", "s3cret")
    shown = repr(config) + repr(config.nats) + str(config.nats)
    assert "s3cret" not in shown and "w0rker" not in shown and "password=***" in shown


@pytest.mark.parametrize(("environ", "needle"), [
    ({"SHOAL_NATS_URL": "nats://user:pw@host:4222"}, "must not hold credentials"),
    ({"SHOAL_NATS_USER": "u", "SHOAL_NATS_TOKEN": "t"}, "one way to authenticate"),
    ({"SHOAL_NATS_PASSWORD": "p"}, "needs a user"),
    ({"SHOAL_NATS_TLS_CERT_FILE": "c.pem"}, "go together"),
    ({"SHOAL_NATS_REPLICAS": "7"}, "nats.replicas"),
])
def test_bad_nats_settings_are_refused_naming_the_problem_and_no_secret(environ: dict[str, str],
                                                                        needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as excinfo:
        load_config(None, environ=environ)
    assert "pw@" not in str(excinfo.value)


def test_a_node_agent_hands_its_workers_their_own_user_and_its_tls_files() -> None:
    agent = NatsConfig(url="nats://ignored", user="agent", password="a", replicas=3, tls_ca_file="ca.pem",
                       tls_cert_file="c.pem", tls_key_file="k.pem",
                       workers=NatsCredentials(user="worker", password="w"))
    worker = agent.for_workers("nats://n1:4222,nats://n2:4222")
    assert (worker.url, worker.user, worker.password) == ("nats://n1:4222,nats://n2:4222", "worker", "w")
    assert (worker.tls_ca_file, worker.tls_cert_file, worker.replicas) == ("ca.pem", "c.pem", 3)
    assert not worker.workers.is_set
    same = NatsConfig(token="t").for_workers("nats://x")
    assert (same.token, same.user) == ("t", "")


def test_connect_options_carry_the_one_credential_and_the_roles_inbox(tmp_path: Path) -> None:
    assert connect_options(NatsConfig(user="u", password="p"), "gateway") == {
        "inbox_prefix": b"_INBOX_gateway", "user": "u", "password": "p"}
    assert connect_options(NatsConfig(token="t"), None) == {"inbox_prefix": b"_INBOX", "token": "t"}
    seed = tmp_path / "user.nk"
    seed.write_text("SU...")
    assert connect_options(NatsConfig(nkey_seed_file=str(seed)), "worker")["nkeys_seed"] == str(seed)
    with pytest.raises(ConfigError, match="creds_file"):
        connect_options(NatsConfig(creds_file=str(tmp_path / "missing.creds")), "worker")
    assert isinstance(connect_options(NatsConfig(tls=True), None)["tls"], ssl.SSLContext)
    assert isinstance(connect_options(NatsConfig(url="tls://h:4222"), None)["tls"], ssl.SSLContext)
    with pytest.raises(ConfigError, match="TLS files"):
        connect_options(NatsConfig(tls_ca_file=str(tmp_path / "missing.pem")), None)


def test_urls_are_logged_without_user_info() -> None:
    assert redacted_url("nats://u:secret@h:4222,nats://h2:4222") == "nats://***@h:4222,nats://h2:4222"
    assert redacted_url("tls://token@h") == "tls://***@h"
    assert redacted_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"


def test_shoal_secrets_stay_out_of_a_workers_environment() -> None:
    for name in ("SHOAL_NATS_PASSWORD", "SHOAL_NATS_TOKEN", "SHOAL_NATS_WORKERS_PASSWORD", "SHOAL_GATEWAY_API_KEYS",
                 "SHOAL_GATEWAY_ADMIN_API_KEYS"):
        assert is_secret_env_var(name)
    for name in ("SHOAL_NATS_URL", "SHOAL_WORKER_KERNELS_CPU", "PATH", "MY_PASSWORD"):
        assert not is_secret_env_var(name)


def test_compose_ships_the_users_the_permission_table_renders() -> None:
    """deploy/nats/shoal-users.conf is `render_users()`, and docs/operations.md holds the table."""
    assert (REPO_ROOT / "deploy" / "nats" / "shoal-users.conf").read_text() == render_users()
    assert render_table() in (REPO_ROOT / "docs" / "operations.md").read_text()


def test_no_role_may_write_what_is_not_its_own() -> None:
    publish = {role: allowed(role)[0] for role in ROLES}
    assert [s for s in publish["gateway"] if s.startswith("$KV.")] == ["$KV.shoal_sessions.>",
                                                                      "$KV.shoal_responses.>",
                                                                      "$KV.shoal_batches.>"]
    # The one purge: of the gateways' own object store (deleting a Batch API file drops its chunks).
    assert [s for s in publish["gateway"] if ".STREAM.PURGE." in s] == ["$JS.API.STREAM.PURGE.OBJ_shoal_files"]
    assert [s for s in publish["worker"] if s.startswith("$KV.")] == ["$KV.shoal_replicas.>"]
    assert "$KV.shoal_nodes.>" not in publish["scheduler"]
    for role in ROLES:
        assert not [s for s in publish[role] if any(verb in s for verb in (".STREAM.UPDATE.", ".STREAM.DELETE.",
                                                                           ".STREAM.PURGE."))
                    and not s.endswith(".OBJ_shoal_files")], role
        assert ">" not in publish[role] and "$JS.API.>" not in publish[role]
        assert all(grant.what for grant in PERMISSIONS[role])


def test_the_worker_answers_only_a_gateways_reply_subject() -> None:
    assert subjects.is_reply_subject("shoal.reply.gw1.abc", "gw1", "abc")
    for subject, gateway, request in [
        ("$KV.shoal_gpus.n.0", "gw1", "abc"),            # another service's subject
        ("shoal.reply.gw1.other", "gw1", "abc"),         # someone else's request
        ("shoal.reply.gw1.>", "gw1", ">"),               # a wildcard
        ("shoal.reply.a.b.c", "a.b", "c"),               # a dot smuggled into the gateway id
        ("shoal.reply..abc", "", "abc"),
        ("shoal.node.n.create", "gw1", "abc"),
    ]:
        assert not subjects.is_reply_subject(subject, gateway, request), subject


@pytest.mark.parametrize("replica_id", ["../../etc/passwd", "a.b", "r 1", "x" * 65, "", "r\n1", "*", ">"])
def test_a_malformed_replica_id_is_refused_by_every_decoder(replica_id: str) -> None:
    with pytest.raises(ValueError):
        subjects.validate_replica_id(replica_id)
    event = {"type": "worker_event", "replica_id": replica_id, "kind": "ready"}
    with pytest.raises(msgspec.ValidationError):
        worker_event_decoder.decode(msgspec.json.encode(event))
    create = {"type": "create", "replica": {"replica_id": replica_id, "model": "m", "node_id": "n"},
              "model": {"key": "m", "path": "m"}}
    with pytest.raises(msgspec.ValidationError):
        create_replica_decoder.decode(msgspec.json.encode(create))
    with pytest.raises(msgspec.ValidationError):
        scheduler_command_decoders["evict"].decode(msgspec.json.encode({"type": "evict", "model": "m",
                                                                         "replica_id": replica_id}))


@pytest.mark.parametrize("count", [-1, 1025, 10**12])
def test_replica_counts_are_bounded_where_the_scheduler_decodes_them(count: int) -> None:
    with pytest.raises(msgspec.ValidationError):
        scheduler_command_decoders["scale"].decode(msgspec.json.encode({"type": "scale", "model": "m",
                                                                     "num_replicas": count}))
    with pytest.raises(msgspec.ValidationError):
        scheduler_command_decoders["ensure"].decode(msgspec.json.encode({"type": "ensure", "model": "m",
                                                                      "min_replicas": count}))
    spec = {"key": "m", "path": "m", "min_replicas": max(count, 0)}
    if count > 0:
        with pytest.raises(msgspec.ValidationError):
            scheduler_command_decoders["register"].decode(msgspec.json.encode({"type": "register", "spec": spec}))


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-30, 5e-6, -0.0])
def test_a_temperature_that_would_underflow_is_greedy(temperature: float) -> None:
    params = SamplingParams(temperature=temperature)
    assert params.temperature == 0.0 and params.is_reproducible
    wire = msgspec.msgpack.encode({"type": "infer", "request_id": "r", "model": "m", "deadline": 0.0,
                                   "reply_to": "shoal.reply.g.r", "params": {"temperature": temperature}})
    assert request_decoder.decode(wire).params.temperature == 0.0
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


def test_a_worker_event_carries_its_token_on_the_wire() -> None:
    event = worker_event_decoder.decode(encode_json(WorkerEvent("r1", "ready", measured_bytes=5, token="t0k3n")))
    assert event.token == "t0k3n"
    with pytest.raises(msgspec.ValidationError):  # no negative memory either
        worker_event_decoder.decode(msgspec.json.encode({"type": "worker_event", "replica_id": "r1", "kind": "ready",
                                                         "measured_bytes": -1}))
