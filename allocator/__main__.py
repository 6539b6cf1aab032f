"""``python -m allocator --etcd ENDPOINTS --policy FILE --node-id ID --host H --port N``."""

from __future__ import annotations

import os
import sys

# grpc's core logs (C, to stderr) before anything else of it runs: off unless asked for, as on the
# agent. A refused TLS handshake with etcd was its line and then the allocator's refusal saying it
# again; what the allocator must say about its etcd links it logs itself (the refusal, the gauge)
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from kernel.config import ConfigError
from kernel.errors import PolicyError


def main(argv: list[str] | None = None) -> int:
    from .settings import load

    try:
        settings = load(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"allocator: {e.message}", file=sys.stderr)
        return 2
    from kernel import tracing

    try:
        tracing.check(settings.otlp_endpoint)
    except tracing.TracingUnavailable as e:
        print(f"allocator: refusing to start: {e}", file=sys.stderr)
        return 2
    from kernel.logs import configure

    log_config = configure(settings.log_level, settings.log_format)
    from kernel.httpserver import quiet_request_logs, serve

    from .app import create_app, etcd_refusal

    try:
        app = create_app(settings, install_signal_handlers=True)
    except PolicyError as e:
        print(f"allocator: refusing to start: {e.detail}", file=sys.stderr)
        for problem in e.further:  # a problem the line states already is not said again
            print(f"  - {problem}", file=sys.stderr)
        return 2
    import asyncio

    refusal = asyncio.run(etcd_refusal(settings))  # its credentials, its role's permissions, TLS
    if refusal is not None:
        print(f"allocator: {refusal}", file=sys.stderr)
        return 2
    quiet_request_logs(settings.log_level)
    serve(app, host=settings.host, port=settings.port, limits=settings.http_limits(), log_level=settings.log_level,
          access_log=settings.access_log, ssl_certfile=settings.tls_cert_file, ssl_keyfile=settings.tls_key_file,
          log_config=log_config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
