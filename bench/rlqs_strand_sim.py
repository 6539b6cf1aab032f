"""A seeded model of RLQS funding in a pressed pool window (the chaos scenario ``rlqs-envoys``'s
``atlas-w``): how many of the window's tokens Envoys admit under a funding policy.

``python -m bench.rlqs_strand_sim [--windows N] [--seed S]`` prints, per policy, the mean and the
lowest decile of a window's utilisation (admitted / the pool's tokens of the window), and the
tokens stranded (funded to an assignment, never admitted) and left in the region's balance.

The model, in 50 ms steps (region_agent.leasing.rlqs_funding and region_agent.gateways.rlqs,
reduced to what decides stranding):

* a pool window of ``WINDOW_MS`` holds ``supply`` tokens in the region's balance from its start
  (what a window does not hand out is lost at its end); ``envoys`` x ``buckets`` user buckets each
  get Poisson requests at ``rate`` a second (the scenario: 2 x 6 buckets at 4 a second, 48 a second
  against a pool of 40);
* an assignment lives whole seconds and ends ``MARGIN_MS`` before the window's end; none is made in
  a window's last second; a fresh one replaces the last (its rest is stranded); an assignment's
  tokens left at its end are stranded;
* each Envoy reports every ``REPORT_MS`` at its own phase; the agent knows a bucket's demand
  exactly (the best case of its average) and its use only from reports: between them it predicts
  the use from the demand, and funds a holding whose predicted rest is within ``LEAD_MS`` of its
  demand (or that a report shows spent);
* a round gives what the policy's need says, at most what the balance holds; one that gets nothing
  is asked again ``RETRY_MS`` later.

Policies (``need``): ``mean`` (the agent's: the demand over the time to live), ``q<p>`` (the
Poisson quantile ``p`` of that), ``end<s>`` (the mean, but a quantile 0.3 for assignments of at
most ``s`` seconds: the window's end), ``nolead`` (the mean, and a holding is funded again only
once a report shows it spent or its assignment ended: no replacement on a prediction).

A model of the agent, not the agent: it tells which policy is worth trying, the chaos run judges.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_MS = 6_000
MARGIN_MS = 250
REPORT_MS = 5_000
LEAD_MS = 300
RETRY_MS = 500
STEP_MS = 50


def poisson_quantile(mean: float, p: float) -> int:
    """The least k with P(X <= k) >= p, X ~ Poisson(mean)."""
    if mean <= 0:
        return 0
    term = cdf = math.exp(-mean)
    k = 0
    while cdf < p and k < 10_000:
        k += 1
        term *= mean / k
        cdf += term
    return k


Need = Callable[[float, int], int]  # (demand a second, time to live in s) -> tokens


def policy(name: str) -> tuple[Need, bool]:
    """(need, replace on a predicted run-out)."""
    if name == "mean" or name == "nolead":
        return (lambda rate, ttl: max(1, math.ceil(rate * ttl))), name == "mean"
    if name.startswith("q") or name.startswith("nq"):
        p = float(name.lstrip("nq"))
        return (lambda rate, ttl: max(1, poisson_quantile(rate * ttl, p))), name.startswith("q")
    if name.startswith("end"):
        s = int(name[3:])
        return (lambda rate, ttl: max(1, poisson_quantile(rate * ttl, 0.3) if ttl <= s
                                      else math.ceil(rate * ttl))), True
    raise ValueError(name)


@dataclass
class Bucket:
    envoy: int
    tokens: int = 0  # Envoy's
    expires: float = 0.0
    chunk: int = 0  # the agent's view
    used: int = 0  # admitted since the assignment, as of the last report
    ref: float = 0.0  # when ``used`` was known (the assignment's start or a report)
    admitted_since: int = 0  # Envoy's count since the assignment
    retry: float = 0.0


@dataclass
class Result:
    utilisation: list[float]
    stranded: list[int]
    unspent: list[int]


def simulate(name: str, *, windows: int, seed: int, envoys: int = 2, buckets: int = 6, rate: float = 4.0,
             supply: int = 240) -> Result:
    need, replace = policy(name)
    rnd = random.Random(seed)
    phase = [rnd.uniform(0, REPORT_MS) for _ in range(envoys)]
    bs = [Bucket(e) for e in range(envoys) for _ in range(buckets)]
    out = Result([], [], [])
    p_step = rate * STEP_MS / 1000.0
    t = 0.0
    for _w in range(windows):
        start = t
        end = start + WINDOW_MS
        clamp = end - MARGIN_MS
        balance = supply
        admitted = stranded = 0
        while t < end:
            # reports
            for e in range(envoys):
                if (t - phase[e]) % REPORT_MS < STEP_MS:
                    for b in bs:
                        if b.envoy == e:
                            b.used, b.ref = b.admitted_since, t
            # funding
            ttl = int((clamp - t) // 1000)
            for b in bs:
                live = b.tokens > 0 and t < b.expires
                if ttl < 1 or t < b.retry:
                    continue
                if b.chunk and t < b.expires:
                    left = b.chunk - b.used - rate * (t - b.ref) / 1000.0
                    spent = b.used >= b.chunk  # a report showed it spent
                    if not (spent or (replace and left <= max(1.0, rate * LEAD_MS / 1000.0))):
                        continue
                give = min(need(rate, min(ttl, (REPORT_MS + 1000) // 1000)), balance)
                if give <= 0:
                    b.retry = t + RETRY_MS
                    continue
                if live:
                    stranded += b.tokens
                balance -= give
                b.tokens, b.expires, b.chunk, b.used, b.ref, b.admitted_since = give, t + ttl * 1000, give, 0, t, 0
            # requests
            for b in bs:
                n = _poisson(rnd, p_step)
                if n and t < b.expires:
                    a = min(n, b.tokens)
                    b.tokens -= a
                    b.admitted_since += a
                    admitted += a
                if b.tokens and t + STEP_MS >= b.expires:
                    stranded += b.tokens
                    b.tokens = 0
            t += STEP_MS
        for b in bs:  # nothing outlives the window (the clamp)
            stranded += b.tokens
            b.tokens, b.chunk = 0, 0
        out.utilisation.append(admitted / supply)
        out.stranded.append(stranded)
        out.unspent.append(balance)
    return out


def _poisson(rnd: random.Random, mean: float) -> int:
    k, p, limit = 0, 1.0, math.exp(-mean)
    while True:
        p *= rnd.random()
        if p <= limit:
            return k
        k += 1


POLICIES = ("mean", "q0.4", "q0.3", "q0.2", "end2", "nolead", "nq0.4", "nq0.3", "nq0.1")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--supply", type=int, default=240)
    ap.add_argument("--rate", type=float, default=4.0)
    a = ap.parse_args(argv)
    print(f"{'policy':8} {'mean':>6} {'p10':>6} {'>=0.97':>7} {'stranded':>9} {'unspent':>8}")
    for name in POLICIES:
        r = simulate(name, windows=a.windows, seed=a.seed, supply=a.supply, rate=a.rate)
        u = sorted(r.utilisation)
        print(f"{name:8} {statistics.mean(u):6.3f} {u[len(u) // 10]:6.3f} {sum(x >= 0.97 for x in u) / len(u):7.2f} "
              f"{statistics.mean(r.stranded):9.1f} {statistics.mean(r.unspent):8.1f}")


if __name__ == "__main__":
    main()
