"""The agent's Redis ACL (leasehold.local.procs.AGENT_COMMANDS) allows every command its Lua scripts
call: scripts run under the caller's ACL user, so a command missing here fails every call of that
script with NOPERM (seen when pool scripts began reading PTTL: every fleet chunk renewal was
refused as a policy error, 503, in the authenticated topology)."""

from __future__ import annotations

import re
from pathlib import Path

from leasehold.local.procs import AGENT_COMMANDS, agent_acl

LUA = Path(__file__).resolve().parents[4] / "lua"


def test_every_command_the_scripts_call_is_allowed():
    called = {m.lower() for f in LUA.rglob("*.lua")
              for m in re.findall(r"redis\.p?call\(\s*'([A-Za-z]+)'", f.read_text())}
    assert called, "no redis.call found: the pattern no longer matches the scripts"
    assert called <= set(AGENT_COMMANDS), sorted(called - set(AGENT_COMMANDS))


def test_the_rule_grants_only_the_listed_commands_on_rl_keys():
    rule = agent_acl("agent", "pw").split()
    assert rule[:6] == ["agent", "on", ">pw", "resetkeys", "~rl:*", "resetchannels"]
    assert "-@all" in rule and {r[1:] for r in rule if r.startswith("+")} == set(AGENT_COMMANDS)


def test_the_cluster_stores_own_commands_are_allowed():
    """A Redis Cluster store reads the slot map (CLUSTER SLOTS) and sends ASKING before a call to a
    slot's migration target (region_agent/store/cluster.py, scripts.ASKING): refused, every
    cluster agent with an ACL user would see no primary at all."""
    import inspect

    from region_agent.store import cluster, scripts

    assert '"CLUSTER", "SLOTS"' in inspect.getsource(cluster) and b"ASKING" in scripts.ASKING
    assert {"cluster|slots", "asking"} <= set(AGENT_COMMANDS)
