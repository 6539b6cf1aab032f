"""``POST /v1/admit`` and ``/v1/admit/batch`` answered by the HTTP protocol itself (the direct
routes of kernel.httpserver, region_agent.service.fastpath.DirectAdmit), attacked through a real
agent process on loopback with raw sockets, as a hostile client would: pipelining, the same
question on the direct and the normal lane, HTTP/1.0 and ``Connection: close``, slow bodies and
vanishing clients, request smuggling, credentials, content types, announced lengths, and a
client that never reads its answers (write backpressure).

A request takes the direct route when it arrives on a connection with nothing in flight and its
head qualifies; the same request is forced onto the normal lane (uvicorn's ASGI cycle, the ASGI
fast path or the Litestar handler) by a query string, a chunked body, ``Expect: 100-continue``
or by pipelining it behind a ``GET``. Every answer is read framed by its own length (conftest's
``Wire``), so an answer cut short, two answers run together or an answer to a request the client
never sent fails the read."""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import socket
import struct
import time
from collections.abc import Callable, Iterator

import pytest

from tests.support.agent import admit_body

from .conftest import TOKEN, WAIT_S, Answer, Service, Wire, rss_kib

pytestmark = pytest.mark.integration

AUTH = f"Bearer {TOKEN}"
MAX_BODY = 16 * 1024  # region_agent.models.MAX_BODY_BYTES: /v1/admit's body limit
MAX_BATCH_BODY = 1024 * 1024  # MAX_BATCH_BODY_BYTES
HEALTHZ = b"GET /healthz HTTP/1.1\r\nhost: leasehold\r\n\r\n"


def uid(tag: str) -> str:
    """A request (or principal) id no other test uses: the agent's Redis lives for the package."""
    return f"dl-{tag}-{secrets.token_hex(4)}"


def encode(body: bytes | dict) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()


def post(body: bytes | dict, target: str = "/v1/admit", *, head: tuple[str, ...] = (), auth: str | None = AUTH,
         ctype: str | None = "application/json", length: str | None = "auto", version: str = "1.1") -> bytes:
    """A raw POST: the head as written (``None`` leaves a header out), then the body as given."""
    data = encode(body)
    lines = [f"POST {target} HTTP/{version}", "host: leasehold"]
    if auth is not None:
        lines.append(f"authorization: {auth}")
    if ctype is not None:
        lines.append(f"content-type: {ctype}")
    if length == "auto":
        lines.append(f"content-length: {len(data)}")
    elif length is not None:
        lines.append(f"content-length: {length}")
    lines += head
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


def chunked(data: bytes, size: int = 7) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(data[i:i + size]), data[i:i + size])
                    for i in range(0, len(data), size)) + b"0\r\n\r\n"


def export(rid: str, pid: str) -> dict:
    """An ``export`` question: its rule is idempotent, so a requestId is bound to the first
    question decided with it (asked again: the same decision; by someone else: 409). Its tenant
    follows from the requestId: the rule's tenant-wide concurrency gate (3) is then never full."""
    return admit_body(rid, route="export", pid=pid, tenant="t-" + hashlib.sha256(rid.encode()).hexdigest()[:16])


def decided(ans: Answer, rid: str) -> dict:
    assert ans.status == 200 and ans.content_type == "application/json", ans.raw[:500]
    decision = ans.json()
    assert decision["decisionId"] == rid, ans.raw[:500]
    return decision


def problem(ans: Answer, status: int) -> dict:
    assert ans.status == status and ans.content_type == "application/problem+json", ans.raw[:500]
    doc = ans.json()
    assert doc["status"] == status, doc
    return doc


def ask(svc: Service, data: bytes) -> Answer:
    """One request alone on a fresh connection (so a qualifying one takes the direct route)."""
    with Wire(svc) as w:
        w.send(data)
        return w.answer()


def assert_fresh(svc: Service, rid: str) -> None:
    """``rid`` was never decided: an export question with it by a principal nobody used is a
    fresh 200 (a requestId decided before would answer 409, or replay another decision)."""
    decision = decided(ask(svc, post(export(rid, uid("nobody")))), rid)
    assert decision["allowed"] is True and decision["reason"] is None, decision


@pytest.fixture(autouse=True)
def no_server_errors(agent_service: Service) -> Iterator[None]:
    """No traceback, failed callback or failed direct route in the agent's log during a test."""
    assert agent_service.proc.log_path is not None
    start = agent_service.proc.log_path.stat().st_size
    yield
    with agent_service.proc.log_path.open("rb") as f:
        f.seek(start)
        new = f.read().decode(errors="replace")
    for bad in ("Traceback", "Exception in callback", "direct route failed", "unhandled error"):
        assert bad not in new, new[-4000:]
    assert agent_service.proc.alive()


# ---------------------------------------------------------------------------- 1. pipelining


def _send_whole(w: Wire, parts: list[bytes]) -> None:
    w.send(b"".join(parts))


def _send_bytewise(w: Wire, parts: list[bytes]) -> None:
    data = b"".join(parts)
    for i in range(len(data)):
        w.sock.send(data[i:i + 1])


def _send_one_by_one(w: Wire, parts: list[bytes]) -> None:
    for part in parts:  # each request in its own write, without waiting for any answer
        w.send(part)
        time.sleep(0.005)


@pytest.mark.parametrize("send", [_send_whole, _send_bytewise, _send_one_by_one],
                         ids=["one write", "byte by byte", "one write per request"])
def test_pipelined_answers_are_complete_and_in_order(agent_service: Service,
                                                     send: Callable[[Wire, list[bytes]], None]):
    rids = [uid(f"pipe{i}") for i in range(8)]
    pid = uid("U")
    parts = [
        post(admit_body(rids[0], pid=pid)),  # direct
        post(admit_body(rids[1], pid=pid)),  # direct (or, pipelined, the normal lane)
        HEALTHZ,
        post(admit_body(rids[2], pid=pid)),
        post(b'{"requestId": "' + rids[3].encode() + b'", '),  # malformed: handed over, 400
        post(admit_body(rids[4], pid=pid), "/v1/admit?x=1"),  # a query: never direct
        post({"requests": [admit_body(rids[5], pid=pid), admit_body(rids[6], pid=pid)]}, "/v1/admit/batch"),
        post(admit_body(rids[7], pid=pid), head=("connection: close",)),
    ]
    with Wire(agent_service) as w:
        send(w, parts)
        answers = [w.answer() for _ in parts]
        assert w.closed()  # the last request asked for it; nothing came after its answer
    decided(answers[0], rids[0])
    decided(answers[1], rids[1])
    assert answers[2].status == 200 and answers[2].json() == {"status": "ok"}, answers[2].raw
    decided(answers[3], rids[2])
    assert "JSON" in problem(answers[4], 400)["detail"]
    decided(answers[5], rids[4])
    batch = answers[6]
    assert batch.status == 200 and batch.content_type == "application/json", batch.raw[:500]
    assert [d["decisionId"] for d in batch.json()["decisions"]] == rids[5:7]
    decided(answers[7], rids[7])
    assert answers[7].closes and not any(a.closes for a in answers[:7])
    assert not any(a.interim for a in answers)


def test_many_pipelined_requests_in_one_write(agent_service: Service):
    """150 requests of every kind in one write: 150 answers, each the right one, in order."""
    pid = uid("U")
    parts: list[bytes] = []
    checks: list[Callable[[Answer], object]] = []
    for i in range(150):
        rid = uid(f"many{i}")
        kind = i % 5
        if kind == 0:
            parts.append(post(admit_body(rid, pid=pid)))
            checks.append(lambda a, rid=rid: decided(a, rid))
        elif kind == 1:
            parts.append(HEALTHZ)
            checks.append(lambda a: a.json() == {"status": "ok"} or pytest.fail(repr(a.raw)))
        elif kind == 2:
            parts.append(post(b'{"requestId": "' + rid.encode() + b'"'))
            checks.append(lambda a: problem(a, 400))
        elif kind == 3:
            parts.append(post({"requests": [admit_body(rid, pid=pid)]}, "/v1/admit/batch"))
            checks.append(lambda a, rid=rid: a.json()["decisions"][0]["decisionId"] == rid or pytest.fail(repr(a.raw)))
        else:
            parts.append(post(admit_body(rid, pid=pid), auth="Bearer wrong"))
            checks.append(lambda a: problem(a, 401))
    with Wire(agent_service) as w:
        w.send(b"".join(parts))
        for i, check in enumerate(checks):
            ans = w.answer()
            assert not ans.closes, (i, ans.raw[:300])
            check(ans)
        w.silent(0.3)


def test_expect_100_continue_client_gets_its_interim_answer(agent_service: Service):
    """A client that sends ``Expect: 100-continue`` and waits for the 100 before its body (curl
    does): the 100 comes (the direct route, which never sends one, does not take such a request),
    then the decision."""
    rid = uid("expect")
    data = post(admit_body(rid, pid=uid("U")), head=("expect: 100-continue",))
    cut = data.index(b"\r\n\r\n") + 4
    with Wire(agent_service) as w:
        w.send(data[:cut])
        w.sock.settimeout(WAIT_S)
        interim = b""
        while b"\r\n\r\n" not in interim:
            chunk = w.sock.recv(1)
            assert chunk, interim
            interim += chunk
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n", interim
        w.send(data[cut:])
        decided(w.answer(), rid)


def test_body_in_pieces_and_keep_alive_between_direct_answers(agent_service: Service):
    """A head, then its body in three writes a little apart (within the body deadline); then more
    requests on the same connection, each sent once the answer before it arrived (all direct)."""
    pid = uid("U")
    with Wire(agent_service) as w:
        for i in range(3):
            rid = uid(f"piece{i}")
            data = post(admit_body(rid, pid=pid))
            cut = data.index(b"\r\n\r\n") + 4
            pieces = [data[:cut], data[cut:cut + 10], data[cut + 10:cut + 30], data[cut + 30:]]
            for piece in pieces:
                w.send(piece)
                time.sleep(0.05)
            decided(w.answer(), rid)
        w.silent(0.3)  # nothing more: no stray answer


# ---------------------------------------------------------------------------- 2. direct route = normal lane


def _normal_query(data: bytes) -> bytes:
    return data.replace(b" HTTP/1.1\r\n", b"?lane=normal HTTP/1.1\r\n", 1)


def _normal_chunked(data: bytes) -> bytes:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"content-length:")]
    return b"\r\n".join([*lines, b"transfer-encoding: chunked"]) + b"\r\n\r\n" + chunked(body)


def _normal_expect(data: bytes) -> bytes:
    head, _, body = data.partition(b"\r\n\r\n")
    return head + b"\r\nexpect: 100-continue\r\n\r\n" + body


LANES: dict[str, Callable[[bytes], bytes]] = {
    "query string": _normal_query,
    "chunked body": _normal_chunked,
    "expect 100-continue": _normal_expect,
}


def _comparable(ans: Answer) -> tuple:
    return ans.status, [(n, v) for n, v in ans.headers if n != "date"], ans.body


@pytest.fixture(scope="module")
def bound_rid(agent_service: Service) -> tuple[str, str]:
    """An export requestId decided (through the direct route) for one principal."""
    rid, pid = uid("bound"), uid("U")
    decided(ask(agent_service, post(export(rid, pid))), rid)
    return rid, pid


SAME_CASES: dict[str, tuple[Callable[[str, str], bytes | dict], str, int]] = {
    # name: (body from the bound requestId and its principal, path, status)
    "idempotent replay": (lambda rid, pid: export(rid, pid), "/v1/admit", 200),
    "requestId conflict": (lambda rid, pid: export(rid, pid + "-other"), "/v1/admit", 409),
    "invalid tenant id": (lambda rid, pid: admit_body("dl-bad-tenant-1", tenant="Not_A_Tenant"), "/v1/admit", 422),
    "no tenant for a user": (lambda rid, pid: admit_body("dl-no-tenant-1", tenant=None), "/v1/admit", 422),
    "unknown principal type": (lambda rid, pid: admit_body("dl-robot-0001", ptype="robot"), "/v1/admit", 422),
    "malformed json": (lambda rid, pid: b'{"requestId": "dl-malformed-1", ', "/v1/admit", 400),
    "repeated key": (lambda rid, pid: b'{"requestId":"dl-repeated-01","requestId":"dl-repeated-02","principal":'
                                      b'{"type":"user","id":"U-1"},"routeGroup":"read","tenantId":"atlas"}',
                     "/v1/admit", 400),
    "empty body": (lambda rid, pid: b"", "/v1/admit", 400),
    "a batch sent to /v1/admit": (lambda rid, pid: {"requests": [export(rid, pid)]}, "/v1/admit", 422),
    "a question sent to /v1/admit/batch": (lambda rid, pid: export(rid, pid), "/v1/admit/batch", 422),
    "batch replay": (lambda rid, pid: {"requests": [export(rid, pid)]}, "/v1/admit/batch", 200),
    "batch with a conflict": (lambda rid, pid: {"requests": [export(rid, pid + "-other")]}, "/v1/admit/batch", 200),
}


@pytest.mark.parametrize("case", list(SAME_CASES))
def test_direct_and_normal_lanes_answer_byte_for_byte_alike(agent_service: Service, bound_rid: tuple[str, str],
                                                           case: str):
    make, path, status = SAME_CASES[case]
    data = post(make(*bound_rid), path)
    direct = ask(agent_service, data)
    assert direct.status == status, direct.raw[:500]
    assert direct.content_type == ("application/json" if status == 200 else "application/problem+json")
    for lane, force in LANES.items():
        normal = ask(agent_service, force(data))
        assert _comparable(normal) == _comparable(direct), f"{lane}: {normal.raw!r} vs direct {direct.raw!r}"
        if lane == "expect 100-continue":  # proof it took the normal lane: the direct one never sends a 100
            assert normal.interim == [b"HTTP/1.1 100 Continue"], normal.interim
        else:
            assert not normal.interim
    with Wire(agent_service) as w:  # pipelined behind a GET: the normal lane too
        w.send(HEALTHZ + data)
        assert w.answer().status == 200
        behind = w.answer()
        w.silent(0.2)
    assert _comparable(behind) == _comparable(direct), f"pipelined: {behind.raw!r} vs direct {direct.raw!r}"
    if case == "requestId conflict":
        assert direct.json()["decisionId"] == bound_rid[0]
    if case == "batch with a conflict":
        assert direct.json()["decisions"][0]["reason"] == "REQUEST_ID_CONFLICT", direct.body


# ---------------------------------------------------------------------------- 3. HTTP/1.0, Connection: close


@pytest.mark.parametrize("target", ["/v1/admit", "/v1/admit?lane=normal"], ids=["direct", "normal"])
@pytest.mark.parametrize("how", ["HTTP/1.0", "HTTP/1.0 keep-alive", "connection: close", "Connection: Close"])
def test_answer_then_close(agent_service: Service, target: str, how: str):
    """The answer arrives complete, says ``connection: close``, and the server closes; a request
    pipelined after it is not answered."""
    rid = uid("close")
    version = "1.0" if how.startswith("HTTP/1.0") else "1.1"
    head = {"HTTP/1.0": (), "HTTP/1.0 keep-alive": ("connection: keep-alive",), "connection: close":
            ("connection: close",), "Connection: Close": ("Connection: Close",)}[how]
    with Wire(agent_service) as w:
        w.send(post(admit_body(rid, pid=uid("U")), target, head=head, version=version) + HEALTHZ)
        ans = w.answer()
        decided(ans, rid)
        assert ans.closes, ans.raw[:300]
        assert w.closed()


def test_handed_over_answer_then_close(agent_service: Service):
    """A body the direct route hands to the application, with ``Connection: close``: the
    application's 400, then the close."""
    with Wire(agent_service) as w:
        w.send(post(b'{"requestId": "dl-truncated-1", ', head=("connection: close",)) + HEALTHZ)
        ans = w.answer()
        problem(ans, 400)
        assert ans.closes
        assert w.closed()


# ---------------------------------------------------------------------------- 4. slow bodies, vanishing clients


@pytest.mark.parametrize("earlier", [False, True], ids=["first request", "after an answer and an idle second"])
def test_trickled_body_gets_408_and_decides_nothing(agent_service: Service, earlier: bool):
    rid = uid("slow")
    data = post(export(rid, uid("U")))
    cut = data.index(b"\r\n\r\n") + 4 + 5
    with Wire(agent_service) as w:
        if earlier:  # a direct answer first, then longer than the head deadline with nothing in flight
            before = uid("before")
            w.send(post(admit_body(before, pid=uid("U"))))
            decided(w.answer(), before)
            time.sleep(1.3)
        started = time.monotonic()
        w.send(data[:cut])
        for byte in data[cut:-1]:  # a byte every 0.2 s: slower than the body deadline allows
            try:
                w.sock.send(bytes([byte]))
            except OSError:
                break
            time.sleep(0.2)
            if time.monotonic() - started > WAIT_S:
                break
        ans = w.answer()
        problem(ans, 408)  # the body deadline, not a decision
        assert ans.closes
        assert w.closed()
    assert_fresh(agent_service, rid)


def _abort(s: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0), as a client that vanishes does."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_vanishing_clients_do_not_break_the_server(agent_service: Service):
    pid = uid("U")
    for i in range(20):  # a whole request, then gone at once (reset or orderly close)
        w = Wire(agent_service)
        w.send(post(admit_body(uid(f"gone{i}"), pid=pid)))
        if i % 2:
            _abort(w.sock)
        else:
            w.sock.close()
    for i in range(10):  # a head and part of the body, then gone
        w = Wire(agent_service)
        data = post(admit_body(uid(f"half{i}"), pid=pid))
        w.send(data[: data.index(b"\r\n\r\n") + 10])
        if i % 2:
            _abort(w.sock)
        else:
            w.sock.close()
    for i in range(5):  # a whole request, then the client stops sending (half close)
        with Wire(agent_service) as w:
            rid = uid(f"halfclose{i}")
            w.send(post(admit_body(rid, pid=pid)))
            w.sock.shutdown(socket.SHUT_WR)
            w.sock.settimeout(WAIT_S)
            got = b""
            while chunk := w.sock.recv(65536):
                got += chunk
            # uvicorn closes a connection at the client's EOF: the answer, if it came, is whole
            if got:
                w.buf, w.eof = got, True
                decided(w.answer(), rid)
                assert not w.buf
    time.sleep(0.3)
    rid = uid("after")
    with Wire(agent_service) as w:
        w.send(post(admit_body(rid, pid=uid("U"))))
        decided(w.answer(), rid)
        w.send(HEALTHZ)
        assert w.answer().json() == {"status": "ok"}


# ---------------------------------------------------------------------------- 5. request smuggling

# Each attack carries a hidden request (an export question with its own requestId): a server that
# read the attack's body boundary wrongly would answer it as a request of its own.


def _hidden(rid: str) -> bytes:
    return post(export(rid, "U-smuggler"))


def _valid(rid: str) -> bytes:
    return encode(admit_body(rid, pid="U-" + rid))


def _raw_post(headers: list[str], body: bytes) -> bytes:
    return ("\r\n".join(["POST /v1/admit HTTP/1.1", "host: leasehold", f"authorization: {AUTH}",
                         "content-type: application/json", *headers]) + "\r\n\r\n").encode() + body


def _cl_te(rid: str, hidden: bytes) -> bytes:
    body = b"0\r\n\r\n" + hidden
    return _raw_post([f"content-length: {len(body)}", "transfer-encoding: chunked"], body)


def _te_cl(rid: str, hidden: bytes) -> bytes:
    body = b"0\r\n\r\n" + hidden
    return _raw_post(["transfer-encoding: chunked", f"content-length: {len(body)}"], body)


def _te_cl_short(rid: str, hidden: bytes) -> bytes:
    size = b"%x\r\n" % len(hidden)
    return _raw_post(["transfer-encoding: chunked", f"content-length: {len(size)}"], size + hidden + b"\r\n0\r\n\r\n")


def _two_cl_same(rid: str, hidden: bytes) -> bytes:
    body = _valid(rid)
    return _raw_post([f"content-length: {len(body)}", f"content-length: {len(body)}"], body)


def _two_cl_different(rid: str, hidden: bytes) -> bytes:
    body = _valid(rid)
    return _raw_post([f"content-length: {len(body)}", f"Content-Length: {len(body) + len(hidden)}"], body + hidden)


def _two_cl_different_reversed(rid: str, hidden: bytes) -> bytes:
    body = _valid(rid)
    return _raw_post([f"content-length: {len(body) + len(hidden)}", f"content-length: {len(body)}"], body + hidden)


def _cl_list(rid: str, hidden: bytes) -> bytes:
    body = _valid(rid)
    return _raw_post([f"content-length: {len(body)}, {len(body)}"], body)


def _cl_spelled(spelling: str):
    """The valid request with its Content-Length written ``spelling.format(n)``."""

    def build(rid: str, hidden: bytes) -> bytes:
        body = _valid(rid)
        return _raw_post(["content-length: " + spelling.format(len(body))], body)

    return build


def _cl_minus(rid: str, hidden: bytes) -> bytes:
    return _raw_post(["content-length: -1"], hidden)


def _cl_hex(rid: str, hidden: bytes) -> bytes:
    return _raw_post([f"content-length: 0x{len(hidden):x}"], hidden)


def _cl_overflow(rid: str, hidden: bytes) -> bytes:
    return _raw_post([f"content-length: {2**64 + len(hidden)}"], hidden)


def _cl_space_before_colon(rid: str, hidden: bytes) -> bytes:
    return _raw_post([f"content-length : {len(hidden)}"], hidden)


def _te_unknown_and_cl(rid: str, hidden: bytes) -> bytes:
    return _raw_post(["transfer-encoding: xchunked", "content-length: 0"], hidden)


def _te_chunked_not_last(rid: str, hidden: bytes) -> bytes:
    return _raw_post(["transfer-encoding: chunked, identity"], chunked(_valid(rid)) + hidden)


def _te_obs_fold(rid: str, hidden: bytes) -> bytes:
    return _raw_post(["content-length: 0", "transfer-encoding:", " chunked"], chunked(hidden))


def _bare_lf(rid: str, hidden: bytes) -> bytes:
    return _raw_post([f"content-length: {len(_valid(rid))}"], _valid(rid)).replace(b"\r\n", b"\n")


def _te_chunked_alone(rid: str, hidden: bytes) -> bytes:
    return _raw_post(["transfer-encoding: chunked"], chunked(_valid(rid)))


def _te_chunked_upper(rid: str, hidden: bytes) -> bytes:
    return _raw_post(["Transfer-Encoding: CHUNKED"], chunked(_valid(rid), 5))


def _upgrade(protocol: str) -> Callable[[str, bytes], bytes]:
    def attack(rid: str, hidden: bytes) -> bytes:
        body = _valid(rid)
        return _raw_post([f"content-length: {len(body)}", "connection: upgrade", f"upgrade: {protocol}"], body + hidden)
    return attack


# name: (attack, must it be answered with its decision?)
SMUGGLING: dict[str, tuple[Callable[[str, bytes], bytes], bool]] = {
    "CL then TE chunked": (_cl_te, False),
    "TE chunked then CL": (_te_cl, False),
    "TE chunked, CL covering the size line": (_te_cl_short, False),
    "two equal CL": (_two_cl_same, False),
    "two different CL": (_two_cl_different, False),
    "two different CL, longer first": (_two_cl_different_reversed, False),
    "CL as a list": (_cl_list, False),
    "CL +n": (_cl_spelled("+{}"), False),
    "CL -1": (_cl_minus, False),
    "CL 0x..": (_cl_hex, False),
    "CL beyond 2**64": (_cl_overflow, False),
    "space before the colon": (_cl_space_before_colon, False),
    "TE xchunked and CL 0": (_te_unknown_and_cl, False),
    "TE chunked, identity": (_te_chunked_not_last, False),
    "TE folded onto a second line": (_te_obs_fold, False),
    "bare LF line ends": (_bare_lf, False),
    "upgrade to h2c": (_upgrade("h2c"), False),
    "upgrade to websocket": (_upgrade("websocket"), False),
    "CL with leading spaces": (_cl_spelled("   {}"), True),
    "CL with trailing spaces": (_cl_spelled("{}   "), True),
    "CL with leading zeros": (_cl_spelled("{:012d}"), True),
    "TE chunked alone": (_te_chunked_alone, True),
    "TE CHUNKED in capitals": (_te_chunked_upper, True),
}


def _check_attack_answer(ans: Answer, rid: str, hidden_rid: str, must_answer: bool) -> None:
    if ans.status == 200:
        decided(ans, rid)
    else:
        assert not must_answer, ans.raw[:500]
        assert 400 <= ans.status < 500 and ans.content_type == "application/problem+json", ans.raw[:500]
    assert hidden_rid.encode() not in ans.raw, ans.raw


@pytest.mark.parametrize("follower", ["pipelined", "after the answer"])
@pytest.mark.parametrize("case", list(SMUGGLING))
def test_smuggling_attempt(agent_service: Service, case: str, follower: str):
    """The attack is answered (its own decision, or a 4xx problem), then the next request on the
    connection is answered correctly or the connection is closed (an attack that must be answered:
    answered); the hidden request is never answered nor decided, and no answer is cut or merged
    with another."""
    attack, must_answer = SMUGGLING[case]
    rid, hidden_rid, next_rid = uid("victim"), uid("hidden"), uid("next")
    nxt = post(admit_body(next_rid, pid=uid("U")), head=("connection: close",))
    with Wire(agent_service) as w:
        w.send(attack(rid, _hidden(hidden_rid)) + (nxt if follower == "pipelined" else b""))
        first = w.answer()
        _check_attack_answer(first, rid, hidden_rid, must_answer)
        if not first.closes and follower != "pipelined":
            try:
                w.send(nxt)
            except OSError:  # closed (the answer said nothing of it: checked below)
                pass
        second = w.answer_or_close()
        if first.closes:
            assert not must_answer and second is None, second
        elif second is not None:
            decided(second, next_rid)
            assert second.closes
        else:
            assert not must_answer
        assert w.closed()
    assert_fresh(agent_service, hidden_rid)


# ---------------------------------------------------------------------------- 6. credentials


AUTH_CASES: dict[str, tuple[tuple[str, ...], int]] = {
    # name: (authorization header lines, status)
    "no credential": ((), 401),
    "wrong token": (("authorization: Bearer not-the-token",), 401),
    "empty token": (("authorization: Bearer ",), 401),
    "lower-case scheme": ((f"authorization: bearer {TOKEN}",), 401),
    "token with a trailing space": ((f"authorization: Bearer {TOKEN} ",), 401),
    "two credentials": ((f"authorization: {AUTH}", f"authorization: {AUTH}"), 401),
    "a good and a bad credential": ((f"authorization: {AUTH}", "Authorization: Bearer nope"), 401),
    "AUTHORIZATION in capitals": ((f"AUTHORIZATION: {AUTH}",), 200),
    "Authorization": ((f"Authorization: {AUTH}",), 200),
    "aUtHoRiZaTiOn": ((f"aUtHoRiZaTiOn: {AUTH}",), 200),
}


@pytest.mark.parametrize("case", list(AUTH_CASES))
def test_credentials_on_both_lanes(agent_service: Service, case: str):
    lines, status = AUTH_CASES[case]
    rid, pid = uid("auth"), uid("U")
    direct = ask(agent_service, post(export(rid, pid), auth=None, head=lines))
    normal = ask(agent_service, post(export(rid, pid), "/v1/admit?lane=normal", auth=None, head=lines))
    if status == 401:
        problem(direct, 401)
        assert direct.header("www-authenticate") == 'Bearer realm="leasehold"'
        assert _comparable(normal) == _comparable(direct), (normal.raw, direct.raw)
        assert_fresh(agent_service, rid)  # refused: nothing was decided
    else:
        decided(direct, rid)
        decided(normal, rid)  # the same question again: the idempotent rule replays it
        assert normal.body == direct.body


def test_refused_credentials_decide_nothing(agent_service: Service):
    """Refused requests pipelined with a good one: 401, 401, then a fresh decision for the same
    requestId by another principal (had a refused one been decided, that would be a 409)."""
    rid = uid("auth-pipe")
    first, second = uid("U"), uid("U")
    with Wire(agent_service) as w:
        w.send(post(export(rid, first), auth=None) + post(export(rid, first), auth="Bearer wrong")
               + post(export(rid, second), auth=None, head=(f"AUTHORIZATION: {AUTH}",)))
        problem(w.answer(), 401)
        problem(w.answer(), 401)
        decided(w.answer(), rid)
        w.send(post(export(rid, first)))  # now direct (nothing in flight): bound to the second principal
        assert problem(w.answer(), 409)["decisionId"] == rid
        w.send(post(export(rid, second), auth="Bearer wrong"))  # direct-eligible except for the credential
        problem(w.answer(), 401)
        w.silent(0.2)


# ---------------------------------------------------------------------------- 7. content types


CONTENT_TYPES: dict[str, tuple[tuple[str, ...], int]] = {
    # name: (content-type header lines, status)
    "application/json; charset=utf-8": (("content-type: application/json; charset=utf-8",), 200),
    "application/json;charset=UTF-8": (("content-type: application/json;charset=UTF-8",), 200),
    "Application/JSON": (("Content-Type: Application/JSON",), 200),
    "application/json twice": (("content-type: application/json", "content-type: application/json"), 415),
    "text/plain": (("content-type: text/plain",), 415),
    "application/json; charset=latin-1": (("content-type: application/json; charset=latin-1",), 415),
    "application/jsonx": (("content-type: application/jsonx",), 415),
    "no content type": ((), 415),
}


@pytest.mark.parametrize("case", list(CONTENT_TYPES))
def test_content_types_on_both_lanes(agent_service: Service, case: str):
    lines, status = CONTENT_TYPES[case]
    rid, pid = uid("ctype"), uid("U")
    direct = ask(agent_service, post(export(rid, pid), ctype=None, head=lines))
    normal = ask(agent_service, post(export(rid, pid), "/v1/admit?lane=normal", ctype=None, head=lines))
    if status == 200:
        decided(direct, rid)
        assert normal.status == 200 and normal.body == direct.body
    else:
        problem(direct, status)
        assert _comparable(normal) == _comparable(direct), (normal.raw, direct.raw)
        assert_fresh(agent_service, rid)


# ---------------------------------------------------------------------------- 8. announced lengths


@pytest.mark.parametrize("path,announced", [("/v1/admit", MAX_BODY + 1), ("/v1/admit", 10**12),
                                            ("/v1/admit/batch", MAX_BATCH_BODY + 1)])
def test_oversized_announced_length_is_refused_at_once(agent_service: Service, path: str, announced: int):
    """413 right after the head, with no body sent: before the body deadline (which would answer
    408), so the server did not wait for the body."""
    with Wire(agent_service) as w:
        w.send(post(b"", path, length=str(announced)))
        ans = w.answer()
        problem(ans, 413)  # a server that waited for the body would have answered 408 at its deadline
        assert w.closed()  # the body never came: closed at the body deadline, nothing else sent


def _padded(rid: str, size: int) -> bytes:
    body = encode(export(rid, uid("U")))
    return body + b" " * (size - len(body))  # JSON allows the trailing whitespace


def test_body_at_the_limit_is_decided_and_one_byte_more_is_413(agent_service: Service):
    rid = uid("limit")
    with Wire(agent_service) as w:
        w.send(post(_padded(rid, MAX_BODY)))
        decided(w.answer(), rid)
        over = uid("over")
        w.send(post(_padded(over, MAX_BODY + 1)))
        problem(w.answer(), 413)
    assert_fresh(agent_service, over)


# ---------------------------------------------------------------------------- 9. a client that does not read

HELD_BUDGET_KIB = 16 * 1024  # what one client that never reads its answers may make the server hold


@pytest.mark.parametrize("target", ["/v1/admit/batch?lane=normal", "/v1/admit/batch"], ids=["normal", "direct"])
def test_a_client_that_never_reads_cannot_make_the_server_hold_its_answers(agent_service: Service, target: str):
    """A client sends large batches, each once the one before it has been decided, and never reads
    an answer. Once its answers fill the socket buffers, the server must stop taking its requests
    (uvicorn's cycle waits for the transport to drain before it writes, the connection's next
    request then waits behind it, reading is paused and the client's sends block, and the
    connection is reset once its answers waited --http-write-timeout-ms) rather than keep deciding
    and hold every answer in memory. Measured: the agent's RSS, against a budget; the
    normal lane is the control."""
    pid = agent_service.proc.pid
    data = post({"requests": [admit_body(f"dl-noread-{i:04d}", pid="U-noread") for i in range(1000)]}, target)
    with Wire(agent_service) as w:  # the pace: a request arrives once the one before it was answered
        took = []
        for _ in range(3):
            started = time.monotonic()
            w.send(data)
            ans = w.answer()
            took.append(time.monotonic() - started)
    answer_bytes = len(ans.raw)
    pace = max(0.05, 3 * max(took))
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the client's kernel keeps little for it
    s.connect(("127.0.0.1", agent_service.port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.settimeout(2.0)
    before = rss_kib(pid)
    sent = 0
    blocked = False
    grown = 0
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and sent * answer_bytes < 64 << 20:
            try:
                s.sendall(data)
            except TimeoutError:  # the server stopped reading: backpressure reached the client
                blocked = True
                break
            except (ConnectionResetError, BrokenPipeError):  # its answers not taken: cut off (--http-write-timeout-ms)
                blocked = True
                break
            sent += 1
            time.sleep(pace)
            grown = rss_kib(pid) - before
            if grown > HELD_BUDGET_KIB:
                break
        time.sleep(0.3)
        grown = max(grown, rss_kib(pid) - before)
    finally:  # read everything now (until a second of silence): every request answered, then close
        s.settimeout(1.0)
        with contextlib.suppress(OSError):
            while s.recv(1 << 20):
                pass
        s.close()
    assert grown <= HELD_BUDGET_KIB, (
        f"{target}: the agent grew by {grown} KiB while a client that never reads sent {sent} requests "
        f"({sent * answer_bytes >> 20} MiB of answers, paced {pace * 1000:.0f} ms; its sends blocked: {blocked})")
