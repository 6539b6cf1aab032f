"""The agent's settings: flags, environment, pepper, bare boolean flags (region_agent/settings.py,
region_agent/__main__.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel.config import ConfigError
from region_agent.settings import AgentSettings, load_agent_settings, resolve_pepper


def test_settings_flags_env_and_pepper(tmp_path: Path):
    s = load_agent_settings(["--redis-url", "redis+cluster://127.0.0.1:7000", "--port", "9000"],
                            env={"LEASEHOLD_AGENT_REGION": "eu"})
    assert (s.port, s.region, s.redis_url) == (9000, "eu", "redis+cluster://127.0.0.1:7000")
    with pytest.raises(ConfigError):
        load_agent_settings(["--port", "70000"], env={})
    with pytest.raises(ConfigError):
        resolve_pepper(AgentSettings(), env={})
    assert resolve_pepper(AgentSettings(), env={"LEASEHOLD_AGENT_PEPPER": "s3cret"}) == b"s3cret"
    f = tmp_path / "pepper"
    f.write_text("from-file\n")
    assert resolve_pepper(AgentSettings(pepper_file=str(f)), env={}) == b"from-file"
    assert resolve_pepper(AgentSettings(insecure_dev_pepper=True), env={})


def test_bare_boolean_flags():
    from region_agent.__main__ import normalize_argv

    assert normalize_argv(["--insecure-dev-pepper", "--port", "1"]) == ["--insecure-dev-pepper", "true", "--port", "1"]
    assert normalize_argv(["--redis-cluster"]) == ["--redis-cluster", "true"]
    assert normalize_argv(["--redis-cluster", "false"]) == ["--redis-cluster", "false"]
