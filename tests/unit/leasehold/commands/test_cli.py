"""leasehold.commands.cli: every command takes -o text|json, the exit codes are in --help, and the local
commands fail with the documented codes (no topology is started here; see
tests/e2e/test_cli_process.py for the real thing)."""

from __future__ import annotations

import argparse
import json
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

    services = [{"name": n, "kind": k, "pid": 1, "url": f"http://127.0.0.1:{i}", "region": "eu", "log": ""}
                for i, (n, k) in enumerate([("etcd-m0", "etcd"), ("allocator-1", "allocator"),
                                            ("redis-1", "redis"), ("agent-eu-1", "agent")], start=1)]
    (tmp_path / "topology.json").write_text(json.dumps({"services": services, "secrets": None}))
    states: dict[str, str] = {}
    monkeypatch.setattr(cli, "_probe", lambda _client, svc: states.get(svc["name"], "ready"))
    for broken, code in ({}, Exit.OK), ({"agent-eu-1": "not ready"}, Exit.UNAVAILABLE), \
            ({"agent-eu-1": "not ready", "etcd-m0": "down"}, Exit.CONNECT), ({"redis-1": "exited"}, Exit.CONNECT):
        states = broken
        assert main(["--run-dir", str(tmp_path), "status", "-o", "json"]) == code
        doc = json.loads(capsys.readouterr().out)
        assert doc["healthy"] is (code == Exit.OK)
        assert doc["urls"] == {"agents": {"eu": ["http://127.0.0.1:4"]}, "allocators": ["http://127.0.0.1:2"],
                               "etcd": ["http://127.0.0.1:1"], "redis": {"eu": "http://127.0.0.1:3"}}
        assert {s["name"]: s["state"] for s in doc["services"] if s["state"] != "ready"} == broken
