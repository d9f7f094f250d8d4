"""The `shoal` command.

    shoal up            everything on this machine (embedded NATS, demo models, virtual GPUs)
    shoal gateway       the OpenAI-compatible HTTP gateway
    shoal scheduler     placement and replicas
    shoal node-agent    this machine's GPUs and worker processes
    shoal worker        one replica (spawned by the node agent)
    shoal demo-models   write the demo models under a models root
    shoal inspect       streams, KV buckets and micro services (what the NATS CLI shows)
    shoal status        nodes, GPUs, replicas and models
    shoal scale         set a model's desired replica count
    shoal evict         evict a model's replicas
    shoal simulate      Shoal's policies on a simulated cluster (docs/simulation.md)
    shoal run-batch     a file of requests in OpenAI's batch format, answered by a gateway
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from shoal.shared import event_loop
from shoal.shared.config import ConfigError, ShoalConfig, load_config
from shoal.shared.logs import configure_logging


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="shoal.toml (default: $SHOAL_CONFIG or ./shoal.toml if present)")
    parser.add_argument("--nats-url", help="NATS server URL (shoal up: omit to start an embedded one)")
    parser.add_argument("--log-format", choices=["console", "json"])
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def _gateway_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="gateway listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="gateway port (default 8000)")
    parser.add_argument("--insecure-open-admin", action="store_true", default=None,
                        help="serve /admin with no key on a non-loopback --host (anyone who reaches the "
                             "gateway may register, remove and scale models); without it such a gateway "
                             "refuses to start")


def _node_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node-id", help="unique node id (default: host name)")
    parser.add_argument("--gpus", help="nvml, or virtual:<count>x<size> (default virtual:2x16GiB)")
    parser.add_argument("--models-root", help="directory holding the models (default ./models)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="run everything on this machine")
    _common(up)
    _gateway_flags(up)
    _node_flags(up)
    up.add_argument("--state-dir", help="embedded NATS store and worker logs (default ./.shoal)")
    up.add_argument("--no-demo-models", action="store_true", help="serve only the models in the config")

    for name, help_text, extra in (
        ("gateway", "run the HTTP gateway", [_gateway_flags]),
        ("scheduler", "run a scheduler", []),
        ("node-agent", "run this machine's node agent", [_node_flags]),
    ):
        sub = commands.add_parser(name, help=help_text)
        _common(sub)
        for add in extra:
            add(sub)
        if name == "node-agent":
            sub.add_argument("--state-dir", help="worker logs (default ./.shoal)")
        if name != "gateway":
            sub.add_argument("--metrics-port", type=int, help="serve GET /metrics on this port")
            sub.add_argument("--metrics-host", default="127.0.0.1")

    from shoal.services.worker.launch import add_worker_arguments

    add_worker_arguments(commands.add_parser("worker", help="run one replica (normally spawned by a node agent)"))

    check = commands.add_parser("check", help="check a configuration and its models before starting (exit 1 on "
                                              "an error)")
    _common(check)
    _gateway_flags(check)
    _node_flags(check)
    check.add_argument("--no-demo-models", action="store_true", help="check only the models in the config")

    demo = commands.add_parser("demo-models", help="write the demo models")
    demo.add_argument("--models-root", default="./models")
    demo.add_argument("--force", action="store_true", help="rewrite models that exist")

    for name, help_text in (("inspect", "streams, KV buckets and micro services"),
                            ("status", "nodes, GPUs, replicas and models"),
                            ("scale", "set a model's desired replica count"),
                            ("evict", "evict a model's replicas (all, or one with --replica)")):
        sub = commands.add_parser(name, help=help_text)
        _common(sub)
        sub.add_argument("--state-dir", help="where `shoal up` wrote its NATS URL (default ./.shoal)")
        if name in ("scale", "evict"):
            sub.add_argument("model")
        if name == "scale":
            sub.add_argument("replicas", type=int)
        if name == "evict":
            sub.add_argument("--replica", help="the replica id (default: every replica)")

    from shoal.sim.cli import add_simulate_arguments  # argparse only: numpy comes with the command

    add_simulate_arguments(commands.add_parser(
        "simulate", help="compare placement policies on a simulated cluster (docs/simulation.md)"))
    from shoal.cli.run_batch import add_run_batch_arguments

    add_run_batch_arguments(commands.add_parser(
        "run-batch", help="answer a file of requests in OpenAI's batch format (JSONL) through a running gateway"))
    return parser


def config_from_args(args: argparse.Namespace) -> ShoalConfig:
    overrides: dict[str, Any] = {}

    def put(section: str | None, key: str, value: Any) -> None:
        if value is None:
            return
        if section is None:
            overrides[key] = value
        else:
            overrides.setdefault(section, {})[key] = value

    put("nats", "url", getattr(args, "nats_url", None))
    put("gateway", "host", getattr(args, "host", None))
    put("gateway", "port", getattr(args, "port", None))
    put("gateway", "insecure_open_admin", getattr(args, "insecure_open_admin", None))
    put("node", "node_id", getattr(args, "node_id", None))
    put("node", "gpus", getattr(args, "gpus", None))
    put("node", "models_root", getattr(args, "models_root", None))
    put(None, "state_dir", getattr(args, "state_dir", None))
    if getattr(args, "no_demo_models", False):
        overrides["demo_models"] = False
    put("logging", "format", getattr(args, "log_format", None))
    put("logging", "level", getattr(args, "log_level", None))
    return load_config(args.config, overrides=overrides)


def _nats_url_for_tools(config: ShoalConfig) -> str:
    if config.nats.url:
        return config.nats.url
    from shoal.cli.launcher import NATS_URL_FILE

    url_file = Path(config.state_dir) / NATS_URL_FILE
    if url_file.is_file():
        return url_file.read_text().strip()
    return "nats://127.0.0.1:4222"


async def _with_bus(config: ShoalConfig, name: str, action: Callable[[Any], Awaitable[None]]) -> None:
    from shoal.shared.bus import connect

    bus = await connect(_nats_url_for_tools(config), name, nats_config=config.nats)
    try:
        await action(bus)
    finally:
        await bus.close()


async def _run_service(config: ShoalConfig, args: argparse.Namespace) -> None:
    from shoal.cli import launcher
    from shoal.shared.gc_freeze import freeze_startup_objects
    from shoal.shared.metrics import Registry
    from shoal.shared.nats_connect import redacted_url

    registry = Registry()
    url = config.nats.url or "nats://127.0.0.1:4222"
    starters = {
        "gateway": launcher.gateway_running,
        "scheduler": launcher.scheduler_running,
        "node-agent": launcher.node_agent_running,
    }
    async with (
        starters[args.command](config, url, registry),
        launcher.metrics_serving(registry, getattr(args, "metrics_host", "127.0.0.1"),
                                 getattr(args, "metrics_port", None)),
    ):
        freeze_startup_objects()
        stop = launcher.stop_signals()  # before the ready line, as `shoal up`
        print(f"shoal {args.command} is up (NATS {redacted_url(url)})", flush=True)
        await stop.wait()


async def _scheduler_command(bus: Any, args: argparse.Namespace) -> None:
    from shoal.shared import subjects
    from shoal.shared.messages import EvictReplicas, ScaleModel, scheduler_reply_decoder
    from shoal.shared.micro import request_json

    command: ScaleModel | EvictReplicas
    if args.command == "scale":
        command = ScaleModel(args.model, args.replicas)
    else:
        command = EvictReplicas(args.model, args.replica)
    reply = await request_json(bus.nc, subjects.scheduler_subject(args.command), command, scheduler_reply_decoder,
                               timeout_s=300.0)
    print(f"{reply.status}: {reply.message}" if reply.message else reply.status)
    for record in reply.replicas:
        print(f"  {record.name}  {record.level} {record.state} on {record.node_id}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "worker":
        from shoal.services.worker.main import run_worker

        return run_worker(args)
    if args.command == "simulate":
        from shoal.sim.cli import run_simulate

        return run_simulate(args)
    if args.command == "run-batch":
        from shoal.cli.run_batch import run_batch

        return run_batch(args)
    if args.command == "demo-models":
        from shoal.cli.demo_models import make_demo_models

        configure_logging("console", "info")
        for model in make_demo_models(Path(args.models_root), force=args.force):
            print(f"{model.key:<20} {model.num_parameters / 1e6:7.1f}M params  {Path(args.models_root) / model.path}")
        return 0
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    if args.command == "check":  # a report on stdout, no logging set up
        from shoal.cli.check import check, report
        from shoal.cli.launcher import model_specs

        return report(check(config, model_specs(config)), sys.stdout)  # demo models: those written
    if args.command == "up" and (refused := _unservable(config)):  # before logging is set up: nothing ran
        return refused
    configure_logging(config.logging.format, config.logging.level, service=args.command)
    from shoal.cli import launcher
    from shoal.cli.inspection import inspect, status
    from shoal.shared.bus import BusError
    from shoal.shared.micro import ServiceCallError

    try:
        if args.command == "up":
            launcher.ensure_demo_models(config)
            with launcher.nats_for(config) as url:
                event_loop.run(launcher.run_up(config, url))
        elif args.command == "inspect":
            event_loop.run(_with_bus(config, "shoal-inspect", lambda bus: inspect(bus, sys.stdout)))
        elif args.command == "status":
            event_loop.run(_with_bus(config, "shoal-status",
                                     lambda bus: status(bus, sys.stdout, config.scheduler.placement)))
        elif args.command in ("scale", "evict"):
            event_loop.run(_with_bus(config, f"shoal-{args.command}",
                                     lambda bus: _scheduler_command(bus, args)))
        else:
            event_loop.run(_run_service(config, args))
    except ServiceCallError as exc:
        print(f"shoal {args.command}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `shoal status | head`: the reader has what it wanted
        _quiet_stdout()
        return 0
    except (BusError, ConfigError, OSError) as exc:
        print(f"shoal {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _unservable(config: ShoalConfig) -> int:
    """2, having said why, when a configured model cannot be served at all (`check.unservable_models`)."""
    from shoal.cli.check import unservable_models
    from shoal.cli.launcher import model_specs

    findings = unservable_models(config, model_specs(config))
    for finding in findings:
        print(f"shoal up: model {finding.subject}: {finding.message}", file=sys.stderr)
    if findings:
        print("shoal up: fix or remove these models (`shoal check` reports on a config)", file=sys.stderr)
    return 2 if findings else 0


def _quiet_stdout() -> None:
    """Point standard output at /dev/null, so the interpreter's last flush of what the closed
    pipe did not take fails no more (Python's documented recipe for SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
