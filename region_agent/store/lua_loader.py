"""The Lua scripts' text: ``-- @include`` expansion and SHA1.

Every script lives in ``lua/NAME.lua``; shared code in ``lua/lib/*.lua`` is pulled in by a line
``-- @include lib/NAME.lua``, expanded textually once per script (include-guarded, recursive)
before ``SCRIPT LOAD``; a ``-- @kinds`` line stands for every registered call kind's library and
the dispatch table (kernel.algorithms.KINDS).

A script with a ``-- @kinds`` line also has *lean variants*, named ``NAME[k1,k2]``: the same
text with only the libraries of those kinds and a dispatch table of them (:func:`load_variant`).
Redis runs a script's whole body on every call, so every library's function definitions are
made again each time (about 6 us of the store's CPU per call for the full set of kinds, against
a call's 10 us for one kind); a call whose slots are all of the variant's kinds runs the variant,
and answers exactly as the full script (a kind the variant does not have is refused before any
read or write, as any unknown kind is).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kernel.algorithms import KINDS

DEFAULT_LUA_DIR = Path(str(resources.files("region_agent").joinpath("lua")))  # ships in the wheel
INCLUDE_RE = re.compile(r"^--\s*@include\s+(\S+)\s*$")
KINDS_RE = re.compile(r"^--\s*@kinds\b")


VARIANT_RE = re.compile(r"^([a-z_]+)\[([a-z]+(?:,[a-z]+)*)\]$")  # NAME[k1,k2]: kinds sorted, distinct


def kinds_dispatch(codes: Iterable[str] | None = None) -> list[str]:
    """What a ``-- @kinds`` line stands for: an include of every registered call kind's library
    (or only of ``codes``') and the dispatch table ``multi_rule.lua`` looks kinds up in
    (kernel.algorithms.KINDS)."""
    wanted = set(KINDS) if codes is None else set(codes)
    kinds = sorted((k for k in KINDS.values() if k.code in wanted), key=lambda k: k.code)
    table = ", ".join(f"{k.code} = {k.lua_table}" for k in kinds)
    return [*(f"-- @include {lib}" for lib in sorted({k.lib for k in kinds})), f"local ALG = {{ {table} }}"]


def variant_name(name: str, codes: Iterable[str]) -> str:
    """The lean variant of script ``name`` for the kinds ``codes`` (module doc)."""
    return f"{name}[{','.join(sorted(set(codes)))}]"


def expand_includes(path: Path, root: Path, _seen: set[Path] | None = None, *,
                    kinds: Iterable[str] | None = None) -> str:
    """The text of ``path`` with every ``-- @include lib/X.lua`` replaced by that file's expanded
    text (each included file appears once: later includes of it become a comment), and a
    ``-- @kinds`` line by :func:`kinds_dispatch` (of ``kinds``; None: every kind), expanded the
    same way."""
    seen = _seen if _seen is not None else set()
    out: list[str] = []
    lines = path.read_text().splitlines()
    while lines:
        line = lines.pop(0)
        if KINDS_RE.match(line.strip()):
            out.append(line)
            lines[:0] = kinds_dispatch(kinds)
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


def _loaded(name: str, src: str) -> LoadedScript:
    return LoadedScript(name, src, hashlib.sha1(src.encode()).hexdigest())


def load_scripts(lua_dir: Path) -> dict[str, LoadedScript]:
    scripts: dict[str, LoadedScript] = {}
    for path in sorted(lua_dir.glob("*.lua")):
        scripts[path.stem] = _loaded(path.stem, expand_includes(path, lua_dir))
    return scripts


def has_kinds(lua_dir: Path, name: str) -> bool:
    """Whether script ``name`` dispatches on call kinds (has lean variants)."""
    path = lua_dir / f"{name}.lua"
    return path.is_file() and any(KINDS_RE.match(line.strip()) for line in path.read_text().splitlines())


def parse_variant(variant: str) -> tuple[str, list[str]] | None:
    """``NAME[k1,...]`` as (NAME, kinds), or None when it is not a variant's name: not of that
    form, kinds not sorted and distinct, or a kind that is not registered. Pure: whether NAME
    dispatches on kinds is :func:`has_kinds`'s."""
    m = VARIANT_RE.match(variant)
    if m is None:
        return None
    name, codes = m.group(1), m.group(2).split(",")
    if codes != sorted(set(codes)) or not set(codes) <= set(KINDS):
        return None
    return name, codes


def load_variant(lua_dir: Path, name: str, codes: list[str]) -> LoadedScript:
    """The lean variant of script ``name`` (one with a ``-- @kinds`` line) for the kinds ``codes``."""
    return _loaded(variant_name(name, codes), expand_includes(lua_dir / f"{name}.lua", lua_dir, kinds=codes))
