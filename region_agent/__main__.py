"""``python -m region_agent --redis-url URL --policy FILE --region NAME --host H --port N``

Every option is also settable as ``LEASEHOLD_AGENT_<FIELD>``. Refuses to start on invalid
settings, an invalid policy bundle (printing every problem) or a missing pepper."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

# grpc's core logs (C, to stderr) before anything else of it runs: off unless asked for. It wrote a
# line per call a client sent with a header it refuses (an unknown grpc-encoding), before any
# credential was looked at; what the agent must say about its gRPC port it logs itself
# (docs/decisions/0068-the-grpc-ports-slots-are-the-agents.md)
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from kernel import tracing
from kernel.bundle import load_bundle_file
from kernel.config import ConfigError
from kernel.errors import PolicyError
from kernel.signing import TrustedKeys

from .service.settings import ENV_PREFIX, AgentSettings, load_agent_settings, resolve_pepper


def app_factory():
    """Used by uvicorn (also in each worker process): settings come from the environment."""
    from .service.app import create_app

    settings = load_agent_settings([])
    from kernel.httpserver import quiet_request_logs
    quiet_request_logs(settings.log_level)  # a worker process configures its own loggers
    return create_app(settings, pepper=resolve_pepper(settings), install_signal_handlers=True,
                      freeze_heap=True)


def _export(settings: AgentSettings) -> None:
    for name in settings.__struct_fields__:
        value = getattr(settings, name)
        if value is None:
            continue
        if isinstance(value, bool):
            text = str(value).lower()
        elif isinstance(value, (list, tuple)):
            text = ",".join(str(v) for v in value)
        else:
            text = str(value)
        os.environ[ENV_PREFIX + name.upper()] = text


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load_agent_settings(sys.argv[1:] if argv is None else argv)
        resolve_pepper(settings)
    except ConfigError as e:
        print(f"region_agent: {e}", file=sys.stderr)
        return 2
    try:
        # the signature first: a bundle no trusted key signed is refused before it is validated
        trusted = TrustedKeys.from_files(settings.policy_public_keys)
        bundle = load_bundle_file(settings.policy, verify=trusted.check)
    except PolicyError as e:
        print(f"region_agent: refusing to start: {e.detail}", file=sys.stderr)
        for problem in e.further:  # a problem the line states already is not said again
            print(f"  - {problem}", file=sys.stderr)
        return 2
    try:
        tracing.check(settings.otlp_endpoint)
    except tracing.TracingUnavailable as e:
        print(f"region_agent: refusing to start: {e}", file=sys.stderr)
        return 2
    from .service.app import policy_etcd_refusal, store_refusal

    refusal = asyncio.run(store_refusal(settings))  # its credentials, its ACL user, its eviction policy
    if refusal is None and settings.policy_etcd:  # its etcd credentials, its role's read, TLS (0065)
        try:
            refusal = asyncio.run(policy_etcd_refusal(settings))
        except ConfigError as e:  # its password file unreadable
            print(f"region_agent: {e}", file=sys.stderr)
            return 2
    if refusal is not None:
        print(f"region_agent: refusing to start: {refusal}", file=sys.stderr)
        return 2
    from kernel.logs import configure

    log_config = configure(settings.log_level, settings.log_format)
    logging.getLogger(__package__).info(
        "starting region agent: region=%s policy version=%s listening on %s:%s",
        settings.region, bundle.bundle_version, settings.host, settings.port)
    _export(settings)

    from kernel.httpserver import quiet_request_logs, serve

    from .service.fastpath import direct_routes

    quiet_request_logs(settings.log_level)

    from kernel.metrics_exposition import worker_metrics_dir

    with worker_metrics_dir(settings.workers):  # several workers: one consistent /metrics (metrics files)
        serve("region_agent.__main__:app_factory", factory=True, host=settings.host, port=settings.port,
              workers=settings.workers, limits=settings.http_limits(), log_level=settings.log_level,
              access_log=settings.access_log, ssl_certfile=settings.tls_cert_file, ssl_keyfile=settings.tls_key_file,
              log_config=log_config, proxy_headers=False,  # the agent reads no address from the scope
              direct=direct_routes,  # POST /v1/admit answered by the HTTP protocol itself
              other_connections=settings.rls_max_connections if settings.rls_port else 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
