"""Trying a deployment by hand, as docs/deployment.md says: ``leasehold secrets generate`` writes a
development identity provider's key and JWKS, ``leasehold token`` (the installed command, run as a
process) mints a client's token with that key — the docs' own commands run as written — and Envoy configured as compose configures it
(``deploy/gateways/envoy-rls.yaml`` with ``JWKS_FILE`` the generated ``jwks.json`` and the issuer
and audience compose defaults to) admits the client with the identity the token names. A token of
another key is refused (401), and so is one for another audience (403)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from leasehold.local.gateways import Envoy, render
from leasehold.local.procs import LOOPBACK, free_port

from .conftest import ROOT, Stack, identity

pytestmark = pytest.mark.e2e


def compose_default(name: str) -> str:
    """The default ``${NAME:-default}`` compose gives Envoy's ``name``."""
    env = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())["services"]["envoy-eu"]["environment"]
    m = re.fullmatch(r"\$\{" + name + r":-(.+)\}", env[name])
    assert m, env[name]
    return m.group(1)


def docs_block(page: str, word: str) -> str:
    """The one ``sh`` block of docs/``page`` that contains ``word``."""
    (found,) = [b for b in re.findall(r"^```sh\n(.*?)^```", (ROOT / "docs" / page).read_text(), re.S | re.M)
                if word in b]
    return found


def leasehold(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).with_name("leasehold")), *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=60)


def test_a_generated_dev_key_and_a_minted_token_get_through_envoy_as_compose_runs_it(stack: Stack, tmp_path: Path):
    r = leasehold("secrets", "generate", "--out", "deploy/secrets", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    secrets_dir = tmp_path / "deploy" / "secrets"
    assert (secrets_dir / "dev-idp.key").stat().st_mode & 0o077 == 0  # the private key is the owner's only
    r = leasehold("token", "--tenant", "atlas", "--user", "U-90", "--api-key", "K9", cwd=tmp_path)  # the default --key
    assert r.returncode == 0, r.stderr
    token = r.stdout.strip()
    assert token.count(".") == 2 and "\n" not in token
    other_audience = leasehold("token", "--tenant", "atlas", "--user", "U-91", "--audience", "another-api",
                               cwd=tmp_path).stdout.strip()

    port, admin = free_port(), free_port()
    values = stack.values(ENVOY_LISTEN_HOST=LOOPBACK, ENVOY_PORT=port, ENVOY_ADMIN_PORT=admin,
                          JWKS_FILE=secrets_dir / "jwks.json", JWT_ISSUER=compose_default("JWT_ISSUER"),
                          JWT_AUDIENCE=compose_default("JWT_AUDIENCE"))
    envoy = Envoy("envoy-dev-idp", render("envoy-rls.yaml", **values), stack.workdir / "envoy-dev-idp", port,
                  admin).start()
    try:
        # the docs' commands, as written (only the virtualenv and Envoy's address are this test's)
        for page in ("deployment.md", "gateways.md"):
            script = docs_block(page, "leasehold token")
            assert "localhost:10000" in script and ".venv/bin/leasehold token" in script
            script = script.replace(".venv/bin/", f"{Path(sys.executable).parent}/").replace(
                "localhost:10000", f"{LOOPBACK}:{port}")
            r = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], cwd=tmp_path, capture_output=True,
                               text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            assert r.stdout.startswith("HTTP/1.1 200") and '"read-user-v3";q=20;w=10' in r.stdout, (page, r.stdout)
        with httpx.Client(base_url=envoy.url, timeout=10) as c:
            ok = c.get("/catalog", headers={"authorization": f"Bearer {token}"})
            assert ok.status_code == 200, ok.text
            seen = ok.json()["headers"]
            assert (seen["x-tenant-id"], seen["x-user-id"], seen["x-api-key-id"]) == ("atlas", "U-90", "K9")
            assert ok.headers["ratelimit-policy"] == '"read-user-v3";q=20;w=10'
            # repeated, as the docs say: a 429 with Retry-After once the burst (20, refilled 2 a
            # second) is spent — no sooner, and no later than the refill over the elapsed time allows
            started, admitted = time.monotonic(), 1
            for _ in range(80):
                r = c.get("/catalog", headers={"authorization": f"Bearer {token}"})
                if r.status_code != 200:
                    break
                admitted += 1
            elapsed = time.monotonic() - started
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
            assert 20 <= admitted <= 20 + 2 * elapsed + 1, (admitted, elapsed)
            # the test suite's own issuer (another key): 401; a token for another audience: 403 (jwt_authn)
            assert c.get("/catalog", headers=identity("U-92")).status_code == 401
            assert c.get("/catalog", headers={"authorization": f"Bearer {other_audience}"}).status_code == 403
    finally:
        envoy.stop()


def test_token_refuses_what_no_gateway_would_accept(tmp_path: Path):
    r = leasehold("token", "--tenant", "atlas", "--user", "U-1", cwd=tmp_path)  # nothing generated here
    assert r.returncode == 2 and "leasehold secrets generate" in r.stderr and "Traceback" not in r.stderr
    assert leasehold("secrets", "generate", "--out", "s", cwd=tmp_path).returncode == 0
    r = leasehold("token", "--tenant", "Not_A_Tenant", "--user", "U-1", "--key", "s/dev-idp.key", cwd=tmp_path)
    assert r.returncode == 2 and "--tenant must match" in r.stderr
    r = leasehold("token", "--tenant", "atlas", "--user", "U-1", "--key", "s/policy-signing.key", cwd=tmp_path)
    assert r.returncode == 2 and "P-256" in r.stderr and "Traceback" not in r.stderr
