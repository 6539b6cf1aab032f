"""The rate-limit algorithms: one module per algorithm, each holding the bundle rule of that
algorithm (its fields, validation and strategy: :mod:`.rule`) and its pure reference model (no
I/O, clock passed in; the same integer arithmetic as ``lua/lib/<name>.lua``: the test oracle
for the scripts and the agent's in-process fallback limiters).

Registration happens where each thing is defined: a rule Struct by :func:`.rule.algorithm`, a
script slot kind by :func:`.common.register_kind`. Importing this package imports every module
in it, so :data:`ALGORITHMS` (bundle algorithm -> rule Struct) and :data:`KINDS` (multi-rule slot
kind -> Lua library and model) are complete; adding an algorithm is adding its module here, its
Lua library under ``lua/lib/`` and their tests. ``Rule`` is the decoding type of a bundle rule
(a tagged union of the registered Structs).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Union

from .common import KINDS, InvalidArguments, Kind, RuleVerdict
from .rule import ALGORITHMS, Fallback, HotChunk, LocalModel, Rate, Role, RuleBase

for _m in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_m}")

# the tagged union msgspec decodes a bundle rule into (by its "algorithm" field)
RuleUnion: Any = Union[tuple(ALGORITHMS[name] for name in sorted(ALGORITHMS))]  # noqa: UP007


def make_rule(**fields: Any) -> RuleBase:
    """A rule from keyword fields, the algorithm named by ``algorithm`` (tooling and tests)."""
    name = fields.pop("algorithm")
    try:
        cls = ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r} (known: {', '.join(sorted(ALGORITHMS))})") from None
    return cls(**fields)


__all__ = ["ALGORITHMS", "KINDS", "Fallback", "HotChunk", "InvalidArguments", "Kind", "LocalModel", "Rate", "Role", "RuleBase",
           "RuleUnion", "RuleVerdict", "make_rule"]
