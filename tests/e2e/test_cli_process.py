"""The ``leasehold`` command as an operator runs it (the installed console script, as a
subprocess): ``up``, ``status`` (text and JSON, the real URLs, exit codes for a healthy, a broken
and a stopped topology), ``admit`` and ``leases`` through the URLs ``status`` printed, ``down``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def leasehold(run_dir: Path, *argv: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("leasehold")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "leasehold.commands.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([*cmd, "--run-dir", str(run_dir), *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)


def status_json(run_dir: Path) -> tuple[int, dict]:
    res = leasehold(run_dir, "status", "-o", "json", timeout=60)
    assert "Traceback" not in res.stderr
    return res.returncode, json.loads(res.stdout)


def test_up_status_admit_leases_down(tmp_path: Path):
    run = tmp_path / "run"
    code, doc = status_json(run)
    assert code == 6 and doc["running"] is False and doc["error"]["kind"] == "not-running"

    up = leasehold(run, "up", "--regions", "eu", "--allocators", "1", "-o", "json")
    try:
        assert up.returncode == 0, up.stderr
        started = json.loads(up.stdout)
        assert started["urls"]["agents"]["eu"] and started["auth"] is True
        for _ in range(100):  # bounded: the agent's first leases before it says ready
            code, doc = status_json(run)
            if code == 0:
                break
            time.sleep(0.2)
        assert code == 0 and doc["healthy"] is True, doc
        assert {s["kind"] for s in doc["services"]} == {"etcd", "allocator", "redis", "agent"}
        assert all(s["state"] == "ready" for s in doc["services"])
        agent = doc["urls"]["agents"]["eu"][0]
        assert agent == started["urls"]["agents"]["eu"][0] and agent.startswith("http://127.0.0.1:")
        # the URLs and the token file status printed are what a client uses
        token = Path(doc["tokenFiles"]["gateway"]).read_text().strip()
        r = httpx.post(agent + "/v1/admit", headers={"authorization": f"Bearer {token}"}, timeout=5, json={
            "requestId": "cli-e2e-00001", "tenantId": "atlas", "principal": {"type": "user", "id": "U-5"},
            "routeGroup": "read", "method": "GET", "costHint": 1})
        assert r.status_code == 200 and r.json()["allowed"] is True, r.text
        assert httpx.get(doc["urls"]["allocators"][0] + "/readyz", timeout=5).status_code == 200

        text = leasehold(run, "status")
        assert text.returncode == 0 and "all services ready" in text.stdout and agent in text.stdout

        for _ in range(20):  # bounded: a global pool's first chunk may still be on its way (a 429, exit 3)
            admit = leasehold(run, "admit", "--region", "eu", "--principal", "U-6", "-o", "json")
            decision = json.loads(admit.stdout)
            assert admit.returncode == (0 if decision["allowed"] else 3), (admit.returncode, decision)
            if admit.returncode == 0:
                break
            time.sleep(0.2)
        assert admit.returncode == 0 and decision["httpStatus"] == 200
        admit = leasehold(run, "admit", "--region", "eu", "--principal", "U-6")
        assert admit.returncode in (0, 3) and admit.stdout.startswith(("allowed: HTTP 200", "denied: HTTP 429"))
        # a question the agent refuses (422): its detail once, the answer's problem in the JSON document
        # (was "the agent answered 422: Request failed validation request failed validation: costHint: ...")
        # (a cost out of range is the CLI's own usage error now: a tenant id is checked by the agent alone)
        bad = leasehold(run, "admit", "--region", "eu", "--tenant", "ATLAS")
        assert bad.returncode == 2 and bad.stdout == "", bad
        (line,) = bad.stderr.splitlines()
        assert line.startswith("leasehold: the agent answered 422: request failed validation: tenantId: "), line
        assert "request failed validation" not in line[len("leasehold: the agent answered 422: request failed validation"):]
        bad = leasehold(run, "admit", "--region", "eu", "--tenant", "ATLAS", "-o", "json")
        assert bad.returncode == 2 and json.loads(bad.stdout)["problem"]["status"] == 422
        leases = leasehold(run, "leases", "-o", "json")
        assert leases.returncode == 0, leases.stderr
        assert json.loads(leases.stdout)["leader"]["nodeId"] == "alloc-1"

        # an agent process gone: status says which and exits 5
        (agent_svc,) = [s for s in doc["services"] if s["kind"] == "agent"]
        os.kill(agent_svc["pid"], signal.SIGKILL)
        for _ in range(50):
            code, broken = status_json(run)
            if code == 5:
                break
            time.sleep(0.1)
        assert code == 5 and broken["healthy"] is False
        assert {s["name"]: s["state"] for s in broken["services"]}[agent_svc["name"]] == "exited"
        text = leasehold(run, "status")
        assert text.returncode == 5 and f"{agent_svc['name']} exited" in text.stdout
        admit = leasehold(run, "admit", "--region", "eu", "-o", "json")
        assert admit.returncode == 5 and json.loads(admit.stdout)["error"]["kind"] == "connect"
        assert admit.stderr.startswith("leasehold: cannot reach the agent at ")
    finally:
        down = leasehold(run, "down", "-o", "json")
    assert down.returncode == 0 and len(json.loads(down.stdout)["stopped"]) >= 3
    assert status_json(run)[0] == 6


def test_policy_authoring_bad_input_is_a_message_and_exit_2_never_a_traceback(tmp_path: Path):
    """A careless or hostile policy file through the real process: each is one ``leasehold:`` line
    on stderr and exit 2, quickly, and a failed compile leaves the previous bundle whole."""
    run = tmp_path / "run"
    sample = (ROOT / "policies" / "northstar.yaml").read_text()
    rows = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    rows += [f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi", strict=True)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("version: 1\npublishedAt: x\n" + "\n".join(rows) + "\nrules: []\n")  # 9^9 values expanded
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(sample.encode() + b"# caf\xe9\n")
    good = tmp_path / "good.yaml"
    good.write_text(sample)
    old = tmp_path / "good.json"
    old.write_bytes(b"the previous bundle\n")
    typo = tmp_path / "typo.yaml"
    typo.write_text(sample.replace("failMode: closed", "failMode: strict", 1))
    cases = [(["policy", "compile", str(bomb)], "a YAML alias"),
             (["policy", "validate", str(typo)], "failMode 'strict' is not one of"),
             (["up", "--policy", str(good)], f"not a sealed bundle (JSON): compile it first with `leasehold policy "
                                            f"compile {good}`"),
             (["policy", "fmt", str(latin)], "not UTF-8 (byte 0xe9)"),
             (["policy", "compile", str(good), "--out", str(tmp_path / "no-dir" / "b.json")], "cannot write"),
             (["policy", "compile", str(good), "--out", str(tmp_path)], "cannot write")]
    for argv, needle in cases:
        started = time.monotonic()
        res = leasehold(run, *argv, timeout=60)
        assert res.returncode == 2, (argv, res.stderr)
        assert "Traceback" not in res.stderr and res.stderr.startswith("leasehold: ") and needle in res.stderr, argv
        assert time.monotonic() - started < 30, argv
    assert old.read_bytes() == b"the previous bundle\n"


def test_a_hostile_bundle_file_is_one_line_and_exit_2(tmp_path: Path):
    """Bundle files an attacker (or an editor) can hand the tooling, through the real process: brackets
    nested thousands deep (was exit 70, "unexpected error: RecursionError"), a key said twice with the
    sealed value last (was valid: the reader sees the first value, the services enforce the last), a
    byte order mark (was "invalid character (byte 0)"). A signature validate does not check is said so
    (was "signed by key ..." alike for a stale one)."""
    run = tmp_path / "run"
    sample = (ROOT / "policies" / "northstar.json").read_bytes()
    deep = tmp_path / "deep.json"
    deep.write_bytes(b"[" * 5000 + b"]" * 5000)
    twice = tmp_path / "twice.json"
    twice.write_bytes(sample.replace(b'"capacityMillis": 20000,', b'"capacityMillis": 1, "capacityMillis": 20000,', 1))
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + sample)
    cases = [(["policy", "validate", str(deep)], "nested too deeply"),
             (["policy", "seal", str(deep)], "nested too deeply"),
             (["policy", "publish", str(deep)], "nested too deeply"),
             (["policy", "validate", str(twice)], "repeats the key 'capacityMillis' in one object"),
             (["policy", "publish", str(twice)], "repeats the key 'capacityMillis' in one object"),
             (["policy", "seal", str(twice)], "repeats the key 'capacityMillis' in one object"),
             (["policy", "validate", str(bom)], "starts with a UTF-8 byte order mark")]
    for argv, needle in cases:
        res = leasehold(run, *argv, timeout=60)
        assert res.returncode == 2, (argv, res.returncode, res.stderr)
        assert "Traceback" not in res.stderr and res.stderr.startswith("leasehold: ") and needle in res.stderr, argv
        assert len(res.stderr.splitlines()) == 1 and res.stdout == "", (argv, res.stderr)
    assert twice.read_bytes().count(b'"capacityMillis": 1,') == 1  # seal refused: the file is as it was
    keys = tmp_path / "keys"
    assert leasehold(run, "policy", "keygen", str(keys)).returncode == 0
    signed = tmp_path / "signed.json"
    assert leasehold(run, "policy", "sign", str(ROOT / "policies" / "northstar.json"), "--key",
                     str(keys / "policy-signing.key"), "--out", str(signed)).returncode == 0
    stale = tmp_path / "stale.json"
    stale.write_bytes(signed.read_bytes().replace(b'"bundleVersion": 42', b'"bundleVersion": 43', 1))
    res = leasehold(run, "policy", "validate", str(stale))
    assert res.returncode == 0 and "(signature not checked: --public-keys checks it)" in res.stdout, res
    res = leasehold(run, "policy", "validate", str(stale), "--public-keys", str(keys / "policy-signing.pub"))
    assert res.returncode == 2 and "does not verify" in res.stderr and "Traceback" not in res.stderr, res
