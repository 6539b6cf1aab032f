"""Each class of bad setting, through the services' real entry points (``python -m region_agent``,
``python -m allocator`` as subprocesses): exit status 2, one line on stderr that names the option
and what is valid, never a traceback, nothing started; a refused bundle says each problem once. And
``--help`` gives every option's meaning and default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from leasehold.local.procs import make_tls

ROOT = Path(__file__).resolve().parents[2]


def run(module: str, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_")}
    base["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", module, *argv], env={**base, **(env or {})}, capture_output=True,
                          text=True, timeout=60)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("options")
    tls = make_tls(d / "tls")
    junk = d / "junk.pem"
    junk.write_text("not pem\n")
    return {"ca": str(tls.ca), "cert": str(tls.cert), "key": str(tls.key), "junk": str(junk), "dir": str(d)}


AGENT_BASE = ("--insecure-dev-pepper", "--redis-url", "redis://127.0.0.1:1/0", "--port", "0")

# (argv or env, what the one stderr line must contain)
AGENT_CASES = [
    (["--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["--port", "eighty"], "invalid value 'eighty' for --port: expected an integer in [0, 65535]"),
    (["--port", "70000"], "invalid value '70000' for --port: expected an integer in [0, 65535]"),
    (["--log-level", "verbose"], "invalid value 'verbose' for --log-level: expected one of: debug, info, warning, error"),
    (["--region", "EU!"], "invalid value 'EU!' for --region: expected text matching [a-z0-9-]{1,32}"),
    (["--auth-disabled", "true"], "--auth-disabled is a switch and takes no value (got 'true'): write --auth-disabled"),
    ({"LEASEHOLD_AGENT_AUTH_DISABLED": "yes"},
     "invalid value 'yes' for LEASEHOLD_AGENT_AUTH_DISABLED (--auth-disabled): expected true or false"),
    ({"LEASEHOLD_AGENT_WORKERS": "0"}, "invalid value '0' for LEASEHOLD_AGENT_WORKERS (--workers): expected an integer in [1, 64]"),
    (["--pepper-file", "/nonexistent/pepper"], "invalid value '/nonexistent/pepper' for --pepper-file: no such file"),
    (["--audit-log", "/nonexistent/dir/audit.jsonl"], "for --audit-log: its directory /nonexistent/dir does not exist"),
    (["--redis-url", "http://x:1"], "for --redis-url: expected a URL starting with redis://, rediss://"),
    (["--allocator-urls", "allocator:8700"], "for --allocator-urls: expected a URL starting with http:// or https://"),
    (["--policy-etcd", "etcd-0"], "for --policy-etcd: etcd endpoint 'etcd-0' must be host:port"),
    (["--rls-port", "1", "--rls-host", "999.1.1.1"], "for --rls-host: expected an IP address or a host name"),
    (["--rls-keys", "colour=x"], "'colour=x' is not <field>=<name> with field one of tenant, user"),
    (["--no-auth-disabled", "--gateway-tokens", "edge:nothex"], "invalid --gateway-tokens / --gateway-tokens-file: "
                                                                 "token entries must be <name>:<sha256 hex digest>"),
    (["--no-auth-disabled"], "gateway authentication is on but no gateway token is configured"),
    (["--tls-cert-file", "{cert}"], "--tls-cert-file needs --tls-key-file (or LEASEHOLD_AGENT_TLS_KEY_FILE) as well"),
    (["--tls-cert-file", "{cert}", "--tls-key-file", "{junk}"], "are not a PEM certificate chain and its unencrypted"),
    (["--rls-tls-cert-file", "{cert}", "--rls-tls-key-file", "{key}", "--rls-tls-client-ca-file", "{junk}"],
     "junk.pem is not a PEM CA certificate bundle"),
    (["--policy-etcd", "http://127.0.0.1:2379", "--policy-etcd-ca-file", "{ca}"],
     "etcd endpoints say http:// but TLS files are given"),
    (["--policy-etcd", "127.0.0.1:2379", "--policy-etcd-cert-file", "{cert}"],
     "--policy-etcd-cert-file needs --policy-etcd-key-file"),
    (["--redis-url", "rediss://x:1", "--redis-ca-file", "{junk}"], "invalid --redis-ca-file"),
]

ALLOCATOR_BASE = ("--etcd", "127.0.0.1:2379", "--policy", "b.json", "--node-id", "a1", "--auth-disabled")
ALLOCATOR_CASES = [
    (["--shards", "0"], "invalid value '0' for --shards: expected an integer in [1, 1024]"),
    (["--etcd", "https://a:1,http://b:2"], "etcd endpoints mix http:// and https://"),
    (["--etcd-max-txn-ops", "64"], "invalid value 64 for --etcd-max-txn-ops: below etcd's default of 128"),
    (["--advertise-url", "allocator-1:8700"], "for --advertise-url: expected a URL starting with http:// or https://"),
    (["--etcd-key-file", "{key}"], "--etcd-key-file needs --etcd-cert-file"),
    (["--etcd-ca-file", "{junk}"], "junk.pem is not a PEM CA certificate bundle"),
    (["--policy-from-etcd=false"], "--policy-from-etcd is a switch and takes no value"),
    (["--no-auth-disabled", "--region-tokens", "eu"], "invalid --region-tokens / --region-tokens-file"),
]


def _fill(argv: list[str], files: dict[str, str]) -> list[str]:
    return [a.format(**files) for a in argv]


def _assert_refused(res: subprocess.CompletedProcess[str], prog: str, expected: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr  # one line, not the usage of every option
    assert lines[0].startswith(f"{prog}: ") and expected in lines[0], lines[0]
    assert res.stdout == ""


@pytest.mark.parametrize("case,expected", AGENT_CASES, ids=[c[1][:40] for c in AGENT_CASES])
def test_agent_refuses_bad_settings(case, expected: str, files: dict[str, str]):
    if isinstance(case, dict):
        res = run("region_agent", *AGENT_BASE, env=case)
    else:
        res = run("region_agent", *AGENT_BASE, *_fill(case, files))
    _assert_refused(res, "region_agent", expected)


@pytest.mark.parametrize("case,expected", ALLOCATOR_CASES, ids=[c[1][:40] for c in ALLOCATOR_CASES])
def test_allocator_refuses_bad_settings(case, expected: str, files: dict[str, str]):
    _assert_refused(run("allocator", *ALLOCATOR_BASE, *_fill(case, files)), "allocator", expected)


def test_allocator_names_missing_required_settings():
    res = run("allocator", "--policy", "b.json")
    _assert_refused(res, "allocator", "missing required settings --etcd (or LEASEHOLD_ALLOCATOR_ETCD)")
    assert "--node-id (or LEASEHOLD_ALLOCATOR_NODE_ID)" in res.stderr


@pytest.fixture(scope="module")
def bad_bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list[str]]]:
    """name -> (bundle file, the problems its refusal must say, each once)."""
    d = tmp_path_factory.mktemp("bundles")
    doc = json.loads((ROOT / "policies" / "northstar.json").read_text())
    twice = json.loads(json.dumps(doc))
    twice["rules"][1]["id"] = twice["rules"][0]["id"]  # and so its checksum no longer matches: 2 problems
    unsealed = {**doc, "checksum": "sha256:" + "0" * 64}
    out = {}
    for name, text, problems in (
            ("not-json", "{not json", ["object keys must be strings"]),
            ("schema", json.dumps({"bundleVersion": 1}), ["missing required field `publishedAt`"]),
            ("checksum", json.dumps(unsealed), ["checksum mismatch"]),
            ("two-problems", json.dumps(twice), ["checksum mismatch", "rule id 'read-user-v3' is used twice"])):
        (d / f"{name}.json").write_text(text)
        out[name] = (str(d / f"{name}.json"), problems)
    return out


@pytest.mark.parametrize("module", ["region_agent", "allocator"])
@pytest.mark.parametrize("name", ["not-json", "schema", "checksum", "two-problems"])
def test_a_refused_bundle_says_each_problem_once(module: str, name: str, bad_bundles):
    """A bundle with one problem was refused in two lines, the problem said twice (the refusal's
    line, then the same problem as a list item); now one line, and a list item only for a problem the
    line does not say. The allocator's line also says it refuses to start, as its other refusals do."""
    path, problems = bad_bundles[name]
    base = (*AGENT_BASE, "--auth-disabled") if module == "region_agent" else ALLOCATOR_BASE
    res = run(module, *base, "--policy", path)
    assert res.returncode == 2 and "Traceback" not in res.stderr and res.stdout == "", res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith(f"{module}: refusing to start: "), res.stderr
    assert len(lines) == len(problems), res.stderr  # the line, then each problem it does not state
    for problem in problems:
        assert res.stderr.count(problem) == 1, res.stderr


@pytest.mark.parametrize("module", ["region_agent", "allocator"])
def test_help_gives_every_option_its_meaning_and_default(module: str):
    from kernel.options import options

    if module == "region_agent":
        from region_agent.service.settings import ENV_PREFIX
        from region_agent.service.settings import AgentSettings as cls
    else:
        from allocator.settings import ENV_PREFIX
        from allocator.settings import AllocatorSettings as cls
    res = run(module, "--help")
    assert res.returncode == 0 and res.stderr == ""
    text = "".join(res.stdout.split())  # argparse wraps lines (also after a hyphen)
    for o in options(cls, ENV_PREFIX):
        flag = f"{o.flag},{o.negative_flag}" if o.is_bool else f"{o.flag}{o.metavar}"
        assert flag in text, flag
        assert "".join(o.help_line().split()) in text, o.help_line()
    assert f"{ENV_PREFIX}<OPTION>" in text
