"""The hot-key chunk term of the bound (kernel.bound.hot_chunk_term): chunkMax per agent process
for the algorithms whose chunks may be spent in a later window than they were counted in, 0 for
those whose chunks end with their window; in every pool's terms (what the chaos checker judges)
and in ``leasehold policy validate --bound``."""

from __future__ import annotations

import json
from pathlib import Path

from chaos.invariants import PoolPolicy
from kernel.algorithms import HotChunk
from kernel.bound import HOT, Topology, hot_chunk_term, pool_bound, shape_of
from kernel.bundle import Bundle, Pool, encode_bundle, make_rule, seal
from leasehold.commands.cli import main

HOT_CHUNK = HotChunk(threshold_per_s=500, chunk_max=40, validity_ms=250)


def _rule(algorithm: str, **kw):
    fields = {"token_bucket": {"capacity_millis": 10_000, "refill_millis": 1_000, "period_ms": 1_000,
                               "cost_millis": 1_000},
              "sliding_log": {"limit": 10, "window_ms": 1_000}, "fixed_window": {"limit": 10, "window_ms": 1_000},
              "pool": {"pool": "p"}}[algorithm]
    return make_rule(id=f"r-{algorithm.replace('_', '-')}", scope="tenant", tenant="acme", algorithm=algorithm,
                     fail_mode="closed", **fields, **kw)


def test_the_term_is_chunk_max_per_agent_process_of_the_region():
    topo = Topology(agents={"eu": 3, "us": 2})
    t = hot_chunk_term(_rule("token_bucket", hot_chunk=HOT_CHUNK), topo)
    assert t.name == HOT and t.tokens == 3 * 40  # the region with the most agent processes
    assert hot_chunk_term(_rule("sliding_log", hot_chunk=HOT_CHUNK), topo, "us").tokens == 2 * 40
    assert "3 agent processes x chunkMax 40" in t.formula


def test_chunks_that_end_with_their_window_add_nothing():
    topo = Topology.uniform(1, 4)
    assert hot_chunk_term(_rule("fixed_window", hot_chunk=HOT_CHUNK), topo).tokens == 0
    assert hot_chunk_term(_rule("pool", hot_chunk=HOT_CHUNK), topo).tokens == 0
    assert hot_chunk_term(_rule("token_bucket"), topo).tokens == 0  # no hotChunk


def test_every_pool_bound_carries_the_term_the_chaos_checker_judges():
    pool = Pool(id="p", window_ms=60_000, limit=1_000, fallback_per_region=10)
    rules = [_rule("pool", hot_chunk=HOT_CHUNK)]
    b = pool_bound(shape_of(pool, rules), Topology.uniform(2, 2))
    assert b.term(HOT).tokens == 0 and "end with the leases" in b.term(HOT).formula
    checked = pool_bound(PoolPolicy.from_pool(pool, rules=rules).shape(), Topology.uniform(2, 2))
    assert checked.term(HOT) == b.term(HOT) and checked.total == b.total


def test_validate_bound_prints_the_term(tmp_path: Path, capsys):
    bundle = seal(Bundle(bundle_version=2, published_at="2026-12-01T00:00:00Z", checksum="",
                         rules=[_rule("token_bucket", hot_chunk=HOT_CHUNK)]))
    policy = tmp_path / "b.json"
    policy.write_bytes(encode_bundle(bundle))
    assert main(["policy", "validate", str(policy), "--bound", "--agents-per-region", "3"]) == 0
    out = capsys.readouterr().out
    assert "rule r-token-bucket (token_bucket): 120   3 agent processes x chunkMax 40" in out, out
    assert main(["policy", "validate", str(policy), "--bound", "--agents-per-region", "3", "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["hotChunks"][0]["rule"] == "r-token-bucket" and doc["hotChunks"][0]["tokens"] == 120
