"""structlog setup shared by every service: console or JSON, context from contextvars.

Entry points bind ``request_id``, ``model`` and ``replica`` with
`structlog.contextvars.bind_contextvars`; `merge_contextvars` runs first in the
chain so every event carries them.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(fmt: str = "console", level: str = "info", *, service: str = "") -> None:
    """Configure structlog (and the stdlib root logger it forwards to) for one process."""
    numeric_level = getattr(logging, level.upper(), logging.INFO)
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if service:
        processors.append(_add_service(service))
    if fmt == "json":
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors.append(
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback)
        )
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(numeric_level, logging.WARNING), stream=sys.stderr, force=True)


def _add_service(service: str) -> structlog.typing.Processor:
    def processor(_logger: object, _name: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
        event.setdefault("service", service)
        return event

    return processor
