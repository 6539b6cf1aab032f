"""The RLS door remembers a call's questions by its bytes (region_agent.gateways.rls.CallMemo,
region_agent.gateways.mapping.CallQuestions): a remembered call is asked again with fresh minted
request ids and every other field as built afresh; a call that names its request id is built
afresh every time (never remembered) and keeps it;
bytes that do not parse and refused calls are BadQuestion and never remembered; the memo is
bounded in calls and in the size of a call."""

from __future__ import annotations

import msgspec
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

from region_agent.gateways import rls
from region_agent.gateways.mapping import BadQuestion, Names, rls_call
from region_agent.gateways.rls import CallMemo, descriptors_of
from region_agent.models import AdmitRequest

D = ratelimit_pb2.RateLimitDescriptor
NAMES = Names.build()


def call(*descriptors: tuple[tuple[str, str], ...], domain: str = "leasehold", hits: int = 0) -> bytes:
    return rls_pb2.RateLimitRequest(domain=domain, hits_addend=hits, descriptors=[
        D(entries=[D.Entry(key=k, value=v) for k, v in entries]) for entries in descriptors]).SerializeToString()


USER = (("tenant", "atlas"), ("user", "U-17"), ("api_key", "K1"), ("route_group", "read"))
ANON = (("remote_address", "203.0.113.9"), ("route_group", "login"))
NAMED = (*USER, ("request_id", "req-12345678"))


def fresh(raw: bytes):
    """The questions built afresh from the bytes, as before any memo."""
    r = rls_pb2.RateLimitRequest.FromString(raw)
    return list(rls_call(NAMES, r.domain, descriptors_of(r, NAMES), r.hits_addend).questions)


def without_ids(qs) -> list:
    return [msgspec.structs.replace(q, request_id="-") for q in qs]


@pytest.mark.parametrize("raw", [call(USER), call(ANON, hits=3), call(USER, ANON), call(NAMED), call(NAMED, USER)],
                         ids=["user", "anonymous", "two", "named", "named-and-minted"])
def test_a_remembered_call_is_the_call_built_afresh_with_fresh_minted_ids(raw):
    memo = CallMemo(NAMES)
    asked = [memo.questions(raw) for _ in range(4)]
    names_an_id = b"req-12345678" in raw
    assert len(memo) == (0 if names_an_id else 1)  # a call that names its id is new each time
    for qs in asked:
        assert without_ids(qs) == without_ids(fresh(raw))
    n = len(asked[0])
    named = [i for i in range(n) if asked[0][i].request_id.startswith("req-12345678")]
    minted = [i for i in range(n) if i not in named]
    for i in named:  # an id the gateway named is the same every time: replays stay replays
        assert {qs[i].request_id for qs in asked} == {"req-12345678" if n == 1 else f"req-12345678:{i}"}
    for i in minted:  # a minted id is new every time: each call is its own decision
        ids = [qs[i].request_id for qs in asked]
        assert len(set(ids)) == len(ids)
        assert all(rid.startswith("rls-") for rid in ids)
        assert all(rid.endswith(f":{i}") if n > 1 else ":" not in rid for rid in ids)


def test_bytes_that_are_not_a_request_are_refused_and_not_remembered():
    memo = CallMemo(NAMES)
    for raw in (b"\xff\xff\xff", b"\x0a\x05le"):  # wire type 7; a string field cut short
        with pytest.raises(BadQuestion) as e:
            memo.questions(raw)
        assert e.value.reason == "undecodable" and e.value.status == 422
    assert len(memo) == 0


@pytest.mark.parametrize(("raw", "reason"), [
    (call(USER, domain="other"), "unknown_domain"),
    (call((("tenant", "atlas"), ("user", "U-1"))), "missing_route_group"),
    (call((*USER, ("header_match", "x"))), "unknown_key"),
])
def test_a_refused_call_is_refused_every_time_and_never_remembered(raw, reason):
    memo = CallMemo(NAMES)
    for _ in range(2):
        with pytest.raises(BadQuestion) as e:
            memo.questions(raw)
        assert e.value.reason == reason
    assert len(memo) == 0


def test_the_memo_is_bounded_in_calls_and_in_the_size_of_a_call():
    memo = CallMemo(NAMES, max_calls=3)
    for i in range(10):
        memo.questions(call((("tenant", "atlas"), ("user", f"U-{i}"), ("route_group", "read"))))
        assert len(memo) <= 3
    big = call(*[(("tenant", "atlas"), ("user", "U-" + "x" * 100), ("route_group", "read"))] * 8)
    assert len(big) > rls.MEMO_BYTES
    memo = CallMemo(NAMES)
    assert len(memo.questions(big)) == 8 and len(memo) == 0  # answered, not remembered


@pytest.mark.parametrize("raw", [call(USER), call(ANON, hits=3), call(NAMED), call(USER, ANON)],
                         ids=["user", "anonymous", "named", "two"])
def test_a_call_of_one_descriptor_is_asked_as_its_question_alone(raw):
    """``CallMemo.asked`` (the servicer's): a call of one question gives that question without a
    list, first asked and remembered alike, as ``questions`` would give it; several stay a list."""
    memo = CallMemo(NAMES)
    for _ in range(3):
        asked = memo.asked(raw)
        if len(fresh(raw)) == 1:
            assert isinstance(asked, AdmitRequest)
            assert without_ids([asked]) == without_ids(fresh(raw))
        else:
            assert isinstance(asked, list) and without_ids(asked) == without_ids(fresh(raw))
    if raw == call(USER):  # a minted id is new at each asking
        ids = {q.request_id for q in (memo.asked(raw) for _ in range(5)) if isinstance(q, AdmitRequest)}
        assert len(ids) == 5


def test_asked_again_only_the_minted_ids_change():
    r = rls_pb2.RateLimitRequest.FromString(call(NAMED, USER, ANON))
    built = rls_call(NAMES, r.domain, descriptors_of(r, NAMES), r.hits_addend)
    assert built.minted == (1, 2)
    again = built.again()
    assert [q.request_id for q in again][0] == built.questions[0].request_id == "req-12345678:0"
    assert all(again[i].request_id != built.questions[i].request_id and again[i].request_id.endswith(f":{i}")
               for i in (1, 2))
    assert without_ids(again) == without_ids(built.questions)


def test_a_call_of_many_descriptors_and_entries_is_read_only_as_far_as_it_can_be_accepted():
    """A gateway's call of a few MB of descriptors and entries (an attacker holding a gateway
    token) is refused for the cost of its parse: the descriptors are read as far as one past
    ``rls_max_descriptors`` and the entries one past the mapped keys, enough for the same reason."""
    r = rls_pb2.RateLimitRequest(domain="leasehold", descriptors=[D(entries=[
        D.Entry(key="tenant", value="atlas") for _ in range(2_000)]) for _ in range(500)])
    got = descriptors_of(r, NAMES)
    assert len(got) == NAMES.rls_max_descriptors + 1
    assert {len(d.entries) for d in got} == {len(NAMES.rls_fields) + 1}
    one = rls_pb2.RateLimitRequest(domain="leasehold", descriptors=[D(entries=[
        *(D.Entry(key=k, value="v") for k in NAMES.rls_fields), *(D.Entry(key="x", value="") for _ in range(5_000))])])
    assert [len(d.entries) for d in descriptors_of(one, NAMES)] == [len(NAMES.rls_fields) + 1]
    memo = CallMemo(NAMES)
    for raw, reason in ((r.SerializeToString(), "too_many_descriptors"), (one.SerializeToString(), "unknown_key"),
                        (rls_pb2.RateLimitRequest(domain="leasehold", descriptors=[r.descriptors[0]])
                         .SerializeToString(), "duplicate_key")):
        with pytest.raises(BadQuestion) as e:
            memo.questions(raw)
        assert e.value.reason == reason
