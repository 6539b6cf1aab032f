"""``python -m allocator --etcd ENDPOINTS --policy FILE --node-id ID --host H --port N``."""

from __future__ import annotations

import logging
import sys

from kernel.config import ConfigError
from kernel.errors import PolicyError


def main(argv: list[str] | None = None) -> int:
    from .settings import load

    try:
        settings = load(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"allocator: {e.message}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from .app import create_app

    try:
        app = create_app(settings)
    except PolicyError as e:
        print(f"allocator: {e.detail}", file=sys.stderr)
        for err in e.errors:
            print(f"  - {err}", file=sys.stderr)
        return 2
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    config = uvicorn.Config(app, host=settings.host, port=settings.port, loop=loop,
                            log_level=settings.log_level, access_log=False, lifespan="on",
                            ssl_certfile=settings.tls_cert_file, ssl_keyfile=settings.tls_key_file)
    uvicorn.Server(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
