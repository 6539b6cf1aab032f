"""The YAML adapter of the policy source (:mod:`kernel.policy_source`): read a source file with
the line of every value, compile it with errors that name the file, the line and the rule and
list the valid values, and write a source document back as YAML.

PyYAML's ``SafeLoader`` (libyaml's C parser when present) composes the document into nodes that
carry their marks; we build plain values from the nodes ourselves so that every path keeps its
line, duplicate keys are refused (PyYAML keeps the last silently), and no YAML type beyond
strings, numbers, booleans, null, lists and mappings is accepted (a bare timestamp stays the text
written). This module is the only one that imports ``yaml`` for policies.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import yaml

from .bundle import SOURCE_SUFFIXES, Bundle, decode_bundle, encode_bundle
from .errors import PolicyError
from .policy_source import (
    ENUMERATED,
    SOURCE_FIELD,
    SOURCE_RULES,
    PolicySource,
    SourceError,
    compile_source,
    decompile,
)

Path_ = tuple[str | int, ...]
_SAFE = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_STR_TAGS = {"tag:yaml.org,2002:str", "tag:yaml.org,2002:timestamp"}
_MERGE_TAG = "tag:yaml.org,2002:merge"
_SHOWN = 10  # problems listed of one file (the rest counted)


class SourceFileError(PolicyError):
    """A policy source that does not compile; ``errors`` are ``file:line: [rule 'id': ]problem``."""

    code, title = "policy-source-invalid", "Policy source is invalid"


# ------------------------------------------------------------------------------ reading
def _value(node: yaml.Node, path: Path_, lines: dict[Path_, int], problems: list[str], name: str,
           seen: set[int]) -> Any:
    if id(node) in seen:
        # an alias (*name): composed as the anchored node itself. Refused, not expanded: a policy
        # says each value where it applies, and nested aliases expand exponentially (an alias bomb)
        up = path
        while up and up not in lines:  # an item of a list: the list's line
            up = up[:-1]
        at = lines.get(up, node.start_mark.line + 1)
        problems.append(f"{name}:{at}: a YAML alias (*) of the value anchored on line {node.start_mark.line + 1}: "
                        "aliases are not accepted in a policy source, write the value out where it applies")
        return None
    lines[path] = node.start_mark.line + 1
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for k, v in node.value:
            if k.tag == _MERGE_TAG:
                problems.append(f"{name}:{k.start_mark.line + 1}: a YAML merge key (<<) is not accepted in a policy "
                                "source: write each field out in the rule or pool it applies to")
                continue
            key = k.value if isinstance(k, yaml.ScalarNode) else None
            if not isinstance(key, str):
                problems.append(f"{name}:{k.start_mark.line + 1}: a mapping key must be a plain name")
                continue
            if key in out:
                problems.append(f"{name}:{k.start_mark.line + 1}: {key!r} is given twice (first on line "
                                f"{lines[(*path, key)]})")
                continue
            lines[(*path, key)] = k.start_mark.line + 1
            out[key] = _value(v, (*path, key), lines, problems, name, seen)
            lines[(*path, key)] = k.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_value(v, (*path, i), lines, problems, name, seen) for i, v in enumerate(node.value)]
    seen.add(id(node))
    if node.tag in _STR_TAGS:
        return node.value
    if node.tag == "tag:yaml.org,2002:null":
        return None
    try:
        loader = _SAFE("")
        try:
            return loader.construct_object(node, deep=True)
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        problems.append(f"{name}:{node.start_mark.line + 1}: {e}")
        return None


def read_source(text: str, name: str) -> tuple[Any, dict[Path_, int]]:
    """The document of ``text`` and the line of every path in it. Raises :class:`SourceFileError`."""
    try:
        node = yaml.compose(text, Loader=_SAFE)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        at = f"{mark.line + 1}:{mark.column + 1}" if mark is not None else "0"
        problem = str(e.problem)
        row = text.splitlines()[mark.line] if mark is not None and mark.line < len(text.splitlines()) else ""
        if mark is not None and "\t" in row[:mark.column + 1]:
            problem += " (a tab: YAML indents with spaces only)"
        raise SourceFileError(f"{name}:{at}: not valid YAML: {problem}",
                              errors=[f"{name}:{at}: not valid YAML: {problem}"]) from None
    except yaml.YAMLError as e:
        raise SourceFileError(f"{name}: not valid YAML: {e}", errors=[f"{name}: not valid YAML: {e}"]) from None
    if node is None:
        raise SourceFileError(f"{name}: empty", errors=[f"{name}:1: the file is empty (version, publishedAt "
                                                        "and rules are required)"])
    lines: dict[Path_, int] = {}
    problems: list[str] = []
    doc = _value(node, (), lines, problems, name, set())
    if problems:
        shown = list(dict.fromkeys(problems))[:_SHOWN]
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more")
        raise SourceFileError(problems[0], errors=shown)
    return doc, lines


# ------------------------------------------------------------------------------ errors
_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_STEP = re.compile(r"\.([A-Za-z0-9_]+)|\[(\d+)\]")


def _parse_path(text: str) -> Path_:
    return tuple(m.group(1) if m.group(1) is not None else int(m.group(2)) for m in _STEP.finditer(text))


class _Where:
    """Turns a problem at a document path into ``file:line: rule 'id': problem``."""

    def __init__(self, name: str, doc: Any, lines: dict[Path_, int]):
        self.name, self.doc, self.lines = name, doc, lines

    def line(self, path: Path_) -> int:
        while path and path not in self.lines:
            path = path[:-1]
        return self.lines.get(path, 1)

    def item(self, kind: str, index: int) -> str:
        items = self.doc.get(kind) if isinstance(self.doc, dict) else None
        item = items[index] if isinstance(items, list) and index < len(items) else None
        ident = item.get("id") if isinstance(item, dict) else None
        return f"{kind[:-1]} {ident!r}" if isinstance(ident, str) else f"{kind[:-1]} #{index + 1}"

    def at(self, path: Path_, message: str) -> str:
        who = ""
        if len(path) >= 2 and path[0] in ("rules", "pools") and isinstance(path[1], int):
            who = self.item(str(path[0]), path[1]) + ": "
        return f"{self.name}:{self.line(path)}: {who}{message}"

    def by_id(self, kind: str, ident: str, field: str | None) -> Path_:
        items = self.doc.get(kind) if isinstance(self.doc, dict) else None
        for i, item in enumerate(items if isinstance(items, list) else []):
            if isinstance(item, dict) and item.get("id") == ident:
                if field is not None and field in item:
                    return (kind, i, field)
                return (kind, i)
        return (kind,)


def _valid_fields(doc: Any, path: Path_) -> list[str]:
    """The fields allowed where an unknown one was found (for the message)."""
    if path[:1] == ("rules",) and len(path) == 2 and isinstance(path[1], int):
        rule = doc["rules"][path[1]] if isinstance(doc.get("rules"), list) else {}
        cls = SOURCE_RULES.get(str(rule.get("algorithm"))) if isinstance(rule, dict) else None
        if cls is not None:
            return ["algorithm", *(f.encode_name for f in msgspec.structs.fields(cls))]
        return []
    from .policy_source import SourceFallback, SourcePool
    places: tuple[tuple[tuple[str, ...], type[msgspec.Struct]], ...] = (
        (("rules", "*", "fallback"), SourceFallback), (("pools", "*"), SourcePool), ((), PolicySource))
    for prefix, struct in places:
        if len(path) == len(prefix) and all(p == "*" or p == q for p, q in zip(prefix, path, strict=True)):
            return [f.encode_name for f in msgspec.structs.fields(struct)]
    return []


def _explain(doc: Any, message: str, path: Path_) -> str:
    """msgspec's message in the source's words, with the valid values or fields."""
    field = path[-1] if path else None
    if isinstance(field, str) and field in ENUMERATED:
        return f"{field} must be one of {', '.join(ENUMERATED[field])} ({message})"
    m = re.match(r"Object contains unknown field `([^`]*)`", message)
    if m:
        valid = _valid_fields(doc, path)
        return f"unknown field {m.group(1)!r}" + (f" (valid here: {', '.join(valid)})" if valid else "")
    m = re.match(r"Object missing required field `([^`]*)`", message)
    if m:
        return f"{m.group(1)} is required"
    if isinstance(field, str) and field in _DURATION_FIELDS and ("got `int`" in message or "got `float`" in message):
        return f"{field} {_get(doc, path)} needs a unit: e.g. {_get(doc, path)}s or {_get(doc, path)}ms (units: ms, s, min, h, d)"
    if isinstance(field, str) and "matching regex" in message:
        value = _get(doc, path)
        if field in ("rate", "limit"):
            return (f"{field} {value!r} is not a rate: tokens (up to 3 decimals) per duration, e.g. 2/s, 1000/min, "
                    "0.25/s, 20/10s (units: ms, s, min, h, d)")
        return f"{field} {value!r} is not a duration: an integer and a unit, e.g. 500ms, 10s, 1min (units: ms, s, min, h, d)"
    return f"{field}: {message}" if isinstance(field, str) else message


def _get(doc: Any, path: Path_) -> Any:
    for step in path:
        try:
            doc = doc[step]
        except (KeyError, IndexError, TypeError):
            return None
    return doc


_DURATION_FIELDS = {"window", "maxAge", *(v for k, v in SOURCE_FIELD.items() if k.endswith("Ms") and v != "rate")}


def _precheck(doc: Any, where: _Where) -> list[str]:
    """The enumerated values, each checked with the valid ones listed (the decoder would stop at
    the first, and name neither)."""
    problems = []
    if not isinstance(doc, dict):
        return [f"{where.name}:1: a policy source is a mapping (version, publishedAt, rules, pools)"]
    for i, rule in enumerate(doc.get("rules") or [] if isinstance(doc.get("rules"), list) else []):
        if not isinstance(rule, dict):
            continue
        for field, valid in ENUMERATED.items():
            if field not in rule:
                if field != "scope" or "algorithm" in rule:
                    if field in ("algorithm", "failMode"):
                        problems.append(where.at(("rules", i), f"{field} is required (one of {', '.join(valid)})"))
                continue
            if rule[field] not in valid:
                problems.append(where.at(("rules", i, field), f"{field} {rule[field]!r} is not one of "
                                                              f"{', '.join(valid)}"))
    return problems


def compile_document(doc: Any, lines: dict[Path_, int], name: str) -> Bundle:
    """The sealed bundle of a read source document; every problem names ``name``, the line and the rule."""
    where = _Where(name, doc, lines)
    pre = _precheck(doc, where)
    if pre:
        raise SourceFileError(pre[0] + (f" (+{len(pre) - 1} more)" if len(pre) > 1 else ""), errors=pre)
    try:
        src = msgspec.convert(doc, type=PolicySource)
    except msgspec.ValidationError as e:
        m = _AT.match(str(e))
        path = _parse_path(m.group("path") or "") if m else ()
        message = m.group("msg") if m else str(e)
        msg = _explain(doc, message, path)
        unknown = re.match(r"Object contains unknown field `([^`]*)`", message)
        msg = where.at((*path, unknown.group(1)) if unknown else path, msg)
        raise SourceFileError(msg, errors=[msg]) from None
    try:
        return compile_source(src)
    except SourceError as e:
        kind, index = ("rules", getattr(e, "rule", None)) if hasattr(e, "rule") else ("pools", getattr(e, "pool", None))
        at: Path_ = (kind, index, e.field) if index is not None else (e.field,)
        msg = where.at(at, str(e))
        raise SourceFileError(msg, errors=[msg]) from None
    except msgspec.ValidationError as e:  # a bundle field out of its range
        m = _AT.match(str(e))
        bpath = _parse_path(m.group("path") or "") if m else ()
        path = _bundle_path(bpath)
        field = bpath[-1] if bpath and isinstance(bpath[-1], str) else ""
        msg = where.at(path, f"{SOURCE_FIELD.get(str(field), field)}: {m.group('msg') if m else e} "
                             f"(as the bundle's {field})")
        raise SourceFileError(msg, errors=[msg]) from None
    except PolicyError as e:
        errors = [_locate(where, p) for p in (e.errors or [e.detail])]
        raise SourceFileError(errors[0] + (f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""),
                              errors=errors) from None


def _bundle_path(bpath: Path_) -> Path_:
    """A path in the bundle document -> the path of the same thing in the source."""
    if len(bpath) >= 2 and bpath[0] in ("rules", "pools"):
        field = bpath[2] if len(bpath) > 2 and isinstance(bpath[2], str) else None
        return (bpath[0], bpath[1], SOURCE_FIELD.get(field, field)) if field else bpath[:2]
    if bpath and isinstance(bpath[0], str):
        return (SOURCE_FIELD.get(bpath[0], bpath[0]),)
    return ()


_NAMED = re.compile(r"^(rule|pool) '([^']*)': ")
_FIELD_IN = re.compile(r"\b(" + "|".join(map(re.escape, sorted(SOURCE_FIELD, key=len, reverse=True))) + r")\b")


def _locate(where: _Where, problem: str) -> str:
    """A bundle validation problem (``rule 'x': ...``) at the line of that rule in the source, with
    the bundle's field names followed by the source's."""
    twice = re.match(r"^rule id '([^']*)' is used twice", problem)
    if twice:
        rules = where.doc.get("rules") or []
        last = max(i for i, r in enumerate(rules) if isinstance(r, dict) and r.get("id") == twice.group(1))
        return f"{where.name}:{where.line(('rules', last, 'id'))}: {problem}"
    m = _NAMED.match(problem)
    text = _FIELD_IN.sub(lambda f: f"{f.group(1)} ({SOURCE_FIELD[f.group(1)]})", problem)
    if m is None:
        return f"{where.name}:{where.line(('rules',))}: {text}"
    kind = "rules" if m.group(1) == "rule" else "pools"
    rest = problem[m.end():]
    field = _FIELD_IN.search(rest)
    first = rest.split(" ", 1)[0].rstrip(":")
    path = where.by_id(kind, m.group(2), SOURCE_FIELD[field.group(1)] if field else first)
    return f"{where.name}:{where.line(path)}: {text}"


# ------------------------------------------------------------------------------ files
def is_source(path: str | Path) -> bool:
    return str(path).endswith(SOURCE_SUFFIXES)


def compile_text(text: str, name: str) -> Bundle:
    doc, lines = read_source(text, name)
    return compile_document(doc, lines, name)


def read_text(path: str | Path) -> str:
    """A policy file's text (UTF-8, a leading BOM allowed). Raises :class:`SourceFileError` naming
    the file (and, for bytes that are not UTF-8, the line)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise SourceFileError(f"cannot read {str(path)!r}: {e.strerror or e}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        msg = f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x}): a policy file is UTF-8 text"
        raise SourceFileError(msg, errors=[msg]) from None


def compile_file(path: str | Path) -> Bundle:
    return compile_text(read_text(path), str(path))


def load_policy(path: str | Path, *, verify: Callable[[Bundle], None] | None = None) -> Bundle:
    """A bundle from a source (``.yaml``/``.yml``: compiled, then given to ``verify``) or a bundle file
    (JSON: decoded, given to ``verify`` before anything else is checked, and validated:
    :func:`kernel.bundle.decode_bundle`)."""
    if is_source(path):
        bundle = compile_file(path)
        if verify is not None:
            verify(bundle)  # a source carries no signature
        return bundle
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise PolicyError(f"cannot read policy bundle {str(path)!r}: {e.strerror}") from None
    return decode_bundle(raw, verify=verify)


# ------------------------------------------------------------------------------ writing
def _scalar(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def _flow(d: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k}: {_scalar(v)}" for k, v in d.items()) + "}"


def comments(text: str) -> tuple[str, dict[tuple[str, int], list[str]]]:
    """The comment lines a source starts with, and those right above each rule and pool item
    (what ``policy fmt`` keeps)."""
    doc, lines = read_source(text, "-")
    rows = text.splitlines()
    header: list[str] = []
    for row in rows:
        if row.startswith("#") or (header and not row.strip()):
            header.append(row)
        else:
            break
    above: dict[tuple[str, int], list[str]] = {}
    for kind in ("rules", "pools"):
        for i in range(len(doc.get(kind) or []) if isinstance(doc, dict) else 0):
            at = lines.get((kind, i))
            block: list[str] = []
            j = (at or 1) - 2
            while at and j >= 0 and rows[j].strip().startswith("#"):
                block.insert(0, rows[j].strip())
                j -= 1
            if block:
                above[(kind, i)] = block
    return "\n".join(header).rstrip() + "\n" if header else "", above


def dump_source(doc: dict[str, Any], header: str = "", above: dict[tuple[str, int], list[str]] | None = None) -> str:
    """A source document as YAML: one block per rule and pool, fallbacks and lists in flow style;
    ``header`` first, each ``above`` comment block over its item."""
    out = [header.rstrip("\n") + "\n"] if header else []
    for k, v in doc.items():
        if k in ("rules", "pools"):
            out.append(f"{'' if out and out[-1] == chr(10) else chr(10)}{k}:\n")
            for i, item in enumerate(v):
                out += [f"  {c}\n" for c in (above or {}).get((k, i), [])]
                first = True
                for ik, iv in item.items():
                    text = _flow(iv) if isinstance(iv, dict) else (
                        "[" + ", ".join(_scalar(x) for x in iv) + "]" if isinstance(iv, list) else _scalar(iv))
                    out.append(f"  {'- ' if first else '  '}{ik}: {text}\n")
                    first = False
                out.append("\n")
        else:
            out.append(f"{k}: {_scalar(v)}\n")
    return "".join(out).rstrip("\n") + "\n"


def source_text(bundle: Bundle, header: str = "", above: dict[tuple[str, int], list[str]] | None = None) -> str:
    return dump_source(decompile(bundle), header, above)


def bundle_bytes(bundle: Bundle) -> bytes:
    """What a compiled bundle file holds (the services' format, one trailing newline)."""
    return encode_bundle(bundle) + b"\n"


__all__ = ["SOURCE_SUFFIXES", "SourceFileError", "bundle_bytes", "compile_document", "compile_file", "compile_text",
           "dump_source", "is_source", "load_policy", "read_source", "read_text", "source_text"]
