"""The agent's spans (kernel.tracing; nothing here runs while tracing is off):

* ``leasehold.decision`` per decision a door asks for, child of the gateway's span when the
  question carried a ``traceparent`` (HTTP header or RLS metadata): the door, the route group,
  the deciding rule and policy version, the outcome, HTTP status and ``decision.source``;
* ``leasehold.script`` per script call batch the decision sends to Redis: the script, the
  number of calls and the shard (``default`` for a standalone Redis, the primary's
  ``host:port`` in a cluster);
* ``leasehold.lease_request`` per allocator call (region_agent.leasing.client): a top-up that a
  decision started is that decision's child, and its ``traceparent`` goes to the allocator.

Log lines written during a traced decision carry its ``decision_id``, ``trace_id`` and
``span_id`` (kernel.logs)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from kernel import tracing
from kernel.logs import CURRENT_DECISION

T = TypeVar("T")


async def decision(door: str, pairs: Iterable[tuple[Any, Any]], request_id: str | None,
                   fn: Callable[..., Awaitable[T]], *args: Any, **kw: Any) -> T:
    """``await fn(*args, **kw)`` (one decision, or a list of them) inside a ``leasehold.decision``
    span whose parent is the trace context among ``pairs`` (headers or metadata)."""
    if not tracing.ENABLED:
        return await fn(*args, **kw)
    with tracing.span("leasehold.decision", kind=tracing.SpanKind.SERVER, parent=tracing.context_of(pairs),
                      attributes={"leasehold.door": door}) as s:
        token = CURRENT_DECISION.set(request_id)
        try:
            out = await fn(*args, **kw)
        finally:
            CURRENT_DECISION.reset(token)
        annotate(s, out)
        return out


def annotate(span: Any, out: Any) -> None:
    """The decision's fields on ``span`` (for several: the first denial's, else the first's)."""
    ds = out if isinstance(out, list) else [out]
    if not ds or not hasattr(ds[0], "allowed"):
        return
    d = next((x for x in ds if not x.allowed), ds[0])
    span.set_attributes({
        "leasehold.decision_id": d.decision_id, "leasehold.allowed": d.allowed,
        "leasehold.outcome": outcome_of(d), "decision.source": str(d.source),
        "leasehold.rule": d.rule_id or "none", "leasehold.policy_version": d.bundle_version,
        "http.response.status_code": d.http_status, "leasehold.fallback": d.fallback,
        "leasehold.reason": str(d.reason) if d.reason else "", "leasehold.decisions": len(ds)})


def outcome_of(d: Any) -> str:
    if d.allowed:
        return "fallback_allowed" if d.fallback else "allowed"
    if d.http_status == 503:
        return "unavailable"
    return "fallback_denied" if d.fallback else "denied"


class TracedStore:
    """The store with a ``leasehold.script`` span around every script call batch; everything else
    is the store's own (installed by the app only while tracing is on)."""

    def __init__(self, store: Any):
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def submit(self, calls: list, wait_s: float) -> Any:
        store = self._store
        first_key = calls[0][1][0] if calls and calls[0][1] else ""
        shard = store.shard_of(first_key) if getattr(store, "cluster", False) and first_key else "default"
        with tracing.span("leasehold.script", kind=tracing.SpanKind.CLIENT, attributes={
                "db.system": "redis", "leasehold.script": calls[0][0] if calls else "", "leasehold.calls": len(calls),
                "leasehold.shard": shard}) as s:
            try:
                return await store.submit(calls, wait_s=wait_s)
            except Exception as e:
                s.set_attribute("error.type", type(e).__name__)
                raise


__all__ = ["TracedStore", "annotate", "decision", "outcome_of"]
