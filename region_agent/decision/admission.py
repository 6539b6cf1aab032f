"""The one admission every door asks: ``POST /v1/admit`` and ``/v1/admit/batch`` (the Litestar
handlers and the ASGI fast path, region_agent.service.fastpath), forward auth ``/v1/authz`` and Envoy's
rate limit service (region_agent.gateways).

:meth:`Admission.decide` takes decoded questions and returns one decision per question, in
order. It runs the stage every door needs before the engine, then the engine:

1. a failed authentication becomes an anonymous question from the caller's address (only
   ip-scoped rules apply: the claimed tenant is never charged);
2. the gateway's ``policyEpoch`` is compared with the bundle in force (counted; a newer one
   makes the agent look at its bundle source);
3. past the bundle's ``maxAgeMs``, a revocable rule answers ``POLICY_STALE`` (I13);
4. the new-keys-per-source cap of the pre-authentication stage (region_agent.decision.preauth);
5. :meth:`DecisionEngine.admit` for one question, :meth:`DecisionEngine.admit_many` for several
   (one pipeline).

Every door names itself (``door``: ``http`` for ``/v1/admit`` and its batch, ``authz``, ``rls``, ``rlqs``)
and hands over what its gateway sent as trace context (``carrier``: ASGI header pairs or gRPC
metadata): while tracing is on, the decisions of one call are made inside one
``leasehold.decision`` span (region_agent.service.tracing), child of the gateway's span. The doors
trace nothing themselves.

**Every question it can answer gets a decision; none raises.** A request id that already has a
decision record for another question is a decision too (``reason: REQUEST_ID_CONFLICT``,
``httpStatus: 409``, not admitted, nothing charged). What each door makes of it is the door's
business: ``/v1/admit`` answers 409 (:func:`http_conflict`), a batch item carries it, forward
auth answers 409, and the rate limit service answers ``OVER_LIMIT`` — a gateway's failure mode
(Envoy's ``failure_mode_deny: false``) never sees an error it would turn into an allow.

What still raises is what is not a question it can answer: a value the schema let through but
the keys refuse (:class:`~kernel.errors.ValidationFailed`, e.g. ``authFailed`` without
``clientIp``) and an agent that is still starting (:class:`~kernel.errors.Unavailable`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from kernel import tracing
from kernel.errors import DecisionConflict, Unavailable

from ..models import AdmitRequest, Decision, Reason
from ..service.tracing import decision as traced_decision

Carrier = Iterable[tuple[Any, Any]]  # a gateway's headers (ASGI pairs) or gRPC metadata


def pre_decided(st: Any, reqs: list[AdmitRequest]) -> tuple[list[AdmitRequest], list[Decision | None] | None]:
    """Steps 1-4 of the module doc for several questions, as two lists: the questions the engine
    gets, and per question the decision already made (None: the engine's to make), or None in
    place of that list when no question has one (the common batch or group: nothing to merge
    afterwards)."""
    from .preauth import as_failed_auth

    reqs = [as_failed_auth(r) if r.auth_failed else r for r in reqs]
    w, snap = st.policy_watch, st.holder.snapshot
    bundle = snap.bundle
    if st.version_check is not None:
        for r in reqs:
            if r.bundle_version is not None:
                st.version_check.observe(r.bundle_version, bundle.bundle_version)
    early: list[Decision | None] | None = None
    if w is not None and w.is_stale(bundle):
        from ..service.policy_watch import revoked_decision
        early = [revoked_decision(snap, r, st.metrics) for r in reqs]
    cap = st.key_cap
    if cap is not None:
        m = st.metrics
        early = ([cap.check(snap, r, m) for r in reqs] if early is None else
                 [d if d is not None else cap.check(snap, r, m) for r, d in zip(reqs, early, strict=True)])
    if early is not None and early.count(None) == len(early):
        early = None
    return reqs, early


def pre_check(st: Any, req: AdmitRequest) -> tuple[AdmitRequest, Decision | None]:
    """:func:`pre_decided` of one question, without the lists (the common single admission)."""
    if req.auth_failed:
        from .preauth import as_failed_auth
        req = as_failed_auth(req)
    snap = st.holder.snapshot
    bundle = snap.bundle
    if st.version_check is not None and req.bundle_version is not None:
        st.version_check.observe(req.bundle_version, bundle.bundle_version)
    w = st.policy_watch
    if w is not None and w.is_stale(bundle):
        from ..service.policy_watch import revoked_decision
        revoked = revoked_decision(snap, req, st.metrics)
        if revoked is not None:  # else the pre-authentication cap still applies (as in pre_decided)
            return req, revoked
    if st.key_cap is not None:
        return req, st.key_cap.check(snap, req, st.metrics)
    return req, None


class Admission:
    """The agent's one admission (module doc). ``state_of()`` returns the agent's state
    (region_agent.service.app.AgentState: engine, policy holder and watch, version check, key cap)."""

    __slots__ = ("_state_of",)

    def __init__(self, state_of: Callable[[], Any]):
        self._state_of = state_of

    def decide(self, reqs: list[AdmitRequest], *, door: str, carrier: Carrier = (),
               decoded: bool = False) -> Awaitable[list[Decision]]:
        """One decision per question of ``reqs``, in order, asked at ``door`` (module doc).
        ``decoded``: the questions came out of the strict wire decoder (their id patterns were
        checked). The awaitable is the decision's own coroutine, not one wrapped around it (one
        frame less per call or group); nothing runs before it is awaited."""
        if tracing.ENABLED:
            return traced_decision(door, carrier, reqs[0].request_id if reqs else None, self._decide, reqs, decoded)
        return self._decide(reqs, decoded)

    def decide_one(self, req: AdmitRequest, *, door: str, carrier: Carrier = (),
                   decoded: bool = False) -> Awaitable[Decision]:
        """:meth:`decide` of one question (the common case: no list of results built). Without
        tracing, the stage before the engine runs here, at the call, and the awaitable is the
        engine's own coroutine (:meth:`DecisionEngine.admit`): no frame of the admission's stays
        between the caller and the engine while the decision waits for its store. Every caller
        awaits it at once, so what the call raises (an agent still starting) reaches it as before."""
        if tracing.ENABLED:
            return traced_decision(door, carrier, req.request_id, self._decide_one, req, decoded)
        return self._admit_one(req, decoded)

    async def _decide(self, reqs: list[AdmitRequest], decoded: bool) -> list[Decision]:
        st = self._state_of()
        engine = st.engine
        if engine is None:
            raise Unavailable("agent is starting")
        if not reqs:
            return []
        if len(reqs) == 1:  # one RLS descriptor, one forward-auth question: no lists
            req, early = pre_check(st, reqs[0])
            return [early if early is not None else await engine.admit(req, decoded=decoded)]
        reqs, made = pre_decided(st, reqs)
        if made is None:  # no question decided before the engine (the common group): its decisions as they are
            together: list[Decision] = await engine.admit_many(reqs, decoded=decoded)
            return together
        rest = [r for r, d in zip(reqs, made, strict=True) if d is None]
        if not rest:
            return made  # type: ignore[return-value]  # no None left: rest is empty
        if len(rest) == 1:
            decided = iter([await engine.admit(rest[0], decoded=decoded)])
        else:
            decided = iter(await engine.admit_many(rest, decoded=decoded))
        return [d if d is not None else next(decided) for d in made]

    async def _decide_one(self, req: AdmitRequest, decoded: bool) -> Decision:
        return await self._admit_one(req, decoded)

    def _admit_one(self, req: AdmitRequest, decoded: bool) -> Awaitable[Decision]:
        """The stage before the engine of one question, now; the engine's coroutine of its
        decision (or the decision the stage made)."""
        st = self._state_of()
        engine = st.engine
        if engine is None:
            raise Unavailable("agent is starting")
        req, early = pre_check(st, req)
        return engine.admit(req, decoded=decoded) if early is None else _made(early)


async def _made(d: Decision) -> Decision:
    """A decision the stage before the engine made, as the awaitable :meth:`Admission.decide_one` returns."""
    return d


def is_conflict(d: Decision) -> bool:
    return d.reason == Reason.REQUEST_ID_CONFLICT


def http_conflict(d: Decision) -> DecisionConflict:
    """``/v1/admit``'s answer to a conflict decision: the 409 problem (kernel.http_errors)."""
    detail = d.problem.get("detail") if d.problem else None
    return DecisionConflict(detail or "requestId conflict", extra={"decisionId": d.decision_id})


__all__ = ["Admission", "http_conflict", "is_conflict", "pre_check", "pre_decided"]
