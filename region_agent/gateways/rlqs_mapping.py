"""Envoy's rate limit quota service (RLQS) in Leasehold's words. Pure: no I/O, no protobuf, no clock.

Envoy's quota filter groups requests into **buckets**: a bucket id is a map of entries the filter
builds from each request (in the shipped ``deploy/gateways/envoy-rlqs.yaml``: the verified
identity's headers and the route's constant route group). The agent answers a bucket with a
quota assignment Envoy enforces locally. Here:

* :class:`RlqsNames` — which bucket id key carries which field of the question (agent settings
  ``--rlqs-keys``, by default the names of the RLS descriptor keys);
* :func:`bucket_question` — a bucket id as the Leasehold question it stands for (an
  :class:`~region_agent.models.AdmitRequest`, the same schema as ``POST /v1/admit``). Refused,
  never guessed (:class:`~region_agent.gateways.mapping.BadQuestion` with a stable reason): another
  domain, a key that is not mapped, a key given twice, a malformed value, no principal, no tenant,
  no route group;
* :func:`per_request_reason` — rules an assignment cannot carry: a concurrency gate (a slot per
  request in flight, released at its end), an idempotent rule (a decision record per request id)
  and an exempt rule (a bypass audited per request) are decided per request (RLS or forward auth);
* :func:`assignment_ttl` — how long an assignment may live: never past the end of a window its
  tokens came from (fixed-window rules, pools), at most ``--rlqs-max-ttl-s``, in whole seconds
  (Envoy's unit).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kernel.bound import RLQS_TTL_GRANULARITY_MS, rlqs_clamped
from kernel.bundle import Rule

from ..models import AdmitRequest
from .mapping import RLS_DEFAULT_KEYS, BadQuestion, check_cost, parse_names, question

RLQS_FIELDS = ("tenant", "user", "service", "api_key", "route_group")
RLQS_DEFAULT_KEYS: dict[str, str] = {f: RLS_DEFAULT_KEYS[f] for f in RLQS_FIELDS}
BUCKET_KEY_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}")
MAX_ENTRIES = 16
MAX_VALUE = 256

BucketKey = tuple[tuple[str, str], ...]  # a bucket id's entries, sorted by key


@dataclass(frozen=True, slots=True)
class RlqsNames:
    domain: str
    keys: dict[str, str]  # field -> bucket id key
    fields: dict[str, str]  # bucket id key -> field

    @classmethod
    def build(cls, *, domain: str = "leasehold", keys: Iterable[str] = ()) -> RlqsNames:
        k = parse_names(keys, RLQS_DEFAULT_KEYS, BUCKET_KEY_RE, "rlqs key")
        return cls(domain=domain, keys=k, fields={v: f for f, v in k.items()})

    @classmethod
    def from_settings(cls, s) -> RlqsNames:
        return cls.build(domain=s.rlqs_domain or s.rls_domain, keys=s.rlqs_keys)


def bucket_key(entries: Iterable[tuple[str, str]]) -> BucketKey:
    """A bucket id's entries as a hashable key (sorted; a protobuf map has no order). Bounded:
    at most 16 entries of at most 256 characters each, else refused (``bad_bucket``)."""
    out = tuple(sorted(entries))
    if not out or len(out) > MAX_ENTRIES or any(len(k) > MAX_VALUE or len(v) > MAX_VALUE for k, v in out):
        raise BadQuestion("bad_bucket", f"a bucket id needs 1 to {MAX_ENTRIES} entries of at most {MAX_VALUE} "
                                        "characters")
    return out


def bucket_question(names: RlqsNames, domain: str, key: BucketKey, *, cost: int, request_id: str) -> AdmitRequest:
    """The question a bucket stands for, asked for ``cost`` requests at once (an assignment's
    tokens). Raises :class:`BadQuestion` (module doc)."""
    if domain != names.domain:
        raise BadQuestion("unknown_domain", f"domain {domain[:64]!r} is not {names.domain!r}")
    fields: dict[str, str] = {}
    for k, v in key:
        field = names.fields.get(k)
        if field is None:
            raise BadQuestion("unknown_key", f"bucket id key {k[:64]!r} is not mapped")
        if field in fields:
            raise BadQuestion("duplicate_key", f"bucket id key {k[:64]!r} given twice")
        fields[field] = v
    if "user" not in fields and "service" not in fields:
        raise BadQuestion("missing_principal", "a bucket needs a verified user or service principal "
                                               "(anonymous requests are decided per request)")
    return question(fields, cost=check_cost(cost), request_id=request_id)


def per_request_reason(rules: Iterable[Rule]) -> str | None:
    """Why a bucket governed by ``rules`` cannot be answered with an assignment (a stable
    reason), or None when it can."""
    for r in rules:
        if r.concurrency_max is not None:
            return "concurrency_rule"
        if r.idempotent:
            return "idempotent_rule"
        if r.exempt:
            return "exempt_rule"
    return None


class WindowEnd(NamedTuple):
    """A window an assignment's tokens come from: its length and how long it surely lasts from
    now (0: which window it is is not certain now)."""

    window_ms: int
    end_in_ms: int


class Ttl(NamedTuple):
    seconds: int  # the assignment's time to live (0: none can be made now)
    wait_ms: int  # with seconds 0: when a new window begins
    clamp_ms: float  # from now, the end of the windows the tokens came from (inf: no window)
    clamped: bool  # every window is long enough to end the assignment in it (kernel.bound.rlqs_clamped)


def assignment_ttl(windows: Sequence[WindowEnd], *, max_ttl_s: int, margin_ms: int) -> Ttl:
    """The time to live of an assignment funded now from ``windows``: at most ``max_ttl_s``, and
    ending ``margin_ms`` before the first window end. In the last second of a window none can be
    made (Envoy counts whole seconds): wait for the next window. A window too short for that
    (:func:`kernel.bound.rlqs_clamped`) does not clamp: the assignment lives at most one window
    (rounded up to a second) and the bound counts it as RLQS carry."""
    limit = max_ttl_s * 1_000.0
    clamp = float("inf")
    wait = 0
    clamped = True
    for w in windows:
        if not rlqs_clamped(w.window_ms, margin_ms):
            clamped = False
            limit = min(limit, max(RLQS_TTL_GRANULARITY_MS, w.window_ms))
            continue
        usable = w.end_in_ms - margin_ms
        if usable < RLQS_TTL_GRANULARITY_MS:
            wait = max(wait, w.end_in_ms + 1)
            continue
        clamp = min(clamp, usable)
    if wait:
        return Ttl(0, wait, 0.0, clamped)
    limit = min(limit, clamp)
    return Ttl(int(limit // RLQS_TTL_GRANULARITY_MS), 0, clamp, clamped)


def fixed_window_end(window_ms: int, wall_ms: float) -> WindowEnd:
    """A fixed window aligned on Unix time (as the scripts align them on the store's clock)."""
    return WindowEnd(window_ms, int(window_ms - wall_ms % window_ms))


def entries_of(mapping: Mapping[str, str]) -> BucketKey:
    return bucket_key(mapping.items())


__all__ = ["RLQS_DEFAULT_KEYS", "RLQS_FIELDS", "BucketKey", "RlqsNames", "Ttl", "WindowEnd", "assignment_ttl",
           "bucket_key", "bucket_question", "entries_of", "fixed_window_end", "per_request_reason"]
