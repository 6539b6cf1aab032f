"""The ceiling of figure 2: a raw ASGI echo with no framework. uvicorn + httptools + uvloop,
like the agent; the app reads the body of ``POST /v1/admit``, decodes it with msgspec into the
same :class:`AdmitRequest` (the same strict validation) and answers 200 with it encoded again.
Anything else is 404. This is what the agent's own stack can serve with no decision at all.

    python -m bench.raw_echo --port N [--workers 1]"""

from __future__ import annotations

import argparse
import sys

import msgspec

from region_agent.models import AdmitRequest

_decode = msgspec.json.Decoder(AdmitRequest).decode
_encode = msgspec.json.Encoder().encode
_JSON = (b"content-type", b"application/json")


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return  # lifespan: nothing to set up
    body = b""
    more = True
    while more:
        msg = await receive()
        body += msg.get("body", b"")
        more = msg.get("more_body", False)
    if scope["method"] != "POST" or scope["path"] != "/v1/admit":
        status, payload = 404, b""
    else:
        try:
            status, payload = 200, _encode(_decode(body))
        except (msgspec.DecodeError, msgspec.ValidationError):
            status, payload = 400, b""
    await send({"type": "http.response.start", "status": status,
                "headers": [_JSON, (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m bench.raw_echo")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--workers", type=int, default=1)
    a = ap.parse_args(argv)
    uvicorn.run("bench.raw_echo:app", host=a.host, port=a.port, workers=a.workers, loop="uvloop",
                http="httptools", log_level="warning", access_log=False, lifespan="off")
    return 0


if __name__ == "__main__":
    sys.exit(main())
