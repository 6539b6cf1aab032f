"""``python -m chaos check`` re-checks a kept history: 0 = pass, 1 = violations, 2 = bad input."""

from __future__ import annotations

import json
from pathlib import Path

from chaos.__main__ import main
from chaos.history import HistoryWriter
from kernel.bundle import Bundle, encode_bundle, make_rule, seal

from .test_checker import POOL, clean, etcd, grant


def bundle_file(tmp_path: Path) -> Path:
    path = tmp_path / "bundle.json"
    path.write_bytes(encode_bundle(seal(Bundle(bundle_version=1, published_at="2026-11-29T00:00:00Z",
                                               checksum="", pools=[POOL],
                                               rules=[make_rule(id="atlas-pool", scope="tenant", tenant="atlas",
                                                           algorithm="pool", pool=POOL.id,
                                                           fail_mode="local_bounded")]))))
    return path


def history_file(tmp_path: Path, recs: list) -> Path:
    path = tmp_path / "run.jsonl"
    with HistoryWriter(path) as w:
        w.write_all(recs)
    return path


def test_clean_history_passes(tmp_path: Path, capsys):
    assert main(["check", "--history", str(history_file(tmp_path, clean())), "--policy", str(bundle_file(tmp_path))]) == 0
    assert "verdict: PASS" in capsys.readouterr().out


def test_violations_fail_with_json_report(tmp_path: Path, capsys):
    recs = clean() + [etcd(grant("lease-eu-0002", "eu", 20), 12)]
    code = main(["check", "--history", str(history_file(tmp_path, recs)), "--policy", str(bundle_file(tmp_path)),
                 "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["ok"] is False
    failed = [v["invariant"] for v in out["report"]["verdicts"] if not v["ok"]]
    assert failed == ["granted_within_limit"]


def test_bad_inputs_exit_2(tmp_path: Path, capsys):
    assert main(["check", "--history", str(tmp_path / "missing.jsonl")]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["check", "--history", str(history_file(tmp_path, clean())), "--policy", str(bad)]) == 2
    assert "error:" in capsys.readouterr().err


def test_a_file_that_is_not_a_history_is_bad_input_not_a_pass(tmp_path: Path, capsys):
    """A JSON array, bytes that are not a record, an empty file: the checker read no record and
    answered every invariant n/a with exit 0, a pass for a history it never saw."""
    for name, data in (("array.json", b"[1]\n"), ("binary", b"\xff\xfe{"), ("empty.jsonl", b""),
                       ("blank.jsonl", b"\n\n")):
        path = tmp_path / name
        path.write_bytes(data)
        for argv in (["check", "--history", str(path)], ["fallbacks", "--history", str(path)]):
            assert main(argv) == 2, (name, argv)
            assert f"error: {path}" in capsys.readouterr().err
    # a record cut by a run killed mid-write is still forgiven on the last line
    path = history_file(tmp_path, clean())
    with open(path, "ab") as f:
        f.write(b'{"type":"decision","agent":"a')
    assert main(["check", "--history", str(path), "--policy", str(bundle_file(tmp_path))]) == 0
