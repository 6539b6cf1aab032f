"""The shipped Prometheus configuration (``deploy/prometheus/prometheus.yml``) with its targets
filled in for a local topology (``leasehold up``): the same jobs and labels, the allocators'
and each region's agents' addresses, optionally other scrape and evaluation intervals, and the
rule file's path. Used by the end-to-end test that runs a real Prometheus
(``tests/e2e/test_prometheus.py``) and by hand:

    python -m leasehold.local.prometheus_config > prometheus.yml   # for the running `leasehold up`
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
SHIPPED = DEPLOY / "prometheus.yml"
RULES = DEPLOY / "alerts.yml"
ALLOCATOR_JOB, AGENT_JOB = "leasehold-allocator", "leasehold-agent"


def _hostport(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/")


def render(allocator_urls: list[str], agent_urls: dict[str, list[str]], *, scrape_interval: str | None = None,
           evaluation_interval: str | None = None, rules: Path = RULES) -> dict[str, Any]:
    """The shipped document with these targets (a region's agents under one ``region`` label)."""
    import yaml

    doc = yaml.safe_load(SHIPPED.read_text())
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    if set(jobs) != {ALLOCATOR_JOB, AGENT_JOB}:
        raise ValueError(f"{SHIPPED}: expected the jobs {ALLOCATOR_JOB} and {AGENT_JOB}, found {sorted(jobs)}")
    shipped_agents = jobs[AGENT_JOB]["static_configs"]
    if not all(set(c.get("labels", {})) == {"region"} for c in shipped_agents):
        raise ValueError(f"{SHIPPED}: every agent target group must carry exactly the region label")
    jobs[ALLOCATOR_JOB]["static_configs"] = [{"targets": [_hostport(u) for u in allocator_urls]}]
    jobs[AGENT_JOB]["static_configs"] = [{"targets": [_hostport(u) for u in urls], "labels": {"region": region}}
                                         for region, urls in agent_urls.items()]
    if scrape_interval:
        doc["global"]["scrape_interval"] = scrape_interval
    if evaluation_interval:
        doc["global"]["evaluation_interval"] = evaluation_interval
    doc["rule_files"] = [str(rules)]
    return doc


def main(argv: list[str] | None = None) -> int:
    import yaml

    from .topology import default_run_dir, read_state

    state = read_state(default_run_dir())
    if state is None:
        print("no running topology (start one with `leasehold up`)", file=sys.stderr)
        return 1
    allocators = [s["url"] for s in state["services"] if s["kind"] == "allocator"]
    agents: dict[str, list[str]] = {}
    for s in state["services"]:
        if s["kind"] == "agent":
            agents.setdefault(s["region"], []).append(s["url"])
    print(yaml.safe_dump(render(allocators, agents), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
