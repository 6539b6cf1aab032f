"""``POST /v1/admit`` and ``/v1/admit/batch`` answered by the HTTP protocol itself (the agent's
direct routes, kernel.httpserver) answer exactly what the Litestar handler answers: the fast path
test's inputs, valid and hostile, sent through uvicorn's protocol with the direct routes to an
agent with the fast path, and through the ASGI test client to one without it (each on its own
Redis, same policy and pepper), give the same status, content type and body; the requests the
direct route serves are exactly those that decode."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from uvicorn.server import ServerState

from kernel.httpserver import BoundedHttpToolsProtocol, LimitedConfig
from leasehold.local.procs import RedisServer
from region_agent.service import fastpath
from region_agent.service.app import create_app
from tests.support.agent import PEPPER, make_settings
from tests.support.transport import RecordingTransport

from .test_fastpath import BATCH_CASES, CASES, GW_ENTRY, GW_TOKEN, _answers


@contextlib.asynccontextmanager
async def started(app: Any) -> AsyncIterator[None]:
    """The app's lifespan, as uvicorn runs it."""
    inbox: asyncio.Queue = asyncio.Queue()
    outbox: asyncio.Queue = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    task = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get, outbox.put))
    assert (await asyncio.wait_for(outbox.get(), 30))["type"] == "lifespan.startup.complete"
    try:
        yield
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(outbox.get(), 30)
        await task


def _request(path: str, headers: dict[str, str], content: bytes) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: agent\r\ncontent-length: {len(content)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode() + b"\r\n" + content


def _parse(data: bytes) -> tuple[int, str, bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    named = {k.lower(): v for k, _, v in (ln.partition(": ") for ln in lines[1:])}
    assert int(named["content-length"]) == len(body), data[:300]
    return int(lines[0].split()[1]), named.get("content-type", ""), body


async def _direct_answers(tmp_path, policy_file, name: str, path: str, cases: list) -> list[tuple[int, str, bytes]]:
    redis = RedisServer(tmp_path / name).start()
    try:
        settings = make_settings(redis.url, policy_file, auth_disabled=False, gateway_tokens=[GW_ENTRY])
        app = create_app(settings, pepper=PEPPER, fast_path=True)
        out = []
        async with started(app):
            cfg = LimitedConfig(app, lifespan="off", log_level="warning", proxy_headers=False,
                                direct=fastpath.direct_routes)
            cfg.load()
            loop = asyncio.get_running_loop()
            for _, headers, body in cases:
                h = {"authorization": f"Bearer {GW_TOKEN}", "content-type": "application/json", **headers}
                h = {k: v for k, v in h.items() if v}
                content = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
                proto = BoundedHttpToolsProtocol(cfg, ServerState(), {}, loop)
                t = RecordingTransport()
                proto.connection_made(t)  # type: ignore[arg-type]  # a recording stand-in for the transport
                proto.data_received(_request(path, h, content))
                for _ in range(3000):  # until the answer is complete (a decision may wait on Redis)
                    if _complete(t.data):
                        break
                    await asyncio.sleep(0.001)
                proto.connection_lost(None)
                out.append(_parse(t.data))
        return out
    finally:
        redis.stop()


def _complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:] if sep else ():
        name, _, value = line.partition(b": ")
        if name.lower() == b"content-length":
            return len(body) >= int(value)
    return False


async def test_the_direct_route_answers_like_the_handler(tmp_path, policy_file, monkeypatch):
    served: list[str] = []
    real = fastpath.admit_answer

    async def counting(st, req, *rest):
        served.append(req.request_id)
        return await real(st, req, *rest)

    monkeypatch.setattr(fastpath, "admit_answer", counting)
    monkeypatch.setattr(fastpath, "_answer", None)  # the ASGI fast path is not used by any of these
    direct = await _direct_answers(tmp_path, policy_file, "direct", "/v1/admit", CASES)
    assert served == ["fp-ok-000001", "fp-anon-0001", "fp-export-001", "fp-export-001", "fp-no-tenant"], served
    monkeypatch.undo()
    slow = await _answers(tmp_path, policy_file, "slow", False)
    for (name, _, _), d, s in zip(CASES, direct, slow, strict=True):
        assert d == s, f"{name}: direct route {d!r} vs handler {s!r}"


async def test_the_direct_batch_lane_answers_like_the_handler(tmp_path, policy_file, monkeypatch):
    served: list[int] = []
    real = fastpath.admit_batch_answer

    async def counting(st, batch, *rest):
        served.append(len(batch.requests))
        return await real(st, batch, *rest)

    monkeypatch.setattr(fastpath, "admit_batch_answer", counting)
    monkeypatch.setattr(fastpath, "_answer_batch", None)
    direct = await _direct_answers(tmp_path, policy_file, "bdirect", "/v1/admit/batch", BATCH_CASES)
    assert served == [3, 1, 1, 0, 1, 1, 1], served
    monkeypatch.undo()
    slow = await _answers(tmp_path, policy_file, "bslow", False, "/v1/admit/batch", BATCH_CASES)
    for (name, _, _), d, s in zip(BATCH_CASES, direct, slow, strict=True):
        assert d == s, f"{name}: direct route {d!r} vs handler {s!r}"
