"""docs/metrics.md is generated from the metric objects the services create; the dashboard and the
alert rules name only metrics and labels of that table."""

from __future__ import annotations

import pytest

from devtools import metrics_doc
from devtools.deploy_check import Query, alert_queries, check_all, dashboard_queries, problems
from devtools.metrics_doc import BOUNDS, all_rows


def test_the_table_matches_the_code():
    assert metrics_doc.main(["--check"]) == 0, "run: python -m devtools.metrics_doc"


def test_every_metric_has_a_stated_series_bound_and_no_unbounded_label():
    rows = all_rows()
    assert len(rows) >= 60
    assert not [r.name for r in rows if not r.bound], "add the metric's bound to devtools.metrics_doc.BOUNDS"
    assert not set(BOUNDS) - {r.name for r in rows}, "BOUNDS names a metric the code no longer has"
    forbidden = {"principal", "user", "key", "api_key", "ip", "address", "request_id", "lease_id"}
    assert not [(r.name, r.labels) for r in rows if forbidden & set(r.labels)]


def test_dashboard_and_alerts_name_only_metrics_and_labels_of_the_table():
    assert check_all() == []
    panels = dashboard_queries()
    assert len(panels) >= 20 and all(qs for _, qs in panels)
    assert len(alert_queries()) >= 20


def test_the_checker_catches_unknown_metrics_and_labels():
    table = {r.name: r for r in all_rows()}
    assert problems(Query("q", "rate(leasehold_agent_nope_total[1m])"), table)
    assert problems(Query("q", 'sum by (principal) (rate(leasehold_agent_decisions_total[1m]))'), table)
    assert problems(Query("q", 'leasehold_agent_decisions_total{user="x"}'), table)
    assert problems(Query("q", "leasehold_agent_policy_version", ("{{ $labels.tenant }}",)), table)
    assert not problems(Query("q", 'histogram_quantile(0.99, sum by (le, shard) '
                                   '(rate(leasehold_agent_decision_seconds_bucket[1m])))', ("{{shard}}",)), table)


def test_alerts_required_by_the_issue_exist():
    names = {q.where.removeprefix("alert ") for q in alert_queries()}
    assert {"LeaseholdFallbackShareHigh", "LeaseholdBreakerOpen", "LeaseholdLeaseRenewalFailures",
            "LeaseholdAllocatorLeaderChanges", "LeaseholdGrantsNearG", "LeaseholdPolicySignatureRefused",
            "LeaseholdPolicyRefused"} <= names


def test_only_no_option_writes_a_typo_or_help_writes_nothing(tmp_path, monkeypatch, capsys):
    """`--chek` (a typo of the check a CI runs) and `--help` rewrote docs/metrics.md and exited 0."""
    doc = tmp_path / "metrics.md"
    doc.write_text("stale\n")
    monkeypatch.setattr(metrics_doc, "DOC", doc)
    for argv, code in ((["--chek"], 2), (["--help"], 0)):
        with pytest.raises(SystemExit) as e:
            metrics_doc.main(argv)
        assert e.value.code == code
        assert doc.read_text() == "stale\n"
    assert metrics_doc.main(["--check"]) == 1 and doc.read_text() == "stale\n"
    assert metrics_doc.main([]) == 0 and doc.read_text() == metrics_doc.render(all_rows())
