"""``--http-keepalive-s`` reaches uvicorn's ``timeout_keep_alive``, in one process and in the
configuration the worker processes are started with (docs/decisions/0093-*)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import uvicorn
import uvicorn.supervisors

from allocator.settings import AllocatorSettings
from kernel import httpserver
from kernel.config import ConfigError, load_settings
from region_agent.service.settings import ENV_PREFIX, AgentSettings


def served_config(monkeypatch: pytest.MonkeyPatch, limits: httpserver.HttpLimits, workers: int = 1) -> Any:
    """The uvicorn config :func:`httpserver.serve` runs with (nothing is served)."""
    seen: list[Any] = []

    class Server:
        def __init__(self, config: Any) -> None:
            seen.append(config)

        def run(self) -> None:
            pass

    class Multiprocess:
        def __init__(self, config: Any, sockets: Any) -> None:
            seen.append(config)

        def run(self) -> None:
            pass

    monkeypatch.setattr(uvicorn, "Server", Server)
    monkeypatch.setattr(uvicorn.supervisors, "Multiprocess", Multiprocess)
    monkeypatch.setattr(httpserver.LimitedConfig, "bind_socket", lambda self: None)
    monkeypatch.setattr(httpserver, "raise_fd_limit", lambda needed: needed)
    httpserver.serve("region_agent.__main__:app_factory", factory=True, host="127.0.0.1", port=0,
                     limits=limits, log_level="warning", workers=workers)
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("workers", [1, 3])
def test_the_setting_reaches_uvicorns_keep_alive(monkeypatch: pytest.MonkeyPatch, workers: int):
    settings = load_settings(AgentSettings, ENV_PREFIX, ["--http-keepalive-s", "300"], env={})
    config = served_config(monkeypatch, settings.http_limits(), workers)
    assert config.timeout_keep_alive == 300


def test_the_default_outlasts_the_gateways_idle_timeouts(monkeypatch: pytest.MonkeyPatch):
    # the shipped Envoy and nginx close idle connections at 60 s, Traefik's ForwardAuth at Go's 90 s
    # (tests/e2e/test_deploy_files.py compares the shipped files with this default)
    for cls in (AgentSettings, AllocatorSettings):
        assert {f.name: f.default for f in msgspec.structs.fields(cls)}["http_keepalive_s"] == 120
    config = served_config(monkeypatch, AgentSettings().http_limits())
    assert config.timeout_keep_alive == 120
    assert httpserver.HttpLimits().keepalive_s == 120  # the server's own default, for a caller without settings


@pytest.mark.parametrize("value", ["0", "3601"])
def test_out_of_bounds_is_refused(value: str):
    with pytest.raises(ConfigError, match="http-keepalive-s"):
        load_settings(AgentSettings, ENV_PREFIX, ["--http-keepalive-s", value], env={})
