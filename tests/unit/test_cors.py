"""Which browser origins may call the gateway (services/gateway/cors.py); the headers on a real
socket: tests/integration/test_gateway_edge.py."""

from __future__ import annotations

import pytest

from shoal.services.gateway.cors import CorsPolicy
from shoal.shared.config import ConfigError, GatewayConfig, load_config


@pytest.mark.parametrize(("origins", "origin", "allowed"), [
    (["http://localhost:3000"], "http://localhost:3000", True),
    (["http://localhost:3000"], "HTTP://LOCALHOST:3000", True),     # origins compare case-insensitively
    (["http://localhost:3000"], "http://localhost:3001", False),
    (["http://localhost:*"], "http://localhost:5173", True),        # any port, as OLLAMA_ORIGINS writes it
    (["http://localhost:*"], "http://localhost.evil.com:80", False),
    (["http://localhost:*"], "http://localhost", False),
    (["app://obsidian.md"], "app://obsidian.md", True),              # an app's scheme
    (["*"], "https://anyone.example", True),
    ([], "http://localhost:3000", False),
    (["http://localhost:3000"], None, False),
])
def test_an_origin_is_allowed_only_as_listed(origins: list[str], origin: str | None, allowed: bool) -> None:
    policy = CorsPolicy(GatewayConfig(cors_origins=origins).cors_origins)
    assert policy.allows(origin) is allowed


def test_listed_origins_are_lower_cased_and_the_environment_may_space_them() -> None:
    assert GatewayConfig(cors_origins=["HTTP://Chat.Example.com"]).cors_origins == ["http://chat.example.com"]
    config = load_config(None, environ={"SHOAL_GATEWAY_CORS_ORIGINS": "http://a.example, http://b.example:*"})
    assert config.gateway.cors_origins == ["http://a.example", "http://b.example:*"]
    with pytest.raises(ConfigError, match="is not an origin"):
        load_config(None, environ={"SHOAL_GATEWAY_CORS_ORIGINS": "localhost:3000"})
