"""Pure parts of the benchmark harness: percentiles, goal/ratio evaluation, table rendering,
workload bodies and the per-window utilisation count (no network, no benchmark run)."""

import json
import math

import pytest

from bench.__main__ import parse_only
from bench.fig_util import per_window, pool_rows
from bench.stats import Goal, Row, median, percentile, ratio, render_markdown, render_text
from bench.workloads import admit_batch, admit_item, lease_batch


def test_percentile_interpolates_and_checks_input():
    assert percentile([3, 1, 2], 50) == 2
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99
    assert percentile([5.0], 99) == 5.0
    assert median([10, 1, 7]) == 7
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_ratio_and_goal_verdicts():
    assert ratio(40, 100) == 0.4
    assert ratio(1, 0) is None and ratio(1, None) is None
    assert Row("1", "x", 40, "/s", ceiling=100, goal=Goal(">=", 0.40)).verdict == "pass"
    assert Row("1", "x", 39, "/s", ceiling=100, goal=Goal(">=", 0.40)).verdict == "FAIL"
    # no ceiling: the goal applies to the value itself
    assert Row("5", "hot", 0.05, "calls", goal=Goal("<=", 0.05)).verdict == "pass"
    assert Row("5", "hot", 0.051, "calls", goal=Goal("<=", 0.05)).verdict == "FAIL"
    assert Row("6", "beyond", 0, "n", goal=Goal("<=", 0)).verdict == "pass"
    assert Row("6", "util", math.nan, "", goal=Goal(">=", 0.97)).verdict == "FAIL"
    assert Row("7", "info", 3, "keys").verdict == "info"
    with pytest.raises(ValueError):
        Goal("==", 1)


def test_tables_have_every_column_and_row():
    rows = [Row("1", "batch", 12_000.0, "decisions/s", ceiling=60_000.0, ceiling_name="redis-benchmark",
                goal=Goal(">=", 0.4)),
            Row("7", "keys | pools", 201, "keys")]
    text = render_text(rows).splitlines()
    assert text[0].split()[:3] == ["figure", "measure", "value"]
    assert "0.200" in text[2] and "FAIL" in text[2] and "60,000 (redis-benchmark)" in text[2]
    assert text[3].rstrip().endswith("info")
    md = render_markdown(rows).splitlines()
    assert len(md) == 4 and md[1].count("---") == 7
    assert "keys \\| pools" in md[3]  # a pipe in a cell cannot break the Markdown table
    d = rows[0].to_dict()
    assert d["ratio"] == pytest.approx(0.2) and d["verdict"] == "FAIL" and d["goal"] == ">= 0.4"


def test_workload_bodies_are_valid_and_distinct():
    from msgspec import convert

    from region_agent.models import AdmitBatch, AdmitRequest

    items = [convert(admit_item(i, 10_000), AdmitRequest) for i in range(40)]
    assert len({r.request_id for r in items}) == 40
    assert {r.route_group for r in items} == {"read", "write", "login"}
    batch = convert(json.loads(admit_batch(size=100)(3)), AdmitBatch)
    assert len(batch.requests) == 100
    leases = json.loads(lease_batch(pools=10, size=64)(0))["requests"]
    assert len({r["leaseId"] for r in leases}) == 64 and len({r["pool"] for r in leases}) == 10


def test_per_window_counts_only_whole_windows():
    reports = [{"allowed_by_window": {"5": 7, "6": 100, "7": 50}}, {"allowed_by_window": {"6": 90, "8": 1}}]
    # run from 5.5 to 8.5 windows of 1 s: only windows 6 and 7 are whole
    assert per_window(reports, 5.5, 8.5, 1000) == {6: 190, 7: 50}


def test_figure_6_judges_each_window_with_the_chaos_checkers_check():
    """Per pool, a window whose demand offered to the pool exceeded G must reach 0.97 x G (the chaos
    checker's ``fault_free_utilisation``); demand is what the pool's rule answered, not what the
    generator meant to send; a run in which no window had demand above G shows nothing and fails."""
    def reports(admitted: dict, offered: dict) -> list[dict]:
        return [{"allowed_by_window": {str(k): v for k, v in admitted.items()},
                 "offered_by_window": {str(k): v for k, v in offered.items()}}]

    good = pool_rows("p", "util-g", reports({5: 200, 6: 195, 7: 199}, {5: 290, 6: 301, 7: 260}), 4.5, 8.5, 1000)
    assert (good[0].value, good[0].verdict, good[0].extra["judged_windows"]) == (0, "pass", 3)
    assert good[0].extra["min"] == 0.975 and good[1].value == 0 and "utilisation" in good[0].name
    bad = pool_rows("p", "util-g", reports({5: 200, 6: 132, 7: 199}, {5: 290, 6: 301, 7: 260}), 4.5, 8.5, 1000)
    assert (bad[0].value, bad[0].verdict) == (1, "FAIL") and "window 6: admitted 132" in bad[0].extra["shortfalls"][0]
    thin = pool_rows("p", "util-g", reports({5: 150, 6: 150}, {5: 160, 6: 180}), 4.5, 7.5, 1000)
    assert thin[0].extra["judged_windows"] == 0 and thin[0].verdict == "FAIL"  # nothing shown
    over = pool_rows("p", "util-g", reports({5: 230}, {5: 300}), 4.5, 6.5, 1000)
    assert over[1].value == 10 and over[1].verdict == "FAIL"  # beyond G + 2 x 10


def test_figure_6_bundle_has_a_tenant_and_a_global_scope_pool():
    from bench.fig_util import util_bundle
    from kernel.bundle import select_rules

    b = util_bundle(2_000)  # validated as it is built
    assert {p.id for p in b.pools} == {"util", "util-g"}
    search = select_rules(b.rules, tenant="g3", route_group="search", principal_type="service", has_key=False)
    assert [(r.scope, r.pool_id) for r in search] == [("global", "util-g")]  # every tenant's search: the fleet pool
    write = select_rules(b.rules, tenant="t0", route_group="write", principal_type="service", has_key=False)
    assert [(r.scope, r.pool_id) for r in write] == [("tenant", "util")]


def test_global_admit_workload_spends_the_global_pool_from_many_tenants():
    from msgspec import convert

    from bench.workloads import WORKLOADS
    from region_agent.models import AdmitRequest

    body = WORKLOADS["global_admit"](tenants=10, tag="g")
    items = [convert(json.loads(body(i)), AdmitRequest) for i in range(20)]
    assert {r.route_group for r in items} == {"search"} and len({r.tenant_id for r in items}) == 10


def test_only_option():
    assert parse_only(None) == ["1", "2", "3", "4", "5", "6", "7", "8", "redis", "hotchunk"]  # "shards" only when named
    assert parse_only(["fig2,1", "2"]) == ["1", "2"]
    assert parse_only(["redis"]) == ["redis"]
    with pytest.raises(ValueError, match="unknown figure '9'"):
        parse_only(["9"])


def test_bounds_name_the_saturated_process():
    from bench.bounds import explain

    row = Row("1", "batch", 12_000, "decisions/s", ceiling=60_000, goal=Goal(">=", 0.4), extra={
        "cpu_us_per_decision": [{"agent": 80.0, "redis": 9.0}] * 3,
        "cpu_utilisation": [{"agent": 0.97, "redis": 0.3}] * 3,
        "ceiling_redis_cpu_us_per_call": [6.0, 6.5, 7.0], "allowed_share": [0.5, 0.5, 0.5]})
    hot = Row("5", "hot", 0.01, "calls/attempt", extra={"redis_calls": 50, "attempts": 5000, "admitted": 4})
    notes = explain([row, hot])
    assert "Bound by agent CPU" in notes[0] and "80.0 us" in notes[0] and "6.5 us" in notes[0]
    assert notes[1].startswith("Figure 5: 50 script calls for 5000 attempts")
