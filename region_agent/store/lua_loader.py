"""The Lua scripts' text: ``-- @include`` expansion and SHA1.

Every script lives in ``lua/NAME.lua``; shared code in ``lua/lib/*.lua`` is pulled in by a line
``-- @include lib/NAME.lua``, expanded textually once per script (include-guarded, recursive)
before ``SCRIPT LOAD``; a ``-- @kinds`` line stands for every registered call kind's library and
the dispatch table (kernel.algorithms.KINDS).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kernel.algorithms import KINDS

DEFAULT_LUA_DIR = Path(str(resources.files("region_agent").joinpath("lua")))  # ships in the wheel
INCLUDE_RE = re.compile(r"^--\s*@include\s+(\S+)\s*$")
KINDS_RE = re.compile(r"^--\s*@kinds\b")


def kinds_dispatch() -> list[str]:
    """What a ``-- @kinds`` line stands for: an include of every registered call kind's library
    and the dispatch table ``multi_rule.lua`` looks kinds up in (kernel.algorithms.KINDS)."""
    kinds = sorted(KINDS.values(), key=lambda k: k.code)
    table = ", ".join(f"{k.code} = {k.lua_table}" for k in kinds)
    return [*(f"-- @include {lib}" for lib in sorted({k.lib for k in kinds})), f"local ALG = {{ {table} }}"]


def expand_includes(path: Path, root: Path, _seen: set[Path] | None = None) -> str:
    """The text of ``path`` with every ``-- @include lib/X.lua`` replaced by that file's expanded
    text (each included file appears once: later includes of it become a comment), and a
    ``-- @kinds`` line by :func:`kinds_dispatch`, expanded the same way."""
    seen = _seen if _seen is not None else set()
    out: list[str] = []
    lines = path.read_text().splitlines()
    while lines:
        line = lines.pop(0)
        if KINDS_RE.match(line.strip()):
            out.append(line)
            lines[:0] = kinds_dispatch()
            continue
        m = INCLUDE_RE.match(line.strip())
        if not m:
            out.append(line)
            continue
        target = (root / m.group(1)).resolve()
        if root.resolve() not in target.parents:
            raise ValueError(f"include outside the lua directory: {m.group(1)}")
        if target in seen:
            out.append(f"-- (already included: {m.group(1)})")
            continue
        seen.add(target)
        out.append(f"-- >>> {m.group(1)}")
        out.append(expand_includes(target, root, seen))
        out.append(f"-- <<< {m.group(1)}")
    return "\n".join(out)


@dataclass(frozen=True, slots=True)
class LoadedScript:
    name: str
    source: str
    sha: str


def load_scripts(lua_dir: Path) -> dict[str, LoadedScript]:
    scripts: dict[str, LoadedScript] = {}
    for path in sorted(lua_dir.glob("*.lua")):
        src = expand_includes(path, lua_dir)
        scripts[path.stem] = LoadedScript(path.stem, src, hashlib.sha1(src.encode()).hexdigest())
    return scripts
