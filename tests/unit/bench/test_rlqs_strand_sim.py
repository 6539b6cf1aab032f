"""bench/rlqs_strand_sim.py: the model reproduces what the chaos scenario measured with the agent's
policy (about 20 of a window's 240 tokens stranded), and a policy that funds below the average
trades stranded tokens for tokens left unspent in the region's balance (decision 0048)."""

from __future__ import annotations

import statistics

from bench.rlqs_strand_sim import poisson_quantile, simulate


def test_poisson_quantile():
    assert poisson_quantile(20.0, 0.5) == 20
    assert poisson_quantile(20.0, 0.1) == 14
    assert poisson_quantile(0.0, 0.5) == 0


def test_the_agents_policy_strands_about_a_twelfth_and_funding_below_the_average_leaves_the_rest_unspent():
    mean = simulate("mean", windows=60, seed=1)
    assert 15 <= statistics.mean(mean.stranded) <= 28 and max(mean.unspent) == 0
    low = simulate("nq0.3", windows=60, seed=1)
    assert statistics.mean(low.stranded) < statistics.mean(mean.stranded)
    assert statistics.mean(low.utilisation) < statistics.mean(mean.utilisation)  # the balance is not spent in time
