"""One decision's script call: ``multi_rule.lua``'s KEYS and ARGV from a plan's rule slots, and
its reply. Pure (the store sends what this builds, as a :data:`ScriptCall`).

The contract (every KEYS[i] / ARGV[i] with units, the reply, the conflict reply) is the script's
header; the numeric validation is the script's too (it answers with an error reply), only the
call's shape is checked here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from kernel.algorithms import KINDS
from kernel.algorithms.rule import Params
from kernel.caches import BoundedMemo
from kernel.errors import DecisionConflict, LeaseholdError, ScriptRejected, StoreUnavailable

from ..store.lua_loader import variant_name

if TYPE_CHECKING:
    from .plan import Plan

MULTI_RULE = "multi_rule"  # the script; a call runs its lean variant for the kinds of its slots (script_for)
MAX_RULES = 8
CONFLICT = -1  # ``allowed`` of the multi-rule reply for a decision record of another question

ScriptCall = tuple[str, list[Any], list[Any]]  # (script name, KEYS, ARGV): what the store sends by EVALSHA


class Call(NamedTuple):
    """One rule's slot in a multi-rule call (immutable, built per decision: created in C)."""

    key: str
    kind: str  # a registered call kind (kernel.algorithms.KINDS)
    params: Params


class RuleArgv(list[Any]):
    """A multi-rule call's ARGV whose rule slots (``argv[3:-1]``) are ``rules``: the kinds and
    parameters checked once per policy snapshot, selection and cost (region_agent.decision.plan.Shape),
    the same tuple for every call of that shape. A list like any ARGV; the store's packer
    encodes ``rules`` once per shape instead of once per call (region_agent.store.scripts).
    ``text``: the call's question's :class:`CallText` (a remembered question), or None."""

    __slots__ = ("rules", "text")
    rules: tuple[object, ...]
    text: CallText | None


class CallText:
    """What every asking of one remembered question sends alike (region_agent.decision.plan.Keyed):
    the script's name, the KEYS (the decision key too when the question stores no decision record)
    checked once, and — made by the store's packer at the first call, per script sha — the call's
    RESP text around the request's own strings (region_agent.store.resp). Only the member (the
    request id) and, for a recorded decision, its key are joined in per call. Shared, never
    changed but by the packer's memo (``sha`` and the texts, set together)."""

    __slots__ = ("argv_rules", "dk", "head", "keys", "lead", "name", "post", "question", "rest", "sha", "slack_ms",
                 "ttl_ms")

    def __init__(self, name: str, keys: list[str], dk: str | None, argv_rules: tuple[object, ...], slack_ms: int,
                 ttl_ms: int, question: str):
        self.name = name
        self.keys = keys  # KEYS with the decision key first (``dk``, or a placeholder per request: keys[1:] hold)
        self.dk = dk  # the decision key every asking shares (None: a recorded decision's, per request id)
        self.argv_rules = argv_rules
        self.slack_ms = slack_ms
        self.ttl_ms = ttl_ms
        self.question = question
        self.sha: str | None = None  # the script sha the texts were made for (region_agent.store.resp)
        self.lead = self.head = self.rest = self.post = ""


def call_text(calls: Sequence[Call], argv_rules: tuple[object, ...] | None, *, decision_key: str, slack_ms: int,
              decision_ttl_ms: int, question: str) -> CallText | None:
    """The :class:`CallText` of a remembered question's multi-rule call (``decision_key``: ''
    when each asking has its own, a recorded decision's); None when its calls are not a
    prechecked call's, or would be refused (a key listed twice: refused per call, as before)."""
    if argv_rules is None or not calls:
        return None
    rule_keys = [c.key for c in calls]
    if len(set(rule_keys)) != len(rule_keys):
        return None
    return CallText(script_for(argv_rules[::6]), [decision_key, *rule_keys], decision_key or None, argv_rules,
                    slack_ms, decision_ttl_ms, question)


class MultiRuleResult(NamedTuple):
    allowed: bool
    denied_by: int  # 1-based index into the rule slots, 0 = none
    retry_after_ms: int  # -1 = never
    remaining: tuple[int, ...]


_SCRIPT_OF: BoundedMemo[tuple[object, ...], str] = BoundedMemo(1024)


def script_for(kinds: tuple[object, ...], script: str = MULTI_RULE) -> str:
    """The script a call whose rule slots are of ``kinds`` (in slot order) runs: the lean variant
    of ``script`` (``multi_rule``, ``hot_chunk``) with only those kinds' libraries
    (region_agent.store.lua_loader: the same answers, less of the store's CPU per call)."""
    key = (script, *kinds)
    name = _SCRIPT_OF.get(key)
    if name is None:
        name = _SCRIPT_OF.put(key, variant_name(script, [str(k) for k in kinds]))
    return name


def multi_rule_argv(decision_key: str, rules: Sequence[Call], *, slack_ms: int, decision_ttl_ms: int,
                    member: str, question: str = "") -> tuple[list[str], list[str | int]]:
    """KEYS and ARGV for ``multi_rule.lua``. Shape errors raise :class:`ScriptRejected` here.
    ``question`` is stored with a decision record and compared on a replay."""
    if not 1 <= len(rules) <= MAX_RULES:
        raise ScriptRejected(f"a multi-rule call takes 1..{MAX_RULES} rules, got {len(rules)}")
    keys = [decision_key]
    argv: list[str | int] = [slack_ms, decision_ttl_ms, member]
    for r in rules:
        if r.kind not in KINDS:
            raise ScriptRejected(f"unknown rule kind {r.kind!r}")
        if len(r.params) != 5:
            raise ScriptRejected("each rule takes exactly five parameters")
        keys.append(r.key)
        argv.append(r.kind)
        argv.extend(r.params)
    if len(set(keys[1:])) != len(keys) - 1:
        raise ScriptRejected("the same key is listed for two rules")
    argv.append(question)
    return keys, argv


def multi_rule_call(rules: Sequence[Call], *, decision_key: str, slack_ms: int, decision_ttl_ms: int,
                    member: str, question: str = "") -> ScriptCall:
    keys, argv = multi_rule_argv(decision_key, rules, slack_ms=slack_ms, decision_ttl_ms=decision_ttl_ms,
                                 member=member, question=question)
    return (script_for(tuple(r.kind for r in rules)), keys, argv)


def prechecked_call(rules: Sequence[Call], argv_rules: tuple[object, ...], *, decision_key: str, slack_ms: int,
                    decision_ttl_ms: int, member: str, question: str = "") -> ScriptCall:
    """:func:`multi_rule_call` for slots whose shape was checked once (``argv_rules``: their kinds
    and parameters, from :func:`multi_rule_argv` per policy snapshot, selection and cost —
    region_agent.decision.plan.Shape); only the keys, which come with the request, are checked here.
    A remembered question's call is :func:`text_call` (its keys checked and its script named once)."""
    keys = [decision_key]
    for r in rules:
        keys.append(r.key)
    if len(keys) > 2 and len(set(keys[1:])) != len(keys) - 1:
        raise ScriptRejected("the same key is listed for two rules")
    argv = RuleArgv((slack_ms, decision_ttl_ms, member, *argv_rules, question))
    argv.rules = argv_rules
    argv.text = None
    return (script_for(argv_rules[::6]), keys, argv)  # a slot is its kind and five parameters


def _raise_error(reply: Any) -> None:
    """A pipeline slot holding an error (the store puts contract errors there) raises it."""
    if isinstance(reply, BaseException):
        raise reply if isinstance(reply, LeaseholdError) else StoreUnavailable(f"store error ({type(reply).__name__})")


_new_tuple = tuple.__new__


def parse_multi_rule(reply: Any) -> MultiRuleResult:
    """The script's reply — or the contract error in its pipeline slot, raised — as a result;
    raises :class:`DecisionConflict` for its conflict reply (allowed -1)."""
    if reply.__class__ is list and len(reply) >= 4:  # the common case first: a list of ints (hiredis)
        allowed = reply[0]
        if allowed.__class__ is int and allowed != CONFLICT:
            remaining = reply[3:]
            for x in remaining:
                if x.__class__ is not int:
                    break
            else:
                denied_by, retry = reply[1], reply[2]
                if denied_by.__class__ is int and retry.__class__ is int:
                    return _new_tuple(MultiRuleResult, (allowed != 0, denied_by, retry, tuple(remaining)))
    _raise_error(reply)
    if not isinstance(reply, list | tuple) or len(reply) < 4:
        raise ScriptRejected("unexpected reply shape from the multi-rule script")
    try:
        vals = list(map(int, reply))
    except (TypeError, ValueError):
        raise ScriptRejected("unexpected reply shape from the multi-rule script") from None
    if vals[0] == CONFLICT:
        raise DecisionConflict("requestId already has a decision for another question (tenant, principal, "
                               "route group or cost); use a fresh requestId")
    return MultiRuleResult(bool(vals[0]), vals[1], vals[2], tuple(vals[3:]))


# --- pool_take.lua: an in-process chunk bought from a fleet-wide pool balance ----------------------
class PoolTake(NamedTuple):
    taken: int  # tokens debited (0 = fewer than ``min`` were spendable; nothing written)
    remaining: int  # spendable after the take
    valid_for_ms: int  # the chunk must not outlive the leases it came from (0 when nothing taken)
    next_from_ms: int  # until the earliest not-yet-valid lease becomes valid (0 = none)
    # (lease id, tokens debited from it), earliest-expiring first: the most a refund may give back to each
    debits: tuple[tuple[str, int], ...] = ()


def pool_take_call(key: str, *, min_tokens: int, want: int, slack_ms: int, per_s: int = 0,
                   waiting: int = 0) -> ScriptCall:
    """``per_s`` > 0: at most that many tokens per second of the chunk's validity (a chunk taken
    from a lease that ends sooner holds no more than its holder can spend by then), but never fewer
    than ``waiting`` (the tokens of the requests waiting for the chunk: spent at once)."""
    return ("pool_take", [key], [min_tokens, want, slack_ms, per_s, waiting])


def parse_pool_take(reply: Any) -> PoolTake:
    """The reply ``{taken, remaining, valid_for_ms, next_from_ms, debits}`` (``debits`` a flat list
    lease id, tokens, ...; a four-element reply has none)."""
    _raise_error(reply)
    if not isinstance(reply, list | tuple) or len(reply) not in (4, 5):
        raise ScriptRejected("unexpected reply shape from pool_take")
    try:
        head = [int(x) for x in reply[:4]]
        flat = list(reply[4]) if len(reply) == 5 else []
        if len(flat) % 2:
            raise ValueError
        debits = tuple((_text(lid), int(n)) for lid, n in zip(flat[0::2], flat[1::2], strict=True))
    except (TypeError, ValueError):
        raise ScriptRejected("unexpected reply shape from pool_take") from None
    return PoolTake(head[0], head[1], head[2], head[3], debits)


def _text(x: Any) -> str:
    if isinstance(x, bytes):
        return x.decode()
    if isinstance(x, str):
        return x
    raise TypeError("not a lease id")


# --- pool_refund.lua: a chunk part's unspent rest given back to the leases it was bought from -----
class PoolRefund(NamedTuple):
    refunded: int  # tokens given back (by this call, or by the first call with this id: ``replay``)
    replay: bool  # the refund had already run: nothing changed


def pool_refund_call(key: str, record_key: str, *, tokens: int, slack_ms: int,
                     debits: Sequence[tuple[str, int]]) -> ScriptCall:
    """Give back up to ``tokens`` to the leases of ``debits`` (at most what was debited from each,
    latest-expiring first), once per ``record_key`` (the refund id)."""
    argv: list[Any] = [tokens, slack_ms]
    for lease_id, n in debits:
        argv += [lease_id, n]
    return ("pool_refund", [key, record_key], argv)


def parse_pool_refund(reply: Any) -> PoolRefund:
    _raise_error(reply)
    if not isinstance(reply, list | tuple) or len(reply) != 2:
        raise ScriptRejected("unexpected reply shape from pool_refund")
    try:
        status = _text(reply[1])
        if status not in ("refunded", "replay"):
            raise ValueError
        return PoolRefund(int(reply[0]), status == "replay")
    except (TypeError, ValueError):
        raise ScriptRejected("unexpected reply shape from pool_refund") from None


def text_call(text: CallText, argv_rules: tuple[object, ...], decision_key: str, slack_ms: int, decision_ttl_ms: int,
              member: str, question: str) -> ScriptCall:
    """The call of a remembered question (``text``: its keys checked and its script named once, as
    :func:`prechecked_call` checks them per call): only the ARGV is built
    (positional arguments: every remembered question's call comes here, from :func:`plan_calls`)."""
    argv = RuleArgv((slack_ms, decision_ttl_ms, member, *argv_rules, question))
    argv.rules = argv_rules
    argv.text = text
    # the shared KEYS (read-only, as every list a caller submits), or the recorded decision's own key first
    return (text.name, text.keys if text.dk is not None else [decision_key, *text.keys[1:]], argv)


# --- a plan's calls ------------------------------------------------------------------------------
def plan_calls(plan: Plan) -> list[ScriptCall]:
    """The script calls of ``plan``: the enforced rules' multi-rule call (with the decision
    record, when the request has one), then the shadow rules' (never a record); either may be absent."""
    calls = []
    if plan.calls:
        text = plan.text
        if text is not None:  # a remembered question (its text keeps the plan's argv_rules)
            calls.append(text_call(text, text.argv_rules, plan.decision_key, plan.slack_ms, plan.decision_ttl_ms,
                                   plan.request_id, plan.question))
        elif plan.argv_rules is not None:  # slots checked once per policy snapshot, selection and cost
            calls.append(prechecked_call(plan.calls, plan.argv_rules, decision_key=plan.decision_key,
                                         slack_ms=plan.slack_ms, decision_ttl_ms=plan.decision_ttl_ms,
                                         member=plan.request_id, question=plan.question))
        else:
            calls.append(multi_rule_call(plan.calls, decision_key=plan.decision_key, slack_ms=plan.slack_ms,
                                         decision_ttl_ms=plan.decision_ttl_ms, member=plan.request_id,
                                         question=plan.question))
    if plan.shadow_calls:
        calls.append(multi_rule_call(plan.shadow_calls, decision_key=plan.decision_key,
                                     slack_ms=max(r.rule.ttl_slack_ms for r in plan.shadow_slots),
                                     decision_ttl_ms=0, member=plan.request_id))
    return calls


def result_of(reply: Any) -> MultiRuleResult | LeaseholdError:
    """The multi-rule reply in a pipeline slot as a result, or the contract error it means."""
    try:
        return parse_multi_rule(reply)
    except LeaseholdError as e:
        return e
