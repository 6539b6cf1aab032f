"""leasehold.commands.cli: every command takes -o text|json, the exit codes are in --help, and the local
commands fail with the documented codes (no topology is started here; see
tests/e2e/test_cli_process.py for the real thing)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from leasehold.commands.cli import build_parser, main
from leasehold.commands.output import Exit


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sp in action.choices.items():
                subs = commands(sp, (*path, name))
                out += subs or [((*path, name), sp)]
    return out


def test_every_command_takes_the_output_option():
    found = commands(build_parser())
    assert len(found) >= 11
    for path, sp in found:
        flags = {s for a in sp._actions for s in a.option_strings}
        assert {"-o", "--output"} <= flags, path


def test_help_lists_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for code in Exit:
        assert f"\n  {int(code):>2}  " in text


def test_validate_checks_a_policy_source_as_the_bundle_it_compiles_to(tmp_path: Path, capsys):
    """`leasehold policy validate policies/northstar.yaml` (the source docs/policy.md has you edit)
    answered "bundle is not valid JSON: ... invalid character (byte 0)" with the same text again as
    a detail; diff, explain and canary already read a source."""
    repo = Path(__file__).resolve().parents[4]
    source = repo / "policies" / "northstar-global.yaml"
    assert main(["policy", "validate", str(source), "--bound", "--against", str(source), "-o", "json"]) == Exit.OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["valid"] and doc["bundleVersion"] == 42 and {b["pool"] for b in doc["bound"]} >= {"atlas-minute"}
    typo = tmp_path / "p.yaml"
    typo.write_text(source.read_text().replace("failMode: closed", "failMode: strict", 1))
    assert main(["policy", "validate", str(typo)]) == Exit.USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"leasehold: invalid: {typo}:") and "failMode 'strict' is not one of" in err
    assert len(err.strip().splitlines()) == 1, err  # the problem once, not again as a detail


@pytest.mark.parametrize("argv", [
    ["policy", "publish", "SOURCE", "--etcd", "127.0.0.1:1"],
    ["policy", "sign", "SOURCE", "--key", "unused.key"],
    ["up", "--policy", "SOURCE"],
])
def test_a_policy_source_where_a_sealed_bundle_belongs_says_compile_it(argv: list[str], tmp_path: Path, capsys,
                                                                        monkeypatch):
    import leasehold.local.topology

    monkeypatch.setattr(leasehold.local.topology.LocalTopology, "start",
                        lambda self: (_ for _ in ()).throw(AssertionError("a topology was started")))
    source = str(Path(__file__).resolve().parents[4] / "policies" / "northstar.yaml")
    argv = [source if a == "SOURCE" else a for a in argv]
    assert main(["--run-dir", str(tmp_path / "run"), *argv]) == Exit.USAGE
    err = capsys.readouterr().err
    assert f"is a policy source (YAML), not a sealed bundle (JSON): compile it first with `leasehold policy " \
           f"compile {source}`" in err, err  # was: bundle is not valid JSON: ... invalid character (byte 0)
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize(("argv", "said"), [
    (["admit", "--bogus"], "unrecognized arguments: --bogus (see leasehold admit --help)"),  # was: leasehold --help
    (["policy", "compile", "p.yaml", "--bogus"], "unrecognized arguments: --bogus (see leasehold policy compile --help)"),
    (["secrets", "generate", "--out", "d", "--nope"], "unrecognized arguments: --nope (see leasehold secrets generate "
                                                      "--help)"),
    (["status", "--run-dir", "x"], "--run-dir is an option of leasehold, not of leasehold status: give it before the "
                                   "command (see leasehold --help)"),
    (["status", "--run-dir=x"], "--run-dir is an option of leasehold, not of leasehold status: give it before the "
                                "command (see leasehold --help)"),
])
def test_an_option_a_command_does_not_have_points_at_that_commands_help(argv: list[str], said: str, tmp_path: Path,
                                                                         capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == Exit.USAGE
    assert capsys.readouterr().err == f"leasehold: {said}\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["before", "after"])
def test_status_without_a_topology_is_exit_6_with_a_json_error(tmp_path: Path, capsys, where: str):
    argv = ["--run-dir", str(tmp_path), "status"]
    argv = ["-o", "json", *argv] if where == "before" else [*argv, "-o", "json"]
    assert main(argv) == Exit.NOT_RUNNING
    doc = json.loads(capsys.readouterr().out)
    assert doc["error"]["kind"] == "not-running" and doc["running"] is False


def test_validate_json_and_an_invalid_bundle(tmp_path: Path, capsys):
    repo = Path(__file__).resolve().parents[4]
    assert main(["policy", "validate", str(repo / "policies" / "northstar-global.json"), "--bound", "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["valid"] and doc["bundleVersion"] and {b["pool"] for b in doc["bound"]} >= {"global-read"}
    assert all({"healthy", "allocatorUnreachable", "worst"} <= set(b) for b in doc["bound"])
    bad = tmp_path / "bad.json"
    bad.write_text('{"bundleVersion": 1}')
    assert main(["policy", "validate", str(bad), "-o", "json"]) == Exit.USAGE
    captured = capsys.readouterr()
    assert json.loads(captured.out)["error"]["kind"] == "usage" and captured.err.startswith("leasehold: invalid")


def test_etcd_tls_options_are_checked_before_connecting(tmp_path: Path, capsys):
    ca = tmp_path / "ca.pem"
    ca.write_text("junk")
    assert main(["policy", "show", "--etcd", "http://127.0.0.1:1", "--etcd-ca-file", str(ca)]) == Exit.USAGE
    assert "not a PEM CA certificate bundle" in capsys.readouterr().err
    assert main(["policy", "show", "--etcd", "127.0.0.1:1", "--etcd-cert-file", str(ca)]) == Exit.USAGE
    assert "go together" in capsys.readouterr().err


def test_status_exit_codes_follow_the_worst_service(tmp_path: Path, capsys, monkeypatch):
    import leasehold.commands.cli as cli

    services = [{"name": n, "kind": k, "pid": os.getpid(), "url": f"http://127.0.0.1:{i}", "region": "eu", "log": ""}
                for i, (n, k) in enumerate([("etcd-m0", "etcd"), ("allocator-1", "allocator"),
                                            ("redis-1", "redis"), ("agent-eu-1", "agent")], start=1)]
    (tmp_path / "topology.json").write_text(json.dumps({"services": services, "secrets": None}))
    states: dict[str, str] = {}
    monkeypatch.setattr(cli, "_probe", lambda _client, svc, booted=True: states.get(svc["name"], "ready"))
    for broken, code in ({}, Exit.OK), ({"agent-eu-1": "not ready"}, Exit.UNAVAILABLE), \
            ({"agent-eu-1": "not ready", "etcd-m0": "down"}, Exit.CONNECT), ({"redis-1": "exited"}, Exit.CONNECT):
        states = broken
        assert main(["--run-dir", str(tmp_path), "status", "-o", "json"]) == code
        doc = json.loads(capsys.readouterr().out)
        assert doc["healthy"] is (code == Exit.OK)
        assert doc["urls"] == {"agents": {"eu": ["http://127.0.0.1:4"]}, "allocators": ["http://127.0.0.1:2"],
                               "etcd": ["http://127.0.0.1:1"], "redis": {"eu": "http://127.0.0.1:3"}}
        assert {s["name"]: s["state"] for s in doc["services"] if s["state"] != "ready"} == broken


@pytest.mark.parametrize("argv", [
    ["leases", "--allocator-url", "http://[::1"],  # httpx.InvalidURL: was exit 70
    ["leases", "--allocator-url", "allocator-1:8700"],  # no scheme: was "cannot reach" (exit 5)
    ["admit", "--agent-url", "ftp://agent"],
    ["admit", "--agent-url", ""],  # was taken for "no --agent-url"
    ["admit", "--agent-url", "http://127.0.0.1:9", "--cost", "0"],  # was sent, and the agent's 422 printed
    ["admit", "--agent-url", "http://127.0.0.1:9", "--cost", "1001"],
    ["up", "--regions", "eu,eu"],  # started a second agent of region eu that `down` never stopped
    ["up", "--regions", ""],
    ["up", "--regions", "EU"],
    ["up", "--agents-per-region", "0"],
    ["up", "--allocators", "-1"],
    ["up", "--allocators", "1000"],
    ["demo", "--rate", "nan"],  # the traffic driver died on int(nan) after everything had started
    ["demo", "--rate", "inf"],
    ["demo", "--rate", "-5"],
    ["demo", "--duration", "0"],
    ["secrets", "generate", "--out", "creds", "--regions", "EU,,us"],  # was its own message, after the parse
    ["secrets", "generate", "--out", "creds", "--regions", "eu,eu"],
    ["policy", "explain", "policies/northstar.yaml", "--tenant", "atlas", "--principal", "U-17", "--route", "read",
     "--cost", "0"],  # explained a request of cost 0, which every agent refuses (422)
    ["policy", "explain", "policies/northstar.yaml", "--tenant", "atlas", "--principal", "U-17", "--route", "read",
     "--cost", "1001"],
    # a canary slice naming what no service can be named was staged for nobody (exit 0), and a slice never narrows
    ["policy", "canary", "policies/northstar.yaml", "--regions", "EU", "--etcd", "127.0.0.1:1"],
    ["policy", "canary", "policies/northstar.yaml", "--tenants", "Atlas Corp", "--etcd", "127.0.0.1:1"],
    ["policy", "canary", "policies/northstar.yaml", "--agents", "../agent-eu-1", "--etcd", "127.0.0.1:1"],
    ["policy", "canary", "policies/northstar.yaml", "--regions", ",", "--etcd", "127.0.0.1:1"],
    ["policy", "status", "--agent-urls", "agent-eu-1:8080", "--etcd", "127.0.0.1:1"],  # was an "unreachable" row
])
def test_a_bad_option_value_is_a_usage_error_before_anything_starts(argv: list[str], tmp_path: Path, capsys,
                                                                     monkeypatch):
    import leasehold.local.demo
    import leasehold.local.topology

    def started(*a, **kw):
        raise AssertionError("a topology was started")

    monkeypatch.setattr(leasehold.local.topology.LocalTopology, "start", started)
    monkeypatch.setattr(leasehold.local.demo, "run_demo", started)
    with pytest.raises(SystemExit) as e:
        main(["--run-dir", str(tmp_path), "-o", "json", *argv])
    assert e.value.code == Exit.USAGE
    out, err = capsys.readouterr()
    assert json.loads(out)["error"]["kind"] == "usage"  # -o json: the error document, as for every failure
    assert err.startswith("leasehold: argument ") and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("policy", ["missing.json", ".", "bad.json"])
def test_up_checks_its_start_bundle_before_writing_anything(policy: str, tmp_path: Path, capsys, monkeypatch):
    import leasehold.local.topology

    monkeypatch.setattr(leasehold.local.topology.LocalTopology, "start",
                        lambda self: (_ for _ in ()).throw(AssertionError("a topology was started")))
    src = tmp_path / "src"
    src.mkdir()
    (src / "bad.json").write_bytes(b"\xff\xfe{")
    run = tmp_path / "run"
    assert main(["--run-dir", str(run), "up", "--policy", str(src / policy)]) == Exit.USAGE  # was 70
    err = capsys.readouterr().err
    assert err.startswith("leasehold: --policy ") and "Traceback" not in err
    assert not run.exists()  # was: secrets generated into it before the bundle was read


def test_demo_refuses_to_start_over_a_running_topology(tmp_path: Path, capsys, monkeypatch):
    """A second topology in the same run directory replaced the first's state file: `down` then
    stopped only the second, the first's processes ran on."""
    import leasehold.local.demo

    monkeypatch.setattr(leasehold.local.demo, "run_demo",
                        lambda *a, **kw: (_ for _ in ()).throw(AssertionError("a topology was started")))
    state = json.dumps({"services": [{"name": "agent-eu-1", "kind": "agent", "pid": os.getpid(), "url": "u"}]})
    (tmp_path / "topology.json").write_text(state)
    assert main(["--run-dir", str(tmp_path), "demo", "--duration", "1"]) == Exit.USAGE
    assert "already running" in capsys.readouterr().err
    assert (tmp_path / "topology.json").read_text() == state


@pytest.mark.parametrize("command", ["up", "demo"])
@pytest.mark.parametrize("leftover", ["exited", "another boot"])
def test_up_over_the_state_of_a_topology_whose_processes_are_gone_starts(command: str, leftover: str,
                                                                        tmp_path: Path, capsys, monkeypatch):
    """After a crash or a reboot, `up` said "a topology is already running" (its processes had
    all exited), and after a reboot `down` would have signalled whatever processes now have the
    recorded pids. The left-over state is removed and a topology starts; `down` signals nothing."""
    import subprocess

    import leasehold.local.demo
    import leasehold.local.topology
    from leasehold.local.topology import stop_from_state

    started = []
    monkeypatch.setattr(leasehold.local.topology.LocalTopology, "start", lambda self: started.append(self) or self)
    monkeypatch.setattr(leasehold.local.demo, "run_demo", lambda spec, **kw: started.append(spec) or 0)
    if leftover == "exited":
        gone = subprocess.Popen(["true"])
        gone.wait()
        pid, boot = gone.pid, leasehold.local.topology.boot_id()
    else:  # a pid that runs now (this test's), recorded by another boot
        pid, boot = os.getpid(), "another-boot"
    state = {"bootId": boot, "services": [{"name": "agent-eu-1", "kind": "agent", "pid": pid, "url": "u"}]}
    (tmp_path / "topology.json").write_text(json.dumps(state))
    if leftover == "another boot":
        assert stop_from_state(tmp_path) == []  # this process was not signalled
        assert not (tmp_path / "topology.json").exists()
        (tmp_path / "topology.json").write_text(json.dumps(state))
        assert main(["--run-dir", str(tmp_path), "status", "-o", "json"]) == Exit.CONNECT
        assert json.loads(capsys.readouterr().out)["services"][0]["state"] == "exited"
    argv = ["--run-dir", str(tmp_path), command] + (["--duration", "1"] if command == "demo" else [])
    assert main(argv) == Exit.OK, capsys.readouterr().err
    assert len(started) == 1 and not (tmp_path / "topology.json").exists()


def test_leases_names_an_answer_that_is_not_an_allocators(tmp_path: Path, capsys):
    """Something else at --allocator-url (a web server answering 200 with HTML, or JSON of another
    shape): exit 2 naming the URL, not 70."""
    import http.server
    import threading

    bodies = {"/v1/leader": b"<html>hello</html>"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server hook
            body = bodies.get(self.path, b"[]")
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for leader in (b"<html>hello</html>", b'{"nodeId": null, "url": null, "epoch": null}'):
            bodies["/v1/leader"] = leader
            bodies["/v1/pools"] = b'[{"name": "p1"}]'  # no "id": a KeyError before
            assert main(["leases", "--allocator-url", url + "/"]) == Exit.USAGE
            err = capsys.readouterr().err
            assert f"is {url} an allocator?" in err and "Traceback" not in err
    finally:
        server.shutdown()
        server.server_close()


def test_capacity_results_of_another_shape_are_a_usage_error_naming_the_file(tmp_path: Path, capsys):
    for name, data in (("list.json", b"[1]"), ("utf16.json", b"\xff\xfe{"), ("rows.json", b'{"rows": [5]}')):
        path = tmp_path / name
        path.write_bytes(data)
        assert main(["capacity", "--calls-per-s", "10", "--active-keys", "1", "--results", str(path)]) == Exit.USAGE
        err = capsys.readouterr().err
        assert f"leasehold: {path} is not a bench results.json" in err and "Traceback" not in err


def test_secrets_generate_never_narrows_a_directory_it_does_not_own(tmp_path: Path, capsys, monkeypatch):
    """--out . (or /tmp, a home, a checkout) made that directory 0700 and filled it with
    credentials; --out '' did the same to the working directory; --out FILE was exit 70."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    (shared / "README").write_text("mine\n")
    monkeypatch.chdir(shared)
    for out in (str(shared), ".", ""):
        assert main(["secrets", "generate", "--out", out]) == Exit.USAGE
        assert "Traceback" not in capsys.readouterr().err
        assert shared.stat().st_mode & 0o777 == 0o755 and sorted(p.name for p in shared.iterdir()) == ["README"]
    assert main(["secrets", "generate", "--out", str(shared / "README")]) == Exit.USAGE
    assert "is not a directory" in capsys.readouterr().err
    # a directory of their own: created 0700; an existing one that holds only credentials (or
    # nothing) is narrowed to 0700, and --force replaces them in it
    own = tmp_path / "own"
    assert main(["secrets", "generate", "--out", str(own)]) == Exit.OK
    own.chmod(0o755)
    assert main(["secrets", "generate", "--out", str(own), "--force", "--regions", "eu,ap"]) == Exit.OK
    assert own.stat().st_mode & 0o777 == 0o700
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o755)
    assert main(["secrets", "generate", "--out", str(empty)]) == Exit.OK
    assert empty.stat().st_mode & 0o777 == 0o700


def test_secrets_generate_takes_every_region_name_the_services_take(tmp_path: Path, capsys):
    """`leasehold up --regions 1eu` and the agent's `--region 1eu` worked, but `secrets generate
    --regions 1eu` refused it (a pattern of its own, printed with its regex anchors)."""
    out = tmp_path / "creds"
    assert main(["secrets", "generate", "--out", str(out), "--regions", "1eu,us-east-2"]) == Exit.OK
    capsys.readouterr()
    assert (out / "region-1eu.token").is_file() and (out / "region-us-east-2.token").is_file()
    hashes = (out / "region-token-hashes").read_text()
    assert hashes.startswith("1eu:") and "\nus-east-2:" in hashes
    # the credentials' own directory: --force replaces them (a file it does not recognise would be refused)
    assert main(["secrets", "generate", "--out", str(out), "--regions", "1eu,us-east-2", "--force"]) == Exit.OK


@pytest.mark.parametrize("prefix", ["leasehold", "/leasehold", "leasehold/"])
def test_a_prefix_the_services_would_not_read_is_refused_before_etcd_is_dialled(prefix: str, capsys, monkeypatch):
    """`publish --prefix /leasehold` wrote `/leaseholdpolicy/current`, a key no service reads (and
    answered 0 on a reachable etcd); the flag and LEASEHOLD_ETCD_PREFIX are checked as the services
    check theirs."""
    import kernel.etcd_store

    monkeypatch.setattr(kernel.etcd_store, "EtcdStore", lambda *a, **kw: pytest.fail("etcd was dialled"))
    with pytest.raises(SystemExit) as e:
        main(["policy", "show", "--etcd", "127.0.0.1:1", "--prefix", prefix])
    assert e.value.code == Exit.USAGE and "argument --prefix" in capsys.readouterr().err
    monkeypatch.setenv("LEASEHOLD_ETCD_PREFIX", prefix)
    with pytest.raises(SystemExit) as e:
        main(["policy", "show", "--etcd", "127.0.0.1:1"])
    assert e.value.code == Exit.USAGE


def test_an_etcd_tls_file_that_is_not_there_is_named(tmp_path: Path, capsys):
    for path, why in ((tmp_path / "missing.crt", "no such file"), (tmp_path, "not a readable file")):
        assert main(["policy", "show", "--etcd", "127.0.0.1:1", "--etcd-ca-file", str(path)]) == Exit.USAGE
        assert f"leasehold: --etcd-ca-file {path}: {why}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["status", "down", "admit", "leases", "up"])
def test_a_state_file_of_another_shape_is_exit_2_and_down_signals_nothing(command: str, tmp_path: Path, capsys,
                                                                          monkeypatch):
    """A truncated or hand-edited topology.json was exit 70 for every command, `down` included; a
    pid of -1 in it would have had `down` signal every process it may."""
    monkeypatch.setattr(os, "kill", lambda *a: pytest.fail(f"signal sent: {a}"))
    (tmp_path / "topology.json").write_text('{"services": [{"name": "x", "kind": "agent", "pid": -1, "url": "u"}]}')
    assert main(["--run-dir", str(tmp_path), command]) == Exit.USAGE
    err = capsys.readouterr().err
    assert f"{tmp_path / 'topology.json'} is not a topology state file" in err and "Traceback" not in err


@pytest.mark.parametrize("token", [None, "", "\xff"])
def test_admit_names_a_token_file_it_cannot_use_before_asking(token: str | None, tmp_path: Path, capsys,
                                                              monkeypatch):
    """The gateway token file of the running topology gone (or empty): admit sent no token and said
    'the agent answered 401: missing or invalid bearer token', which names neither the file nor a fix."""
    import httpx

    monkeypatch.delenv("LEASEHOLD_TOKEN", raising=False)
    monkeypatch.setattr(httpx, "post", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("the agent was asked")))
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    if token is not None:
        (secrets / "gateway.token").write_bytes(token.encode("latin-1"))
    services = [{"name": "agent-eu-1", "kind": "agent", "pid": os.getpid(), "url": "http://127.0.0.1:9",
                 "region": "eu"}]
    (tmp_path / "topology.json").write_text(json.dumps({"services": services, "secrets": str(secrets)}))
    assert main(["--run-dir", str(tmp_path), "admit"]) == Exit.USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"leasehold: cannot read the local topology's gateway token {secrets / 'gateway.token'}: "
                          if token != "" else
                          f"leasehold: the local topology's gateway token {secrets / 'gateway.token'} is empty"), err
    assert "LEASEHOLD_TOKEN" in err and "Traceback" not in err


def test_capacity_takes_the_algorithm_names_a_rule_uses(capsys):
    """`--algorithm pool` (a rule's algorithm, docs/glossary.md) was refused: only the measurement's
    own name "pool balance" was taken. docs/capacity.md's `--json` is `-o json`."""
    argv = ["capacity", "--calls-per-s", "1000", "--active-keys", "10"]
    assert main([*argv, "--algorithm", "pool", "-o", "json"]) == Exit.OK
    by_rule_name = json.loads(capsys.readouterr().out)["plan"]
    assert main([*argv, "--algorithm", "pool balance", "-o", "json"]) == Exit.OK
    assert json.loads(capsys.readouterr().out)["plan"] == by_rule_name and by_rule_name["bytes_per_key"] > 0
    assert main([*argv, "--algorithm", "leaky"]) == Exit.USAGE
    assert capsys.readouterr().err.startswith("leasehold: no measured bytes per key for 'leaky'")
    page = (Path(__file__).resolve().parents[4] / "docs" / "capacity.md").read_text()
    assert "[--json]" not in page and "[-o json]" in page


def test_up_decision_logs_turns_the_agents_decision_log_on(tmp_path: Path, monkeypatch, capsys):
    """docs/policy.md sent a new user to the topology's `decision_logs` spec field, which no option
    set: the input of `policy replay` could not be had from `leasehold up`."""
    import leasehold.local.topology

    specs = []

    def start(self):
        specs.append(self.spec)
        raise KeyboardInterrupt  # stop here: nothing was started

    monkeypatch.setattr(leasehold.local.topology.LocalTopology, "start", start)
    for argv, on in ((["up"], False), (["up", "--decision-logs"], True), (["demo", "--decision-logs"], True)):
        main(["--run-dir", str(tmp_path / "run"), *argv])
        assert specs.pop().decision_logs is on, argv
    capsys.readouterr()


def test_policy_keygen_twice_keeps_the_first_key(tmp_path: Path, capsys):
    """The second run replaced the signing key silently (exit 0): the fleet trusts the first one."""
    assert main(["policy", "keygen", str(tmp_path)]) == Exit.OK
    first = (tmp_path / "policy-signing.key").read_bytes()
    capsys.readouterr()
    assert main(["policy", "keygen", str(tmp_path)]) == Exit.USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"leasehold: {tmp_path / 'policy-signing.key'} and {tmp_path / 'policy-signing.pub'} "
                          "already exist: refusing to replace a signing key pair") and "--force" in err
    assert (tmp_path / "policy-signing.key").read_bytes() == first
    assert main(["policy", "keygen", str(tmp_path), "--name", "next"]) == Exit.OK  # a rotation's second pair
    assert main(["policy", "keygen", str(tmp_path), "--force"]) == Exit.OK
    assert (tmp_path / "policy-signing.key").read_bytes() != first


def test_admit_text_of_a_request_no_rule_applies_to():
    """Was "allowed: HTTP 200, rule - (bundle 48), remaining None of None" after a route group was renamed."""
    from leasehold.commands.cli import _decision_text

    free = {"allowed": True, "httpStatus": 200, "policyId": None, "policyVersion": 48, "remaining": None,
            "limit": None, "decisionId": "cli-1", "headers": {}}
    assert _decision_text(free).splitlines()[0] == "allowed: HTTP 200, no rule of bundle 48 applies"
    limited = free | {"policyId": "read-user", "remaining": 1, "limit": 2}
    assert _decision_text(limited).splitlines()[0] == "allowed: HTTP 200, rule read-user (bundle 48), remaining 1 of 2"


def test_validate_with_public_keys_verifies_the_signature_first(tmp_path: Path, capsys):
    """As the services do: an unsigned bundle that is also invalid (and expensive to check) is refused
    for its signature, in one line, without its validation."""
    from kernel.bundle import encode_bundle
    from kernel.signing import generate_keypair, load_private_key, sign_bundle
    from tests.support.policies import expensive_bundle, northstar

    key, pub = generate_keypair(tmp_path / "keys")
    unsigned = tmp_path / "unsigned.json"
    unsigned.write_bytes(encode_bundle(expensive_bundle(43)))
    assert main(["policy", "validate", str(unsigned), "--public-keys", str(pub)]) == Exit.USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("leasehold: invalid: bundle 43 is unsigned and signatures are required"), err
    assert not any("script slots" in line for line in err) and "Traceback" not in "\n".join(err)
    assert main(["policy", "validate", str(unsigned)]) == Exit.USAGE  # without keys: its problems
    assert "script slots" in capsys.readouterr().err
    signed = tmp_path / "signed.json"
    signed.write_bytes(encode_bundle(sign_bundle(northstar(), load_private_key(key))))
    assert main(["policy", "validate", str(signed), "--public-keys", str(pub)]) == Exit.OK
