"""deploy/prometheus/alerts.yml under Prometheus' own rule checker and unit tester (Debian's
``promtool``, installed by ``make``): ``promtool check rules`` on the shipped file, and
``promtool test rules`` on the cases of ``alert_cases.yml`` — every alert fires on the failure it
names and is silent on a healthy fleet running the sample bundle (global-read at its full
40,000 a second included). Every alert links a section of docs/runbooks.md."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
CASES = Path(__file__).with_name("alert_cases.yml")
RUNBOOKS = ROOT / "docs" / "runbooks.md"
RUNBOOK_BASE = "https://leasehold.dev/docs/runbooks#"
TARGETS = {
    "$EU": 'instance="agent-eu:8080",job="leasehold-agent",region="eu"',
    "$US": 'instance="agent-us:8080",job="leasehold-agent",region="us"',
    "$A1": 'instance="allocator-1:8080",job="leasehold-allocator"',
    "$A2": 'instance="allocator-2:8080",job="leasehold-allocator"',
}
LABEL_REF = re.compile(r"\{\{\s*\$labels\.([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: `make setup` installs Debian's prometheus package"
    return path


def rules() -> dict[str, dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"]}


def _series(pairs: list[list[str]]) -> list[dict]:
    out = []
    for name, values in pairs:
        for short, labels in TARGETS.items():
            name = name.replace(short, labels)
        out.append({"series": name, "values": values})
    return out


def _expected(rule: dict, labels: dict) -> dict:
    """promtool's expected alert: the labels, and the rule's annotations rendered with them (the
    rules' templates only reference ``$labels``)."""
    labels = {k: str(v) for k, v in labels.items()}
    notes = {k: LABEL_REF.sub(lambda m: labels.get(m.group(1), ""), str(v))
             for k, v in (rule.get("annotations") or {}).items()}
    return {"exp_labels": labels, "exp_annotations": notes}


def promtool_tests(cases: dict | None = None) -> dict:
    """The ``promtool test rules`` document for ``cases`` (default: alert_cases.yml)."""
    cases = cases or yaml.safe_load(CASES.read_text())
    by_name = rules()
    groups = []
    healthy = cases["healthy"]
    every = sorted(by_name)
    silent_all = [{"eval_time": t, "alertname": a, "exp_alerts": []} for t in cases["healthy_eval"] for a in every]
    groups.append({"name": "healthy fleet: every alert silent", "interval": healthy["interval"],
                   "input_series": _series(healthy["series"]), "alert_rule_test": silent_all})
    replaced = {name: values for name, values in cases["full_rate"]["replace"]}
    full = [[name, replaced.get(name, values)] for name, values in healthy["series"]]
    assert len(replaced) and all(any(n == name for n, _ in healthy["series"]) for name in replaced)
    groups.append({"name": "healthy fleet, global-read at its full rate: every alert silent",
                   "interval": healthy["interval"], "input_series": _series(full), "alert_rule_test": silent_all})
    for case in cases["cases"]:
        name = case["alert"]
        rule = by_name[name]
        groups.append({"name": f"{name} fires", "interval": case["interval"], "input_series": _series(case["series"]),
                       "alert_rule_test": [{"eval_time": case["at"], "alertname": name,
                                             "exp_alerts": [_expected(rule, lb) for lb in case["fires"]]}]})
        for quiet in case.get("silent", []):
            groups.append({"name": f"{name} silent: {quiet['note']}", "interval": case["interval"],
                           "input_series": _series(quiet.get("series", case["series"])),
                           "alert_rule_test": [{"eval_time": quiet["at"], "alertname": name, "exp_alerts": []}]})
    return {"rule_files": [str(ALERTS)], "evaluation_interval": "15s", "tests": groups}


def run_promtool_tests(doc: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "alerts_test.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=240)


def _alone(alert: str, tmp_path: Path) -> Path:
    """A rules file holding only the shipped rule ``alert``, in its group as shipped (no rule of
    alerts.yml reads another's output: no recording rules, no ``ALERTS``)."""
    doc = yaml.safe_load(ALERTS.read_text())
    groups = [{**g, "rules": [r for r in g["rules"] if r.get("alert") == alert]} for g in doc["groups"]]
    groups = [g for g in groups if g["rules"]]
    assert len(groups) == 1 and len(groups[0]["rules"]) == 1, alert
    path = tmp_path / f"alone_{alert}.yml"
    path.write_text(yaml.safe_dump({**doc, "groups": groups}, sort_keys=False))
    return path


def run_promtool_tests_split(doc: dict, tmp_path: Path) -> list[subprocess.CompletedProcess]:
    """The same test groups as :func:`run_promtool_tests`, in two ``promtool`` processes at once
    (about the same work each: one of the two three-hour healthy-fleet groups and every other
    per-alert case). A healthy-fleet group is run against the whole rule file (every alert is
    checked silent); a per-alert group against its alert's rule alone, as shipped: promtool
    evaluates every rule of its rule files at every step, and the cases' steps (several thousand)
    evaluating all the others' rules, unchecked, were four fifths of this test's time."""
    healthy = [g for g in doc["tests"] if g["name"].startswith("healthy")]
    cases = [g for g in doc["tests"] if not g["name"].startswith("healthy")]
    halves = (healthy[0::2] + cases[0::2], healthy[1::2] + cases[1::2])
    procs = []
    for i, groups in enumerate(g for g in halves if g):
        files = []
        by_alert: dict[str, list[dict]] = {}
        for g in groups:
            names = {t["alertname"] for t in g["alert_rule_test"]}
            if g["name"].startswith("healthy"):
                by_alert.setdefault("", []).append(g)
            else:
                assert len(names) == 1, g["name"]
                by_alert.setdefault(names.pop(), []).append(g)
        for alert, tests in by_alert.items():
            path = tmp_path / f"alerts_test_{i}_{alert or 'all'}.yml"
            rule_files = [str(_alone(alert, tmp_path))] if alert else doc["rule_files"]
            path.write_text(yaml.safe_dump({**doc, "rule_files": rule_files, "tests": tests}, sort_keys=False))
            files.append(str(path))
        procs.append(subprocess.Popen([promtool(), "test", "rules", *files], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=240)
        finally:
            p.kill()
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def test_promtool_check_rules_accepts_the_shipped_file():
    res = subprocess.run([promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(rules())} rules found" in res.stdout


def test_every_alert_has_a_firing_case_and_is_checked_silent_on_a_healthy_fleet():
    cases = yaml.safe_load(CASES.read_text())
    firing = {c["alert"] for c in cases["cases"] if c["fires"]}
    assert firing == set(rules()), f"no firing case: {set(rules()) - firing}; unknown: {firing - set(rules())}"
    doc = promtool_tests(cases)
    healthy = [g for g in doc["tests"] if g["name"].startswith("healthy")]
    assert len(healthy) == 2
    for g in healthy:
        assert {t["alertname"] for t in g["alert_rule_test"]} == set(rules())


def test_promtool_unit_tests_pass(tmp_path):
    doc = promtool_tests()
    runs = run_promtool_tests_split(doc, tmp_path)
    for res in runs:
        assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
        assert "SUCCESS" in res.stdout
    assert len(runs) == 2


def test_promtool_unit_tests_can_fail(tmp_path):
    """The harness notices a wrong expectation: the breaker case expected silent, and a healthy
    fleet expected to fire (only those groups are run)."""
    cases = yaml.safe_load(CASES.read_text())
    for case in cases["cases"]:
        if case["alert"] == "LeaseholdBreakerOpen":
            case["fires"] = []
    doc = promtool_tests(cases)
    doc["tests"] = [g for g in doc["tests"] if g["name"] == "LeaseholdBreakerOpen fires"]
    res = run_promtool_tests(doc, tmp_path)
    assert res.returncode != 0 and "LeaseholdBreakerOpen" in res.stdout + res.stderr
    doc = promtool_tests()
    healthy = doc["tests"][0]
    healthy["alert_rule_test"] = [{"eval_time": "1h", "alertname": "LeaseholdBreakerOpen",
                                   "exp_alerts": [{"exp_labels": {"severity": "critical"}}]}]
    doc["tests"] = [healthy]
    res = run_promtool_tests(doc, tmp_path)
    assert res.returncode != 0 and "LeaseholdBreakerOpen" in res.stdout + res.stderr
    # the split run of test_promtool_unit_tests_pass notices a failing group in either process
    doc = promtool_tests(cases)
    healthy["alert_rule_test"][0]["eval_time"] = "5m"
    breaker = next(g for g in doc["tests"] if g["name"] == "LeaseholdBreakerOpen fires")
    passing = next(g for g in doc["tests"] if g["name"].endswith(" fires") and g is not breaker)
    doc["tests"] = [healthy, passing, breaker]  # halves: healthy + passing, breaker
    runs = run_promtool_tests_split(doc, tmp_path)
    assert len(runs) == 2 and all(r.returncode != 0 and "LeaseholdBreakerOpen" in r.stdout + r.stderr for r in runs)


def _anchors(markdown: str) -> set[str]:
    """GitHub-style heading anchors."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_every_alert_has_a_runbook_section():
    anchors = _anchors(RUNBOOKS.read_text())
    for name, rule in rules().items():
        url = (rule.get("annotations") or {}).get("runbook_url", "")
        assert url == RUNBOOK_BASE + name.lower(), f"{name}: runbook_url {url!r}"
        assert name.lower() in anchors, f"docs/runbooks.md has no section {name}"
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name


@pytest.mark.parametrize("name", ["LeaseholdOvershootEstimate"])
def test_the_overshoot_alert_compares_per_pool_window(name):
    """The window length is part of the expression (a fixed one-minute increase against G + 2F fired
    for the 1 s pool whenever it passed ~800 tokens a second)."""
    expr = rules()[name]["expr"]
    assert "leasehold_allocator_pool_window_seconds" in expr and "increase(" not in expr
