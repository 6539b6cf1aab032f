"""Capacity arithmetic of the plan (docs/capacity.md) and the "shards" figure's projection."""

import json

import pytest

from bench.capacity import (
    leases_per_s,
    leases_per_ttl,
    main,
    plan_rows,
    pool_regions_served,
    projected_capacity,
    replicas_needed,
)


def test_projection_is_the_smaller_of_replicas_and_etcd():
    p = projected_capacity(3, 100.0, 50.0)  # 3 x 10,000 vs 20,000 on one etcd core
    assert (p.replica_bound, p.etcd_bound, p.per_s, p.bound_by) == (30_000, 20_000, 20_000, "etcd")
    p = projected_capacity(1, 100.0, 50.0)
    assert (p.per_s, p.bound_by) == (10_000, "replicas")
    assert projected_capacity(8, 100.0, 50.0, etcd_ceiling=44_341).per_s == 44_341  # a published ceiling
    with pytest.raises(ValueError):
        projected_capacity(0, 100.0, 50.0)


def test_the_issues_example_needs_tens_of_thousands_of_leases_per_second():
    # 100,000 tenants' worldwide pools in 5 regions, 15 s leases, one lease per pool-region per TTL
    assert leases_per_s(100_000 * 5, 15_000) == pytest.approx(33_333.3, rel=1e-4)
    assert pool_regions_served(33_334, 15_000) == 500_010
    # a region spending 300 tokens/s with chunkMax 1,000 over a 15 s TTL takes 5 leases per TTL
    assert leases_per_ttl(300, 15_000, 1_000) == 5 and leases_per_ttl(0, 15_000, 1_000) == 1
    assert replicas_needed(33_334, 100.0) == 5  # 3.33 cores at 70 %


def test_plan_rows_and_the_cli(tmp_path, capsys):
    rows = plan_rows(200.0, 100.0, 10_000, regions=5, ttls_ms=(15_000,), replicas=(1, 3))
    assert rows == [{"replicas": 1, "leases_per_s": 5_000, "bound_by": "replicas", "ttl_ms": 15_000,
                     "pools": 15_000, "regions": 5},
                    {"replicas": 3, "leases_per_s": 10_000, "bound_by": "etcd", "ttl_ms": 15_000,
                     "pools": 30_000, "regions": 5}]
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"rows": [{"figure": "shards", "extra": {"lease_cost_us": {"replica": 200.0,
                                                                                          "etcd": 100.0}}}]}))
    assert main([str(results)]) == 0
    assert "10,000 leases/s (etcd-bound)" in capsys.readouterr().out
    results.write_text(json.dumps({"rows": []}))
    assert main([str(results)]) == 1
