"""Two pool rules on one pool that a request selects together (docs/bound.md): the bundle must
not validate (the agent refuses to start with it), and if such a call ever reaches the store
anyway, the script's refusal never becomes an admission for a pool rule. Real Redis; the second
test loads the bundle past validation on purpose."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from kernel.bundle import Bundle, Pool, encode_bundle, make_rule, seal, validate_bundle
from kernel.errors import PolicyError
from leasehold.local.services import agent_command
from region_agent.service.app import create_app
from region_agent.service.policy import PolicyHolder
from tests.support.agent import PEPPER, admit_json, make_settings
from tests.support.policies import ROOT

POOL = Pool(id="dup-w", window_ms=60_000, limit=1_000, fallback_per_region=50)
RULES = [make_rule(id="atlas-pool", scope="tenant", tenant="atlas", algorithm="pool", pool=POOL.id, fail_mode="local_bounded"),
         make_rule(id="atlas-read-pool", scope="tenant", tenant="atlas", route_group="read", algorithm="pool", pool=POOL.id,
              fail_mode="local_bounded")]


def _bundle() -> Bundle:
    return seal(Bundle(bundle_version=5, published_at="2026-11-30T00:00:00Z", checksum="", rules=RULES, pools=[POOL]))


def test_duplicate_pool_rules_do_not_validate_and_the_agent_refuses_them(tmp_path: Path):
    with pytest.raises(PolicyError) as e:
        validate_bundle(_bundle())
    assert any("dup-w" in p for p in e.value.errors), e.value.errors
    policy = tmp_path / "bundle.json"
    policy.write_bytes(encode_bundle(_bundle()))
    done = subprocess.run(agent_command(policy=policy, insecure_dev_pepper=True, auth_disabled=True, port=0),
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "dup-w" in done.stderr


async def test_a_rejected_pool_call_is_never_an_admission(redis_url: str, tmp_path: Path):
    policy = tmp_path / "bundle.json"
    policy.write_bytes(encode_bundle(_bundle()))
    holder = PolicyHolder(str(policy), _bundle())  # past validation on purpose
    app = create_app(make_settings(redis_url, policy), pepper=PEPPER, holder=holder)
    async with AsyncTestClient(app=app) as client:
        for i in range(5):
            d = await admit_json(client, f"r-dup-{i:04d}", tenant="atlas", route="read")
            assert not d["allowed"], d
            assert (d["httpStatus"], d["reason"], d["fallback"]) == (503, "POLICY_ERROR", False), d
