"""Writing the results: results.json, results.md (table + notes), the figure-2 plot (PNG)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import timeit
from pathlib import Path
from typing import Any

from .stats import Row, render_markdown


def environment() -> dict[str, Any]:
    import importlib.metadata as md

    versions = {}
    for pkg in ("litestar", "uvicorn", "redis", "aetcd", "limits", "msgspec"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg(),
            "platform": platform.platform(), "versions": versions, **interpreter(), **processor()}


def processor(sys_cpu: Path = Path("/sys/devices/system/cpu"), cpuinfo: Path = Path("/proc/cpuinfo"),
              autogroup: Path = Path("/proc/sys/kernel/sched_autogroup_enabled")) -> dict[str, Any]:
    """The processor a run ran on, as far as a VM shows it: the model (name, family, model), the
    first CPU's caches by level and kind (their sizes, e.g. ``L2``: ``512K``) and whether the
    kernel groups processes by session for CPU shares (``autogroup``: with it, a ``nice``
    process of another session still takes its session's share beside the benchmark). Two hosts of
    the same model name can differ in cache sizes and per-core speed: the ratios of figure 8 moved
    with them (bench/README.md, "Figure 8's RLS row on the half-as-fast host")."""
    names = {"model name": "cpu_model_name", "cpu family": "cpu_family", "model": "cpu_model"}
    out: dict[str, Any] = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key in names and names[key] not in out:  # the first CPU's
                out[names[key]] = value
    except OSError:
        pass
    caches = {}
    for d in sorted(sys_cpu.glob("cpu0/cache/index*")):
        try:
            level, kind, size = ((d / f).read_text().strip() for f in ("level", "type", "size"))
        except OSError:
            continue
        caches[f"L{level}{'d' if kind == 'Data' else 'i' if kind == 'Instruction' else ''}"] = size
    if caches:
        out["cpu_caches"] = caches
    try:
        out["sched_autogroup"] = autogroup.read_text().strip() == "1"
    except OSError:
        pass
    return out


def _reference_loop() -> int:
    d = {}
    for i in range(20_000):
        d[str(i)] = (i * 3) % 7
    return sum(v for v in d.values() if v > 2)


def interpreter() -> dict[str, Any]:
    """Which CPython ran the run and how fast it runs plain Python: the best of 5 timings of a
    fixed loop (dict stores, str(), a generator). The same machine's Debian CPython (built with
    profile-guided and link-time optimisation) and a CPython built without them differ by 30-40 %
    here, so every absolute number of a run depends on it (the ratios much less: both sides of most
    ratios run on it); the venv's interpreter is the Makefile's PYTHON."""
    best = min(timeit.repeat(_reference_loop, number=1, repeat=5))
    return {"python_executable": os.path.realpath(sys.executable), "python_reference_loop_ms": round(1e3 * best, 2)}


def _processor_text(env: dict[str, Any]) -> str:
    caches = ", ".join(f"{k} {v}" for k, v in env.get("cpu_caches", {}).items())
    return (f"{env.get('cpu_model_name', '?')} family {env.get('cpu_family', '?')} model {env.get('cpu_model', '?')}"
            + (f", caches {caches}" if caches else ""))


def write_json(path: Path, rows: list[Row], meta: dict[str, Any]) -> None:
    path.write_text(json.dumps({"meta": meta, "rows": [r.to_dict() for r in rows]}, indent=2, default=str))


def write_markdown(path: Path, rows: list[Row], meta: dict[str, Any], notes: list[str]) -> None:
    lines = [f"# Leasehold benchmark ({'quick' if meta.get('quick') else 'full'} run, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(meta['started']))})", "",
             f"{meta['env']['cpus']} CPUs, Python {meta['env']['python']} "
             f"({meta['env'].get('python_executable', '?')}; a reference loop "
             f"{meta['env'].get('python_reference_loop_ms', '?')} ms; {_processor_text(meta['env'])}), "
             f"load average at the end "
             f"{', '.join(f'{x:.2f}' for x in meta['env']['loadavg_at_end'])}; {meta['trials']} trial(s) per "
             f"figure, median reported; ratio = value / ceiling measured in the same run; "
             f"took {meta['elapsed_s']:.0f} s.", "", render_markdown(rows), ""]
    if notes:
        lines += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    lines += ["## Details per row", ""]
    for r in rows:
        if r.extra:
            lines.append(f"- **{r.figure} {r.name}**: `{json.dumps(r.extra, default=_short)}`")
    path.write_text("\n".join(lines) + "\n")


def _short(x: Any) -> Any:
    return str(x)


def plot_fig2(path: Path, data: dict[str, dict[str, dict[str, float]]]) -> bool:
    """Throughput and p99 vs concurrency, agent and echo; False when there is nothing to plot."""
    if not data:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, per in data.items():
        conns = [int(c) for c in per]
        ax1.plot(conns, [per[c]["rps"] for c in per], marker="o", label=name)
        ax2.plot(conns, [per[c]["p99_ms"] for c in per], marker="o", label=name)
    for ax, title, unit in ((ax1, "throughput", "requests/s"), (ax2, "p99 latency", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent connections")
        ax.set_ylabel(unit)
        ax.set_title(f"POST /v1/admit {title}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
