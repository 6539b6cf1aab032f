"""Cold start (docs/bound.md): the balances an agent leases before it reports ready."""

from pathlib import Path

from kernel.bundle import load_bundle_file
from region_agent.leasing.warmup import warmup_balances

SAMPLE = load_bundle_file(str(Path(__file__).resolve().parents[4] / "policies" / "northstar-global.json"))


def test_every_pool_of_the_sample_policy_is_warmed_once():
    got = {key: pool.id for pool, key in warmup_balances(SAMPLE, "eu")}
    assert got == {"rl:v3:{t:atlas}:pool:atlas-minute": "atlas-minute",
                   "rl:v3:{t:birch}:pool:birch-minute": "birch-minute",
                   "rl:v3:{g:global-read}:pool:global-read": "global-read"}
