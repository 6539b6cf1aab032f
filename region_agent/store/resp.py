"""RESP encoding of the agent's EVALSHA calls.

A multi-rule call (every decision) is packed from its shape's text, in which the array header,
``slack_ms``, ``decision_ttl_ms`` and the rule slots are already text: only the keys, the member
and the question are joined in, each after its length's bulk header (``$<n>\r\n``, text made once
per length: a %-format of the call formatted four ints per decision). Every other call is packed by ``hiredis.pack_command``.
Both are measured against each other in docs/decisions/0025-redis-internals-behind-one-module.md;
tests/unit/region_agent/store/test_resp_pack.py checks both against redis-py's own packer, byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hiredis import pack_command as _pack_command

from ..decision.call import RuleArgv

__all__ = ["ASKING", "pack_evalsha", "pack_pipeline"]

ASKING = b"*1\r\n$6\r\nASKING\r\n"
_INT_RESP: dict[int, str] = {}  # a bulk string per int seen (rule parameters repeat on every call)
_INT_RESP_MAX = 4_096
_HEADS: dict[tuple[str, int, int], str] = {}  # (sha, keys, args) -> the array header up to the first key
_MEMO_MAX = 4_096


def pack_evalsha(sha: str, keys: Sequence[Any], argv: Sequence[Any]) -> bytes:
    """``EVALSHA sha numkeys key... arg...`` as one RESP array (what redis-py's pack_command
    would send for the same arguments: str as UTF-8, int in decimal, bytes as they are)."""
    if argv.__class__ is RuleArgv:  # a multi-rule call: all but its strings packed once per shape
        text = _pack_rule_call(sha, keys, argv)
        if text is not None:
            return text.encode()
    return _pack_command(("EVALSHA", sha, len(keys), *keys, *argv))


def pack_pipeline(calls: Sequence[tuple[str, Sequence[Any], Sequence[Any]]]) -> bytes:
    """Every ``(sha, keys, argv)`` packed (:func:`pack_evalsha`) into one payload, encoded once
    (a multi-rule call's text is ASCII; another call's bytes pass through as latin-1)."""
    texts: list[str] = []
    for sha, keys, argv in calls:
        text = _pack_rule_call(sha, keys, argv) if argv.__class__ is RuleArgv else None
        texts.append(text if text is not None else _pack_command(("EVALSHA", sha, len(keys), *keys, *argv)).decode("latin-1"))
    return "".join(texts).encode("latin-1")


def _bulks(args: Sequence[Any]) -> str | None:
    """The RESP bulk strings of ``args`` (ASCII str and int), or None for anything else."""
    parts: list[str] = []
    append = parts.append
    ints = _INT_RESP
    for a in args:
        cls = a.__class__
        if cls is str and a.isascii():
            append(f"${len(a)}\r\n{a}\r\n")
        elif cls is int:
            enc = ints.get(a)
            if enc is None:
                t = str(a)
                enc = f"${len(t)}\r\n{t}\r\n"
                if len(ints) < _INT_RESP_MAX:
                    ints[a] = enc
            append(enc)
        else:
            return None
    return "".join(parts)


def _head(sha: str, nk: int, na: int) -> str:
    """``EVALSHA sha numkeys`` with the array header of a call of ``nk`` keys and ``na`` args (memoised)."""
    hk = (sha, nk, na)
    head = _HEADS.get(hk)
    if head is None:
        head = f"*{nk + na + 3}\r\n$7\r\nEVALSHA\r\n${len(sha)}\r\n{sha}\r\n${len(str(nk))}\r\n{nk}\r\n"
        if len(_HEADS) >= _MEMO_MAX:
            _HEADS.clear()
        _HEADS[hk] = head
    return head


# "$<n>\r\n", the head of a bulk string of n bytes, for the lengths keys, request ids and questions
# have (a longer string's is formatted): no int formatted per argument of a call
_LENS = tuple(f"${n}\r\n" for n in range(512))
_RULE_CALLS: dict[tuple, tuple[tuple, str, str, str]] = {}  # (sha, key count, id(rule slots), slack, ttl) -> (slots, parts)


def _bulk(s: str) -> str:
    n = len(s)
    return f"{_LENS[n]}{s}\r\n" if n < 512 else f"${n}\r\n{s}\r\n"


def _pack_rule_call(sha: str, keys: Sequence[Any], argv: Any) -> str | None:
    """A multi-rule call (``argv``: a :class:`~region_agent.decision.call.RuleArgv`) packed from its
    shape's text: the header, ``slack_ms``, ``decision_ttl_ms`` and the rule slots are text
    already, joined with the keys, the member and the question (ASCII strings) and their
    lengths. None for anything else (the generic packer takes it)."""
    text = argv.text
    if text is not None:  # a remembered question's call: its text around the request's own strings
        member = argv[2]
        if text.sha != sha:
            _question_text(text, sha)
        if member.__class__ is str and member.isascii():
            lead = text.lead
            if lead and keys is text.keys:  # the decision key is the question's: the keys are its own
                return f"{lead}{_bulk(member)}{text.post}"
            if text.head:  # a recorded decision: its key is the request id's
                dk = keys[0]
                if dk.__class__ is str and dk.isascii():
                    return f"{text.head}{_bulk(dk)}{text.rest}{_bulk(member)}{text.post}"
    rules = argv.rules
    slack, ttl, member, question = argv[0], argv[1], argv[2], argv[-1]
    memo_key = (sha, len(keys), id(rules), slack, ttl)
    hit = _RULE_CALLS.get(memo_key)
    if hit is None or hit[0] is not rules:
        fixed = _bulks((slack, ttl))
        slots = _bulks(rules)
        if fixed is None or slots is None or len(argv) != len(rules) + 4:
            return None
        if len(_RULE_CALLS) >= _MEMO_MAX:
            _RULE_CALLS.clear()
        hit = _RULE_CALLS[memo_key] = (rules, _head(sha, len(keys), len(argv)), fixed, slots)
    _, head, fixed, slots = hit
    try:
        if not "".join((*keys, member, question)).isascii():  # lengths in bytes: the generic packer
            return None
    except TypeError:  # not all strings
        return None
    if len(keys) == 2:  # a decision key and one rule key: the common call
        k0, k1 = keys
        try:
            return (f"{head}{_LENS[len(k0)]}{k0}\r\n{_LENS[len(k1)]}{k1}\r\n{fixed}{_LENS[len(member)]}{member}\r\n"
                    f"{slots}{_LENS[len(question)]}{question}\r\n")
        except IndexError:  # a string of 512 bytes or more: below
            pass
    return "".join((head, *map(_bulk, keys), fixed, _bulk(member), slots, _bulk(question)))


def _question_text(text: Any, sha: str) -> None:
    """Make a :class:`~region_agent.decision.call.CallText`'s RESP text for ``sha`` (once per question
    and script sha): ``post`` (the rule slots and the question) and, when the decision key is the
    question's, ``lead`` (the header, every key, ``slack_ms`` and ``decision_ttl_ms``); else ``head``
    (the header) and ``rest`` (the rule keys, ``slack_ms`` and ``decision_ttl_ms``). Empty (the call
    is packed the general way) when a part is not ASCII."""
    keys, rules = text.keys, text.argv_rules
    fixed, slots = _bulks((text.slack_ms, text.ttl_ms)), _bulks(rules)
    text.lead = text.head = text.rest = text.post = ""
    if fixed is not None and slots is not None and "".join((*keys, text.question)).isascii():
        head = _head(sha, len(keys), len(rules) + 4)
        rest = f"{''.join(map(_bulk, keys[1:]))}{fixed}"
        text.post = f"{slots}{_bulk(text.question)}"
        if text.dk is not None:
            text.lead = f"{head}{_bulk(keys[0])}{rest}"
        else:
            text.head, text.rest = head, rest
    text.sha = sha
