"""leasehold.commands.output: one output convention and one exit-code table for every command."""

import argparse
import io
import json

import pytest

from leasehold.commands.output import MEANINGS, Exit, Failure, Output, exit_code_epilog, exit_code_table, run


def ns(fmt: str) -> argparse.Namespace:
    return argparse.Namespace(output=fmt)


def test_every_exit_code_has_a_meaning_in_both_tables():
    assert set(MEANINGS) == set(Exit)
    for code in Exit:
        assert f"| {int(code)} | `{code.name}` |" in exit_code_table()
        assert f"\n  {int(code):>2}  " in exit_code_epilog()


def test_result_json_is_one_document_and_text_is_for_people():
    buf = io.StringIO()
    assert Output("json", stdout=buf).result({"a": 1}, "a is 1", Exit.DENIED) == 3
    assert json.loads(buf.getvalue()) == {"a": 1}
    buf = io.StringIO()
    assert Output("text", stdout=buf).result({"a": 1}, lambda d: f"a is {d['a']}") == 0
    assert buf.getvalue() == "a is 1\n"
    with pytest.raises(ValueError):
        Output("yaml")


def test_failures_go_to_stderr_and_as_a_json_error_document(monkeypatch, capsys):
    def failing(_args):
        raise Failure(Exit.NOT_RUNNING, "nothing runs", ["detail one"], running=False)

    assert run(failing, ns("json")) == 6
    captured = capsys.readouterr()
    assert captured.err == "leasehold: nothing runs\n  - detail one\n"
    assert json.loads(captured.out) == {"error": {"exit": 6, "kind": "not-running", "message": "nothing runs",
                                                  "details": ["detail one"]}, "running": False}
    assert run(failing, ns("text")) == 6
    assert capsys.readouterr().out == ""  # text: nothing on stdout


def test_an_unexpected_error_is_one_line_without_traceback(monkeypatch, capsys):
    monkeypatch.delenv("LEASEHOLD_DEBUG", raising=False)

    def broken(_args):
        raise RuntimeError("boom")

    assert run(broken, ns("text")) == 70
    err = capsys.readouterr().err
    assert err == "leasehold: unexpected error: RuntimeError: boom\n" and "Traceback" not in err
    monkeypatch.setenv("LEASEHOLD_DEBUG", "1")
    assert run(broken, ns("text")) == 70
    assert "Traceback" in capsys.readouterr().err


def test_write_file_keeps_the_mode_follows_a_symlink_and_writes_a_device_in_place(tmp_path):
    import os
    import stat
    import threading

    from leasehold.commands.output import write_file

    real = tmp_path / "real.json"
    real.write_bytes(b"old")
    real.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_file(link, b"new")
    assert link.is_symlink() and real.read_bytes() == b"new" and stat.S_IMODE(real.stat().st_mode) == 0o640
    fifo = tmp_path / "pipe"  # not a regular file (as /dev/stdout): written to, never replaced
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    write_file(fifo, b"through the pipe")
    reader.join(5)
    assert got == [b"through the pipe"] and stat.S_ISFIFO(fifo.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "pipe", "real.json"]
