"""``python -m bench`` option parsing: a bad option is a usage error (exit 2, one line) before any
server starts or any file is written."""

from __future__ import annotations

from pathlib import Path

import pytest

import bench.__main__ as bench_main


@pytest.mark.parametrize("argv", [
    ["--workers", "0"],  # was clamped to 1 silently
    ["--workers", "-3"],
    ["--workers", "1000"],
    ["--agent-args", "'--decision-budget-ms 200"],  # an unclosed quote: was a traceback
    ["--only", "9"],  # was exit 1, the status of a figure that could not be measured
    ["--only", ""],
])
def test_a_bad_option_is_exit_2_before_anything_runs(argv: list[str], tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setattr(bench_main.Ctx, "make", lambda *a, **kw: pytest.fail("the bench started"))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        bench_main.main([*argv, "--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "python -m bench: error: " in err and "Traceback" not in err
    assert not out.exists()


def test_an_out_that_is_a_file_is_exit_2(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setattr(bench_main.Ctx, "make", lambda *a, **kw: pytest.fail("the bench started"))
    file = tmp_path / "results"
    file.write_text("not a directory\n")
    with pytest.raises(SystemExit) as e:
        bench_main.main(["--only", "1", "--out", str(file)])  # was FileExistsError, a traceback
    assert e.value.code == 2 and f"--out {file}" in capsys.readouterr().err
