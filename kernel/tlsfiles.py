"""Start-time checks of TLS files (PEM certificate chain, its private key, a CA bundle) with the
standard library's ``ssl``: a wrong file is refused with its name when a service starts, not as
a handshake error in a log later. The files themselves are used by uvicorn, grpc and redis-py."""

from __future__ import annotations

import ssl


def _reason(e: Exception) -> str:
    return getattr(e, "reason", None) or str(e) or type(e).__name__


def check_tls_files(cert: str | None = None, key: str | None = None, ca: str | None = None) -> None:
    """``ValueError`` naming the file when ``ca`` is not a PEM CA bundle, or ``cert`` / ``key``
    are not a PEM certificate chain and its (unencrypted, matching) private key."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca:
        try:
            ctx.load_verify_locations(cafile=ca)
        except (ssl.SSLError, ValueError) as e:
            raise ValueError(f"{ca} is not a PEM CA certificate bundle ({_reason(e)})") from None
    if cert or key:
        if not (cert and key):
            raise ValueError("a certificate and its private key go together: give both")
        try:
            ctx.load_cert_chain(cert, key, password=lambda: b"")  # an encrypted key fails, never prompts
        except (ssl.SSLError, ValueError) as e:
            raise ValueError(f"{cert} and {key} are not a PEM certificate chain and its unencrypted, "
                             f"matching private key ({_reason(e)})") from None
