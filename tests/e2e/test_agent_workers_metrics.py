"""An agent with ``--workers 2`` exports one consistent set of series: whichever worker answers a
scrape, the decision counters add up to the decisions both workers made, and the connections
refused at the HTTP cap to those both workers refused (prometheus_client's multiprocess mode,
kernel.metrics_exposition)."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import time
from pathlib import Path

import httpx
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from devtools.metrics_doc import all_rows
from leasehold.local.procs import Proc, RedisServer, free_port, wait_port
from leasehold.local.services import agent_command

ROOT = Path(__file__).resolve().parents[2]
NORTHSTAR = ROOT / "policies" / "northstar.json"


def _sums(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _decisions_by_worker(path: Path) -> dict[int, float]:
    """Per worker pid: the decisions its own metrics file counted."""
    out: dict[int, float] = {}
    for f in path.glob("counter_*.db"):
        pid = int(f.stem.rsplit("_", 1)[-1])
        for key, value, *_ in MmapedDict.read_all_values_from_file(str(f)):
            if '"leasehold_agent_decisions_total"' in key:
                out[pid] = out.get(pid, 0.0) + value
    return out


def test_two_workers_metrics_add_up_to_the_decisions_made(tmp_path: Path, redis_url: str):
    policy = tmp_path / "policy.json"
    policy.write_bytes(NORTHSTAR.read_bytes())
    files = tmp_path / "metrics"
    files.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
    env |= {"PYTHONPATH": str(ROOT), "PROMETHEUS_MULTIPROC_DIR": str(files)}
    proc = Proc("agent", agent_command(redis_url=redis_url, policy=policy, region="eu", host="127.0.0.1", port=port,
                                       policy_poll_ms=0, insecure_dev_pepper=True, auth_disabled=True, workers=2),
                tmp_path / "agent", env=env).start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_port(port, proc=proc.popen, timeout=30)
        made = 0
        # new connections until both workers have decided some (bounded)
        for batch in range(20):
            for i in range(50):
                with httpx.Client(timeout=10) as c:  # one connection per request: the kernel spreads them
                    r = c.post(base + "/v1/admit", json={
                        "requestId": f"workers-{batch:03d}-{i:03d}", "tenantId": "birch",
                        "principal": {"type": "user", "id": f"B-{i}"}, "routeGroup": "read"})
                    assert r.status_code == 200, r.text
                    made += 1
            time.sleep(1.2)  # every worker moves its counts into its file at least once a second
            if len([n for n in _decisions_by_worker(files).values() if n > 0]) >= 2:
                break
        per_worker = _decisions_by_worker(files)
        assert len([n for n in per_worker.values() if n > 0]) == 2, per_worker

        deadline = time.monotonic() + 15
        while True:
            sums = _sums(httpx.get(base + "/metrics", timeout=5).text)
            if sums.get("leasehold_agent_decisions_total") == made or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        seen = []
        documented = {r.name for r in all_rows()}
        for _ in range(12):  # scrapes land on either worker: each shows both workers' counts
            text = httpx.get(base + "/metrics", timeout=5).text
            sums = _sums(text)
            seen.append((sums.get("leasehold_agent_decisions_total"), sums.get("leasehold_agent_decision_seconds_count")))
            assert 'pid="' not in text  # every gauge declares how workers combine: no per-pid series
            assert not [n for n in re.findall(r"^# TYPE (leasehold_\S+)", text, re.M)
                        if n not in documented and n + "_total" not in documented]  # docs/metrics.md
            assert sums.get("process_resident_memory_bytes", 0) > 0 and sums.get("leasehold_build_info") == 1
            assert sums.get("python_info") == 1  # docs/metrics.md: exported with several workers too
        assert set(seen) == {(made, made)}, (made, per_worker, seen)
        assert sum(per_worker.values()) <= made
    finally:
        proc.stop()


def _gauge_by_worker(path: Path, name: str) -> dict[int, float]:
    """Per worker pid: the value of the live-mode gauge ``name`` in its own file."""
    out: dict[int, float] = {}
    for f in path.glob("gauge_live*_*.db"):
        pid = int(f.stem.rsplit("_", 1)[-1])
        for key, value, *_ in MmapedDict.read_all_values_from_file(str(f)):
            if f'"{name}"' in key:
                out[pid] = max(out.get(pid, 0.0), value)
    return out


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def test_a_killed_workers_gauges_leave_the_exposition(tmp_path: Path):
    """A worker killed while its Redis breaker was open (SIGKILL: no exit code runs; uvicorn starts
    another) no longer holds leasehold_agent_breaker_state at 2 once the living workers' breakers
    have closed: its live-mode gauge file stayed, and LeaseholdBreakerOpen fired for ever."""
    redis = RedisServer(tmp_path / "redis").start()
    files = tmp_path / "metrics"
    files.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
    env |= {"PYTHONPATH": str(ROOT), "PROMETHEUS_MULTIPROC_DIR": str(files)}
    proc = Proc("agent", agent_command(redis_url=redis.url, policy=NORTHSTAR, region="eu", host="127.0.0.1",
                                       port=port, policy_poll_ms=0, insecure_dev_pepper=True, auth_disabled=True,
                                       workers=2), tmp_path / "agent", env=env).start()
    base = f"http://127.0.0.1:{port}"
    name = "leasehold_agent_breaker_state"

    def admit_until(pred, what: str, timeout: float = 45.0) -> None:
        deadline, i = time.monotonic() + timeout, 0
        while not pred():
            assert time.monotonic() < deadline, f"{what}: {_gauge_by_worker(files, name)}"
            for _ in range(10):
                i += 1
                with httpx.Client(timeout=10) as c:  # one connection per request: the kernel spreads them
                    c.post(base + "/v1/admit", json={"requestId": f"killed-{i:06d}", "tenantId": "birch",
                                                     "principal": {"type": "user", "id": f"B-{i}"},
                                                     "routeGroup": "read"})
            time.sleep(0.2)

    def live_states() -> dict[int, float]:
        return {pid: v for pid, v in _gauge_by_worker(files, name).items() if _alive(pid)}

    try:
        wait_port(port, proc=proc.popen, timeout=30)
        redis.stop()
        admit_until(lambda: len([v for v in live_states().values() if v == 2]) >= 2, "both breakers open")
        victim = next(pid for pid, v in live_states().items() if v == 2)
        os.kill(victim, signal.SIGKILL)
        redis.start()
        admit_until(lambda: not _alive(victim) and len(live_states()) >= 2 and set(live_states().values()) == {0},
                    "the living workers' breakers closed")
        for _ in range(6):  # scrapes land on either worker
            samples = [s for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=5).text)
                       for s in fam.samples if s.name == name]
            assert samples and all(s.value == 0 for s in samples), samples
    finally:
        proc.stop()
        redis.stop()


def test_two_workers_refused_connections_add_up_and_the_fullest_worker_is_at_its_cap(tmp_path: Path, redis_url: str):
    """Each worker holds its own ``--http-max-connections``: idle connections past what both hold
    are refused by whichever worker accepts them. The worker that answers the scrape (on a
    connection opened before) exports both workers' refused count (each moves its own into the
    shared files) and the fullest worker's open connections, at its cap (a worker refuses only
    there)."""
    cap = 16
    files = tmp_path / "metrics"
    files.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
    env |= {"PYTHONPATH": str(ROOT), "PROMETHEUS_MULTIPROC_DIR": str(files),
            "LEASEHOLD_AGENT_HTTP_MAX_CONNECTIONS": str(cap)}
    proc = Proc("agent", agent_command(redis_url=redis_url, policy=NORTHSTAR, region="eu", host="127.0.0.1", port=port,
                                       policy_poll_ms=0, insecure_dev_pepper=True, auth_disabled=True, workers=2),
                tmp_path / "agent", env=env).start()
    base = f"http://127.0.0.1:{port}"
    held: list[socket.socket] = []
    try:
        wait_port(port, proc=proc.popen, timeout=30)
        with httpx.Client(base_url=base, timeout=10) as client:  # open before: its scrapes are answered
            sums = _sums(client.get("/metrics").text)
            assert sums["leasehold_agent_http_max_connections"] == cap
            assert sums["leasehold_agent_http_refused_connections_total"] == 0
            for _ in range(4 * cap):  # bounded, loopback only
                held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            # the workers accept and refuse as they get to it (later on a loaded machine), and each
            # moves its values into its file at least once a second: the refusals are counted as
            # they come until the scrape agrees with them, bounded well inside the 10 s head
            # timeout (after it, the held connections would be answered 408 and closed too)
            deadline = time.monotonic() + 7
            pending, refused = list(held), 0
            while True:
                readable, _, _ = select.select(pending, [], [], 0.3)
                for s in readable:  # answered 503 and closed: read to the end
                    s.settimeout(5)
                    while s.recv(65536):
                        pass
                    pending.remove(s)
                refused += len(readable)
                x = _sums(client.get("/metrics").text)
                got = (x["leasehold_agent_http_refused_connections_total"], x["leasehold_agent_http_connections"])
                if (got == (refused, cap) and refused > cap) or time.monotonic() > deadline:
                    break
            assert cap < refused < 4 * cap, refused  # both workers together hold at most twice the cap
            assert got == (refused, cap), (refused, got, _gauge_by_worker(files, "leasehold_agent_http_connections"))
    finally:
        for s in held:
            s.close()
        proc.stop()
