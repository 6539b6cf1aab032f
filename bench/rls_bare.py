"""The ceiling of figure 8: a bare grpcio rate limit service answering every ``ShouldRateLimit``
with a constant ``OK``. The figure's ceiling is ``grpc.aio`` on uvloop, one process like the agent;
the other servers are for the comparison of gRPC server models (``--server``):

* ``aio`` — ``grpc.aio`` on uvloop (the agent's model: the RLS port in the agent's event loop);
* ``sync`` — grpcio's synchronous server, handlers on a thread pool of ``--threads``;
* ``--processes N`` — N such processes on one port (``grpc.so_reuseport``).

    python -m bench.rls_bare --port N [--server aio|sync] [--threads 8] [--processes 1]"""

from __future__ import annotations

import argparse
import multiprocessing
import signal
import sys
from concurrent import futures

import grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

OK = rls_pb2.RateLimitResponse(overall_code=rls_pb2.RateLimitResponse.OK)
OPTIONS = [("grpc.so_reuseport", 1)]


class Constant(rls_pb2_grpc.RateLimitServiceServicer):
    async def ShouldRateLimit(self, request, context):  # noqa: N802 (the generated name)
        return OK


class SyncConstant(rls_pb2_grpc.RateLimitServiceServicer):
    def ShouldRateLimit(self, request, context):  # noqa: N802 (the generated name)
        return OK


async def serve(port: int) -> None:
    server = grpc.aio.server(options=OPTIONS)
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(Constant(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def serve_sync(port: int, threads: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=OPTIONS)
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(SyncConstant(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def _one(kind: str, port: int, threads: int) -> None:
    if kind == "sync":
        serve_sync(port, threads)
    else:
        import uvloop

        uvloop.run(serve(port))


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rls_bare")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--server", choices=("aio", "sync"), default="aio")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--processes", type=int, default=1)
    a = ap.parse_args()
    if a.processes <= 1:
        _one(a.server, a.port, a.threads)
        return 0
    # grpcio must not be started before the fork: each worker is a fresh interpreter. SIGTERM (how
    # the bench stops a process) ends the wait below, so the workers are stopped with the parent
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_one, args=(a.server, a.port, a.threads), daemon=True) for _ in range(a.processes)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
