"""The services' example.env files as shipped: their settings load (values valid), and every
commented-out example names a real option with a value of the right shape."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from allocator.settings import ENV_PREFIX as ALLOCATOR_ENV
from allocator.settings import AllocatorSettings, load
from kernel.options import options
from region_agent.service.settings import ENV_PREFIX as AGENT_ENV
from region_agent.service.settings import AgentSettings, load_agent_settings

ROOT = Path(__file__).resolve().parents[4]
LINE = re.compile(r"^(#\s*)?([A-Z][A-Z0-9_]*)=(\S*)")
SECRETS = {"LEASEHOLD_AGENT_PEPPER", "LEASEHOLD_AGENT_REDIS_PASSWORD", "LEASEHOLD_AGENT_POLICY_ETCD_PASSWORD",
           "LEASEHOLD_ALLOCATOR_ETCD_PASSWORD"}


def entries(path: Path) -> list[tuple[bool, str, str]]:
    out = []
    for line in path.read_text().splitlines():
        m = LINE.match(line)
        if m:
            out.append((m.group(1) is None, m.group(2), m.group(3)))
    return out


@pytest.mark.parametrize("rel,cls,prefix,loader", [
    ("region_agent/example.env", AgentSettings, AGENT_ENV, load_agent_settings),
    ("allocator/example.env", AllocatorSettings, ALLOCATOR_ENV, load),
])
def test_example_env_loads_and_names_real_options(rel, cls, prefix, loader):
    found = entries(ROOT / rel)
    known = {o.env: o for o in options(cls, prefix)}
    for _active, name, value in found:
        assert name in known or name in SECRETS, f"{rel}: {name} is not an option"
        if name in known and known[name].is_bool:
            assert value in ("true", "false"), f"{rel}: {name}={value}: switches take true or false"
    active_env = {name: value for active, name, value in found if active}
    settings = loader([], env=active_env)
    assert settings is not None
    assert len(found) >= 20
