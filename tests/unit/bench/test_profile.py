"""``python -m bench.profile``'s arguments: ``--folded`` keeps the stacks of the process it profiled."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import profile


def test_folded_without_a_py_spy_profile_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        profile.main(["--folded", "/tmp/never-written.folded"])
    assert e.value.code == 2
    assert "--folded needs --http, --rls or --allocator" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "name"), [("--allocator", "allocator.folded"), ("--http", "agent.folded"),
                                            ("--rls", "agent.folded")])
def test_folded_copies_the_stacks_of_the_profiled_process(tmp_path: Path, monkeypatch, flag: str, name: str) -> None:
    """The allocator's stacks are written as ``allocator.folded``: ``--allocator --folded X`` copied
    ``agent.folded``, which that profile never writes, so X was never written."""
    def fake_profile(work: Path, *args: object) -> str:
        (work / name).write_text("main;f 3\n")
        return "profiled"

    for fn in ("profile_allocator", "profile_http", "profile_rls"):
        monkeypatch.setattr(profile, fn, fake_profile)
    out = tmp_path / "kept.folded"
    assert profile.main([flag, "--folded", str(out)]) == 0
    assert out.read_text() == "main;f 3\n"
