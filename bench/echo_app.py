"""The ceiling of figure 2: a bare Litestar app that decodes the same admission body (the same
msgspec Struct, so the same validation work) and returns it, served by uvicorn like the agent.

    python -m bench.echo_app --port N [--workers 1]"""

from __future__ import annotations

import argparse
import sys

from litestar import Litestar, post

from region_agent.models import AdmitRequest


@post("/v1/admit", status_code=200)
async def echo(data: AdmitRequest) -> AdmitRequest:
    return data


app = Litestar(route_handlers=[echo], debug=False)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--workers", type=int, default=1)
    a = ap.parse_args(argv)
    uvicorn.run("bench.echo_app:app", host=a.host, port=a.port, workers=a.workers, loop="uvloop",
                http="httptools", log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
