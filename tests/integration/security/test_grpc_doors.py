"""The agent's gRPC port (``--rls-port``: RLS, RLQS, health) attacked as a process in the mesh
would, through a real agent process: with grpcio, and with a hand-written HTTP/2 client
(tests/support/h2raw.py) for what grpcio never does — streams opened and never given their
message, calls whose answers are never taken.

The port's slots (``--rls-max-concurrent-rpcs``) were grpc's own count of every call open on
the port, whatever its method, from its headers until its answer was taken: a client without any
credential took them all with streams it never finished — half-open calls, calls with no message,
health ``Watch`` streams — and a gateway with calls whose answers it never read (an HTTP/2
window of 0). Every RLS call was then ``RESOURCE_EXHAUSTED`` (the shipped Envoy files let the
read routes through without a decision: ``failure_mode_deny: false``) and no RLQS stream opened,
for as long as the client kept its connection. A slot is now the agent's: an authenticated RLS
call while it is decided, an RLQS stream while it is open."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from leasehold.local.procs import LOOPBACK, Proc, RedisServer, free_port, wait_http_ready, wait_port
from leasehold.local.services import agent_command
from tests.support.h2raw import MAX_CONCURRENT_STREAMS, RawConnection
from tests.support.policies import NORTHSTAR, ROOT

pytestmark = pytest.mark.integration

TOKEN = "gw-token-grpc-doors-0123456789"
META = (("authorization", f"Bearer {TOKEN}"),)
SLOTS = 48  # --rls-max-concurrent-rpcs of the agent under attack
STREAMS = 4  # --rlqs-max-streams
PER_CONNECTION = 40  # --rls-max-streams-per-connection
KEEPALIVE_MS = 2_000  # --rls-keepalive-ms
RLS = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
RLQS = "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas"
D = ratelimit_pb2.RateLimitDescriptor


@dataclass
class Agent:
    proc: Proc
    http_port: int
    rls_port: int

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in httpx.get(f"http://{LOOPBACK}:{self.http_port}/metrics", timeout=5).text.splitlines():
            if line.startswith((name + "{", name + " ")):
                head, _, value = line.rpartition(" ")
                if all(f'{k}="{v}"' in head for k, v in labels.items()):
                    total += float(value)
        return total

    def log(self) -> str:
        assert self.proc.log_path is not None
        return self.proc.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    work = Path(tmp_path_factory.mktemp("grpc-doors"))
    redis = RedisServer(work / "redis").start()
    http_port, rls_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = Proc("agent", agent_command(
        "--log-level", "info", "--rls-max-concurrent-rpcs", str(SLOTS), "--rlqs-max-streams", str(STREAMS),
        "--rls-max-streams-per-connection", str(PER_CONNECTION), "--rls-keepalive-ms", str(KEEPALIVE_MS),
        redis_url=redis.url, policy=NORTHSTAR, region="eu", host=LOOPBACK, port=http_port, rls_port=rls_port,
        policy_poll_ms=0, insecure_dev_pepper=True, auth_disabled=False,
        gateway_tokens=["edge:" + hashlib.sha256(TOKEN.encode()).hexdigest()]), work / "agent", env=env).start()
    try:
        wait_http_ready({f"http://{LOOPBACK}:{http_port}": proc}, timeout=60)
        wait_port(rls_port, proc=proc.popen, timeout=30)
        yield Agent(proc, http_port, rls_port)
    finally:
        proc.stop()
        redis.stop()


def question(user: str) -> rls_pb2.RateLimitRequest:
    return rls_pb2.RateLimitRequest(domain="leasehold", descriptors=[D(entries=[
        D.Entry(key="tenant", value="atlas"), D.Entry(key="user", value=user), D.Entry(key="route_group", value="read")])])


def ask(agent: Agent, user: str) -> rls_pb2.RateLimitResponse:
    with grpc.insecure_channel(f"{LOOPBACK}:{agent.rls_port}") as ch:
        return rls_pb2_grpc.RateLimitServiceStub(ch).ShouldRateLimit(question(user), metadata=META, timeout=10)


def open_rlqs_stream(agent: Agent, user: str) -> rlqs_pb2.RateLimitQuotaResponse:
    """An RLQS stream that reports one bucket and reads its first answer."""
    report = rlqs_pb2.RateLimitQuotaUsageReports(domain="leasehold")
    report.bucket_quota_usages.add(num_requests_denied=1).bucket_id.bucket.update(
        {"tenant": "atlas", "user": user, "route_group": "read"})
    answered = threading.Event()

    def reports() -> Iterator[rlqs_pb2.RateLimitQuotaUsageReports]:
        yield report
        answered.wait(10)  # the stream stays open until its answer is read

    with grpc.insecure_channel(f"{LOOPBACK}:{agent.rls_port}") as ch:
        call = rlqs_pb2_grpc.RateLimitQuotaServiceStub(ch).StreamRateLimitQuotas(reports(), metadata=META, timeout=10)
        try:
            return next(call)
        finally:
            answered.set()
            call.cancel()


def test_streams_that_never_finish_their_question_take_no_slot(agent: Agent):
    """Without any credential: more streams than the port has slots, spread over connections,
    none of which ever becomes a question — headers alone, a call with no message, health Watch
    streams (they never end). Before, each kind alone took every slot: RLS calls
    RESOURCE_EXHAUSTED, no RLQS stream opened. Now the gateway's calls and streams are served."""
    conns: list[RawConnection] = []
    try:
        for _ in range(2):  # headers alone: the message never comes
            c = RawConnection(agent.rls_port)
            c.open(PER_CONNECTION, RLS)
            conns.append(c)
        c = RawConnection(agent.rls_port)  # half-closed at once, no message at all
        c.open(PER_CONNECTION, RLS, end=True)
        conns.append(c)
        c = RawConnection(agent.rls_port)  # headers alone on the quota stream
        c.open(PER_CONNECTION, RLQS)
        conns.append(c)
        time.sleep(1.0)  # the server has taken them all
        resp = ask(agent, "U-slots")
        assert resp.overall_code == resp.OK
        assert open_rlqs_stream(agent, "U-slots-q").bucket_action
    finally:
        for c in conns:
            c.close()


def test_health_watch_is_not_served(agent: Agent):
    """A Watch stream never ends and needs no credential; nothing that checks an agent's health
    uses it (Envoy's and Kubernetes' gRPC checks call Check)."""
    with grpc.insecure_channel(f"{LOOPBACK}:{agent.rls_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        assert stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            next(stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_calls_whose_answers_are_never_taken_hold_no_slot(agent: Agent):
    """A gateway (it holds the token) that asks and never takes an answer (its HTTP/2 window is
    0: no answer's message can be sent). Each call is decided; its answer waits in grpc, bounded
    per connection, and no longer holds one of the port's slots."""
    before = agent.metric("leasehold_agent_rls_requests_total")
    conns = []
    try:
        for _ in range(2):
            c = RawConnection(agent.rls_port, window=0)
            c.open(PER_CONNECTION, RLS, token=TOKEN, message=question("U-unread").SerializeToString())
            conns.append(c)
        deadline = time.monotonic() + 15
        while agent.metric("leasehold_agent_rls_requests_total") - before < 2 * PER_CONNECTION:
            assert time.monotonic() < deadline, "the calls were not all decided"
            time.sleep(0.1)
        resp = ask(agent, "U-unread-other")
        assert resp.overall_code == resp.OK
        assert open_rlqs_stream(agent, "U-unread-q").bucket_action
    finally:
        for c in conns:
            c.close()
    assert "Traceback" not in agent.log()


def test_one_connection_holds_at_most_its_streams(agent: Agent):
    """The port announces ``--rls-max-streams-per-connection`` (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS):
    what one connection can make the agent hold is bounded, however it behaves."""
    c = RawConnection(agent.rls_port)
    try:
        assert c.settings().get(MAX_CONCURRENT_STREAMS) == PER_CONNECTION
    finally:
        c.close()


def test_a_peer_that_answers_no_ping_loses_its_connection_and_its_streams(agent: Agent):
    """An RLQS stream whose Envoy is gone without a word (its host lost, a partition that never
    heals) or reads nothing any more held one of ``--rlqs-max-streams`` and a slot of the port
    for ever: nothing on the port noticed a peer that stopped answering. The port pings every
    connection each ``--rls-keepalive-ms``; a peer that answers none within as long is cut
    off, and its streams end."""
    c = RawConnection(agent.rls_port)  # answers nothing: it never reads
    try:
        c.open(1, RLQS, token=TOKEN)  # an open stream, as an Envoy holds one
        deadline = time.monotonic() + 10
        while agent.metric("leasehold_agent_rlqs_streams") < 1:
            assert time.monotonic() < deadline, "the stream did not open"
            time.sleep(0.05)
        opened = time.monotonic()
        while agent.metric("leasehold_agent_rlqs_streams") > 0:
            assert time.monotonic() - opened < 5 * KEEPALIVE_MS / 1000, "the silent peer kept its stream"
            time.sleep(0.1)
        assert time.monotonic() - opened >= KEEPALIVE_MS / 1000  # after a ping went unanswered, not before
    finally:
        c.close()


def test_a_quota_stream_message_that_is_not_a_report_is_invalid_argument(agent: Agent):
    """Bytes that are not a ``RateLimitQuotaUsageReports`` ended the stream with status OK, as if
    the client had closed it (the parse failure ended the reading task silently); now
    ``INVALID_ARGUMENT``, as an RLS call's bytes that do not parse are, and counted."""
    before = agent.metric("leasehold_agent_rlqs_refused_total", reason="undecodable")
    with grpc.insecure_channel(f"{LOOPBACK}:{agent.rls_port}") as ch:
        for garbage in (b"\xff\xff\xff\xff", b"\x12\x03\x0a\x01\xff"):  # no message; a bucket id of bad UTF-8
            with pytest.raises(grpc.RpcError) as e:
                list(ch.stream_stream(RLQS)(iter([garbage]), metadata=META, timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert agent.metric("leasehold_agent_rlqs_refused_total", reason="undecodable") - before == 2
    assert "Traceback" not in agent.log()


def test_calls_grpc_refuses_before_the_agent_write_nothing_to_its_log(agent: Agent):
    """grpc's core wrote one ERROR line to the agent's log for every call with a ``grpc-encoding``
    it does not know (``hpack_parser.cc ... Error parsing 'grpc-encoding' metadata``), before any
    credential was looked at: a client wrote as many lines as it sent calls. grpc still refuses
    them (``INTERNAL``, its own answer, before the agent); the core's lines are off unless
    ``GRPC_VERBOSITY`` says otherwise."""
    from tests.support.h2raw import DATA, END_HEADERS, END_STREAM, HEADERS, frame, header_block

    lines = len(agent.log().splitlines())
    c = RawConnection(agent.rls_port)
    try:
        head = header_block([(":method", "POST"), (":scheme", "http"), (":path", RLS), (":authority", "agent"),
                             ("content-type", "application/grpc"), ("te", "trailers"), ("grpc-encoding", "br")])
        c.sock.sendall(b"".join(frame(HEADERS, END_HEADERS, 1 + 2 * i, head) +
                                frame(DATA, END_STREAM, 1 + 2 * i, b"\x01\x00\x00\x00\x01x") for i in range(20)))
        # each call's refusal, however long a loaded machine takes to send them (bounded)
        answers = [f for f in c.frames(10.0, until=lambda fs: sum(f[0] == HEADERS for f in fs) >= 20)
                   if f[0] == HEADERS]
        assert len(answers) == 20 and all(b"grpc-status" in f[3] for f in answers)  # each refused by grpc
    finally:
        c.close()
    assert resp_ok(agent)
    added = agent.log().splitlines()[lines:]
    assert not [x for x in added if "grpc-encoding" in x], added[:3]


def resp_ok(agent: Agent) -> bool:
    return ask(agent, "U-after-noise").overall_code == rls_pb2.RateLimitResponse.OK


def test_a_ping_flood_is_told_to_calm_down_and_the_port_keeps_answering(agent: Agent):
    """grpc's enforcement of client pings stays on beside the port's own keepalive: a client that
    pings without end gets GOAWAY ``ENHANCE_YOUR_CALM`` (``too_many_pings``) and its connection
    closed, after a bounded number of them; others are answered."""
    import struct

    from tests.support.h2raw import GOAWAY, PING, frame

    c = RawConnection(agent.rls_port)
    try:
        sent = 0
        with contextlib.suppress(OSError):
            for i in range(5_000):
                c.sock.sendall(frame(PING, 0, 0, struct.pack(">Q", i)))
                sent += 1
        goaways = [f for f in c.frames(10.0, until=lambda fs: any(f[0] == GOAWAY for f in fs)) if f[0] == GOAWAY]
        assert goaways and struct.unpack(">I", goaways[0][3][4:8])[0] == 0xB  # ENHANCE_YOUR_CALM
        assert goaways[0][3][8:] == b"too_many_pings"
    finally:
        c.close()
    assert resp_ok(agent)
