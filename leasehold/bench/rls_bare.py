"""The ceiling of figure 8: a bare grpcio (``grpc.aio``, uvloop) rate limit service answering every
``ShouldRateLimit`` with a constant ``OK``, one process like the agent.

    python -m leasehold.bench.rls_bare --port N"""

from __future__ import annotations

import argparse

import grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

OK = rls_pb2.RateLimitResponse(overall_code=rls_pb2.RateLimitResponse.OK)


class Constant(rls_pb2_grpc.RateLimitServiceServicer):
    async def ShouldRateLimit(self, request, context):  # noqa: N802 (the generated name)
        return OK


async def serve(port: int) -> None:
    server = grpc.aio.server()
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(Constant(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m leasehold.bench.rls_bare")
    ap.add_argument("--port", type=int, required=True)
    import uvloop

    uvloop.run(serve(ap.parse_args().port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
