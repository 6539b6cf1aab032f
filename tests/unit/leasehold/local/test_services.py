"""leasehold.local.services: the one builder of the services' command lines reads back as the same settings."""

from pathlib import Path

import pytest

from allocator.settings import ENV_PREFIX as ALLOCATOR_ENV
from allocator.settings import AllocatorSettings
from kernel.config import load_settings
from leasehold.local.services import agent_command, allocator_command
from region_agent.service.settings import ENV_PREFIX as AGENT_ENV
from region_agent.service.settings import AgentSettings


def test_agent_command_round_trips_through_the_settings_loader():
    cmd = agent_command("--log-level", "warning", redis_url="redis://127.0.0.1:1/0", policy=Path("/p.json"),
                        region="eu", port=9001, allocator_urls=["http://a", "http://b"], auth_disabled=True,
                        negative_cache_ms=0, pepper_file=None, python="py")
    assert cmd[:3] == ["py", "-m", "region_agent"] and "--pepper-file" not in cmd
    s = load_settings(AgentSettings, AGENT_ENV, cmd[3:], env={})
    assert (s.redis_url, s.policy, s.region, s.port) == ("redis://127.0.0.1:1/0", "/p.json", "eu", 9001)
    assert s.allocator_urls == ["http://a", "http://b"] and s.auth_disabled is True and s.negative_cache_ms == 0
    assert s.log_level == "warning"


def test_allocator_command_round_trips_and_later_flags_win():
    cmd = allocator_command("--log-level", "error", etcd=["127.0.0.1:1", "127.0.0.1:2"], policy="/b.json",
                            node_id="n-1", policy_from_etcd=False, log_level="info")
    s = load_settings(AllocatorSettings, ALLOCATOR_ENV, cmd[3:], env={})
    assert (s.etcd, s.node_id, s.policy_from_etcd, s.log_level) == ("127.0.0.1:1,127.0.0.1:2", "n-1", False, "error")


def test_a_misspelt_setting_fails_when_the_command_is_built():
    with pytest.raises(ValueError, match="redis_uri"):
        agent_command(redis_uri="redis://x")
    with pytest.raises(ValueError, match="AllocatorSettings"):
        allocator_command(region="eu")
