"""All rules of one request, all or nothing; mirrors ``lua/multi_rule.lua``.

Every rule's check runs on the state before the request; the first denying rule is reported,
retry is the max over denying rules (-1 if any can never succeed); only when none denies do all
rules take their new state. Remaining per rule: after the debit when the request is allowed, else
every rule's current, undebited value (a concurrency rule reports in_flight).

With a decision record (:func:`decide_recorded`): a record written for the same *question*
replays its reply and changes nothing; a record of another question answers the conflict reply
``[-1, 0, 0, 0 .. 0]`` and changes nothing; without a record the call decides and stores its reply
(allowed or denied) under the question."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .common import KINDS, InvalidArguments, RuleVerdict

MAX_RULES = 8


@dataclass(frozen=True, slots=True)
class RuleSpec:
    kind: str  # a registered call kind (common.KINDS): "tb", "sl", "cc", "pool", "pw", ...
    params: tuple[int, int, int, int, int]


class Slot(Protocol):
    """What a rule slot of a call gives (a :class:`RuleSpec`, or the agent's local allowance items)."""

    @property
    def kind(self) -> str: ...

    @property
    def params(self) -> tuple[int, int, int, int, int]: ...


@dataclass(frozen=True, slots=True)
class MultiDecision:
    allowed: bool
    denied_by: int  # 1-based, 0 = none
    retry_after_ms: int  # -1 = never
    remaining: tuple[int, ...]

    def as_reply(self) -> list[int]:
        return [int(self.allowed), self.denied_by, self.retry_after_ms, *self.remaining]


def parse_rules(rules: Sequence[Slot], member: str) -> list[Any]:
    """Validate every rule (raises :class:`InvalidArguments` like the script's error reply)."""
    if not 1 <= len(rules) <= MAX_RULES:
        raise InvalidArguments(f"1..{MAX_RULES} rules per call")
    out = []
    for r in rules:
        kind = KINDS.get(r.kind)
        if kind is None or len(r.params) != 5:
            raise InvalidArguments(f"unknown rule kind {r.kind!r} or wrong parameter count")
        if kind.needs_member and not member:
            raise InvalidArguments(f"a {r.kind} rule needs a member (the decision id)")
        out.append(kind.parse(r.params))
    return out


CONFLICT = -1  # ``allowed`` of the conflict reply


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """What a decision key holds: the question it was written for and the reply given."""

    question: str
    reply: tuple[int, ...]


def conflict_reply(n_rules: int) -> list[int]:
    return [CONFLICT, 0, 0, *([0] * n_rules)]


def decide_recorded(record: DecisionRecord | None, states: Sequence[Any], rules: Sequence[Slot], now_ms: int,
                    member: str, question: str, incarnation: str = ""
                    ) -> tuple[list[int], list[Any] | None, DecisionRecord | None]:
    """One call with ``decision_ttl_ms > 0``: (reply, new states or None when nothing changed,
    the record afterwards). Validation comes first, as in the script. A denial by a leased pool is
    not recorded (the agent runs the decision again after a top-up): the record stays None."""
    parse_rules(rules, member)
    if len(question) > 64 or not question.isascii() or (question and not question.isalnum()):
        raise InvalidArguments("question: at most 64 characters of [0-9A-Za-z]")
    if record is not None:
        if record.question == question:
            return list(record.reply), None, record
        return conflict_reply(len(rules)), None, record
    d, new = decide(states, rules, now_ms, member, incarnation)
    reply = d.as_reply()
    if not d.allowed and not KINDS[rules[d.denied_by - 1].kind].records_denial:
        return reply, new, None
    return reply, new, DecisionRecord(question, tuple(reply))


def decide(states: Sequence[Any], rules: Sequence[Slot], now_ms: int, member: str, incarnation: str = ""
           ) -> tuple[MultiDecision, list[Any] | None]:
    """``states[i]`` is rule i's state (None = no key). New states None on deny; on allow each
    entry is the rule's new state, or its old state when the rule wrote nothing (a replay).
    ``incarnation``: the store node's current one (pool entries of another are not spendable)."""
    if len(states) != len(rules):
        raise InvalidArguments("one state per rule")
    parsed = parse_rules(rules, member)
    decisions: list[RuleVerdict] = []
    new_states: list[Any] = []
    for r, p, s in zip(rules, parsed, states, strict=True):
        d, ns = KINDS[r.kind].step(s, p, now_ms, member, incarnation)
        decisions.append(d)
        new_states.append(s if ns is None else ns)
    denying = [i for i, d in enumerate(decisions) if not d.allowed]
    if not denying:
        return MultiDecision(True, 0, 0, tuple(d.remaining for d in decisions)), new_states
    remaining = tuple(d.undebited for d in decisions)
    retries = [decisions[i].retry_after_ms for i in denying]
    retry = -1 if any(x < 0 for x in retries) else max(retries)
    return MultiDecision(False, denying[0] + 1, retry, remaining), None
