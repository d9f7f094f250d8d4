"""What every gateway handler reaches through ``request.app[GATEWAY]``."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from shoal.services.gateway.batch_runner import BatchRunner
from shoal.services.gateway.batch_store import BatchStore
from shoal.services.gateway.cluster import ClusterView
from shoal.services.gateway.dispatch import Dispatcher
from shoal.services.gateway.file_store import FileStore
from shoal.services.gateway.live import LiveFeeds
from shoal.services.gateway.response_store import ResponseStore
from shoal.services.gateway.router import ReplyRouter
from shoal.services.gateway.session_routes import SessionRoutes
from shoal.shared.bus import Bus
from shoal.shared.config import GatewayConfig
from shoal.shared.metrics import Counter, Histogram, Registry


@dataclass
class GatewayState:
    config: GatewayConfig
    bus: Bus
    router: ReplyRouter
    cluster: ClusterView
    dispatcher: Dispatcher
    session_routes: SessionRoutes
    """Which replica holds each chat session's KV (``shoal_sessions``)."""
    responses: ResponseStore
    """Stored Responses API answers (``shoal_responses``)."""
    files: FileStore
    """The Batch API's files (``shoal_files``)."""
    batches: BatchStore
    """The Batch API's batches (``shoal_batches``)."""
    batch_runner: BatchRunner
    metrics: Registry
    requests_total: Counter
    latency: Histogram
    live: LiveFeeds
    """Worker stats, the dashboard's history, the event feed."""


GATEWAY = web.AppKey("gateway", GatewayState)
