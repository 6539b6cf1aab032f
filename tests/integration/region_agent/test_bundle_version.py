"""policyEpoch in the admission request (docs/invariants.md I3, I13): the decision carries the version it was
made with; a gateway naming a newer version makes the agent look at its bundle source at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

from litestar.testing import AsyncTestClient

from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_body, make_settings
from tests.support.policies import northstar, write_bundle


def count(text: str, relation: str) -> float:
    prefix = f'leasehold_agent_policy_epoch_mismatches_total{{relation="{relation}"}} '
    return next(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))


async def test_a_newer_bundle_version_triggers_a_refresh_and_is_counted(redis_url: str, policy_file: Path):
    # polling off (policy_poll_ms 0): only SIGHUP - or a gateway that has seen a newer bundle - reloads
    app = create_app(make_settings(redis_url, policy_file), pepper=PEPPER)
    async with AsyncTestClient(app=app) as agent:
        write_bundle(policy_file, northstar(), bundle_version=43)
        await asyncio.sleep(0.05)
        plain = (await agent.post("/v1/admit", json=admit_body("version-0000"))).json()
        assert plain["policyVersion"] == 42  # no version named (policyEpoch): nothing looks at the file
        first = (await agent.post("/v1/admit", json={**admit_body("version-0001"), "policyEpoch": 43})).json()
        assert first["policyVersion"] == 43  # the file is looked at before deciding (a stat and a parse)
        second = (await agent.post("/v1/admit", json={**admit_body("version-0002"), "policyEpoch": 43})).json()
        assert second["policyVersion"] == 43
        behind = (await agent.post("/v1/admit", json={**admit_body("version-0003"), "policyEpoch": 41})).json()
        assert behind["policyVersion"] == 43
        text = (await agent.get("/metrics")).text
        assert count(text, "gateway_ahead") == 1 and count(text, "gateway_behind") == 1
        assert app.state.agent.version_check.refreshes == 1
