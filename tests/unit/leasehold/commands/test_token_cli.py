"""``leasehold token``: a token from the key ``leasehold secrets generate`` wrote verifies against
the JWKS written beside it (with the agent's own verifier, as nginx/Traefik deployments use it),
``-o json`` gives the token with its claims, and every bad input is a one-line error with exit 2
(``-o json``: an error document on stdout), never a traceback. The real gateway with a minted
token: tests/e2e/gateways/test_dev_identity.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from leasehold.commands.cli import main
from leasehold.commands.output import Exit
from leasehold.commands.secrets import generate
from leasehold.local.devjwt import AUDIENCE, ISSUER
from region_agent.gateways.bearer import BearerVerifier


@pytest.fixture
def secrets_dir(tmp_path: Path) -> Path:
    return generate(tmp_path / "secrets").dir


def test_a_minted_token_verifies_against_the_generated_jwks(secrets_dir: Path, capsys):
    key = str(secrets_dir / "dev-idp.key")
    assert main(["token", "--tenant", "atlas", "--user", "U-17", "--api-key", "K1", "--key", key]) == Exit.OK
    token = capsys.readouterr().out.strip()  # text: the token alone (TOKEN=$(leasehold token ...))
    verifier = BearerVerifier(str(secrets_dir / "jwks.json"), issuer=ISSUER, audience=AUDIENCE)
    got = verifier.identity(f"Bearer {token}")
    assert got is not None and (got.tenant, got.user, got.api_key) == ("atlas", "U-17", "K1")

    assert main(["token", "-o", "json", "--tenant", "atlas", "--user", "U-17", "--key", key, "--ttl-s", "60"]) == 0
    doc = json.loads(capsys.readouterr().out)
    jwks = json.loads((secrets_dir / "jwks.json").read_text())
    assert doc["kid"] == jwks["keys"][0]["kid"] and doc["kid"].startswith("dev-")
    assert doc["claims"]["tenant"] == "atlas" and doc["claims"]["sub"] == "U-17" and "api_key" not in doc["claims"]
    assert doc["claims"]["exp"] - doc["claims"]["iat"] == 60
    assert verifier.identity(f"Bearer {doc['token']}") is not None


def test_a_key_of_another_generation_is_refused_by_this_jwks(tmp_path: Path, secrets_dir: Path, capsys):
    other = generate(tmp_path / "other").dir
    assert main(["token", "--tenant", "atlas", "--user", "U-1", "--key", str(other / "dev-idp.key")]) == 0
    token = capsys.readouterr().out.strip()
    verifier = BearerVerifier(str(secrets_dir / "jwks.json"), issuer=ISSUER, audience=AUDIENCE)
    assert verifier.identity(f"Bearer {token}") is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--tenant", "atlas", "--user", "U-1", "--key", "{dir}/missing.key"], "run leasehold secrets generate"),
    (["--tenant", "atlas", "--user", "U-1", "--key", "{dir}/policy-signing.key"], "P-256"),
    (["--tenant", "atlas", "--user", "U-1", "--key", "{dir}/jwks.json"], "not an unencrypted PEM private key"),
    (["--tenant", "Not_A_Tenant", "--user", "U-1", "--key", "{dir}/dev-idp.key"], "--tenant must match"),
    (["--tenant", "atlas", "--user", "", "--key", "{dir}/dev-idp.key"], "--user must be 1 to 256 characters"),
    (["--tenant", "atlas", "--user", "U-1", "--api-key", "k" * 257, "--key", "{dir}/dev-idp.key"], "--api-key"),
    (["--tenant", "atlas", "--user", "U-1", "--ttl-s", "0", "--key", "{dir}/dev-idp.key"], "--ttl-s must be"),
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str, secrets_dir: Path, capsys):
    argv = [a.replace("{dir}", str(secrets_dir)) for a in argv]
    assert main(["token", *argv]) == Exit.USAGE
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("leasehold: ") and message in err and "Traceback" not in err
    assert main(["token", "-o", "json", *argv]) == Exit.USAGE
    assert message in json.loads(capsys.readouterr().out)["error"]["message"]


def test_a_malformed_number_is_a_usage_error(secrets_dir: Path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["token", "--tenant", "atlas", "--user", "U-1", "--ttl-s", "soon"])
    assert e.value.code == Exit.USAGE and "Traceback" not in capsys.readouterr().err
