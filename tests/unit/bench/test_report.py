"""bench.report's record of the processor a run ran on: the model, the first CPU's caches by level
and kind, and whether the kernel shares CPU by session (autogroup), read from files of the form
of ``/proc/cpuinfo`` and ``/sys/devices/system/cpu``; what is missing is left out."""

from __future__ import annotations

from pathlib import Path

from bench.report import _processor_text, processor

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
processor\t: 1
cpu family\t: 26
model\t\t: 2
model name\t: another
"""


def _cache(root: Path, index: int, level: int, kind: str, size: str) -> None:
    d = root / "cpu0" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size)):
        (d / name).write_text(f"{value}\n")


def test_the_first_cpus_model_and_caches_are_recorded(tmp_path: Path):
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    (tmp_path / "autogroup").write_text("1\n")
    for i, (level, kind, size) in enumerate(((1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "512K"),
                                             (3, "Unified", "32768K"))):
        _cache(tmp_path / "cpu", i, level, kind, size)
    got = processor(tmp_path / "cpu", tmp_path / "cpuinfo", tmp_path / "autogroup")
    assert got == {"cpu_model_name": "AMD EPYC", "cpu_family": "25", "cpu_model": "1",
                   "cpu_caches": {"L1d": "32K", "L1i": "32K", "L2": "512K", "L3": "32768K"}, "sched_autogroup": True}
    assert _processor_text(got) == "AMD EPYC family 25 model 1, caches L1d 32K, L1i 32K, L2 512K, L3 32768K"


def test_what_a_machine_does_not_show_is_left_out(tmp_path: Path):
    assert processor(tmp_path / "cpu", tmp_path / "cpuinfo", tmp_path / "autogroup") == {}
    assert _processor_text({}) == "? family ? model ?"
