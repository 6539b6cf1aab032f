"""region_agent.gateways.bearer: the identity of a verified bearer JWT, and nothing else — every
way a token can be wrong is no identity, the same for all (an attacker learns nothing)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time

import jwt
import pytest

from leasehold.local.devjwt import DevIssuer
from region_agent.gateways.bearer import BearerVerifier, Identity

ISSUER = DevIssuer()


@pytest.fixture
def verifier(tmp_path) -> BearerVerifier:
    path = ISSUER.write_jwks(tmp_path / "jwks.json")
    return BearerVerifier(str(path), issuer=ISSUER.issuer, audience=ISSUER.audience)


def bearer(token: str) -> str:
    return "Bearer " + token


def b64(d: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()


def test_a_valid_token_is_its_claims(verifier):
    assert verifier.identity(bearer(ISSUER.token("U-17", "atlas", "K1"))) == Identity("atlas", "U-17", "K1")
    assert verifier.identity(bearer(ISSUER.token("U-18", "birch"))) == Identity("birch", "U-18", None)
    assert verifier.identity("bearer " + ISSUER.token("U-19", "atlas")) == Identity("atlas", "U-19", None)


def test_one_token_is_one_identity_however_the_credentials_are_spelled(verifier):
    """RFC 9110 11.1 (the scheme in any case), RFC 6750 2.1 (one or more spaces before the token),
    as the shipped Envoys read it: ``Bearer  <token>`` was no identity here, while Envoy read it."""
    token = ISSUER.token("U-20", "atlas", "K1")
    for spelling in ("Bearer {}", "bearer {}", "BEARER {}", "bEaReR {}", "Bearer  {}", "bearer   {}", " Bearer {} "):
        assert verifier.identity(spelling.format(token)) == Identity("atlas", "U-20", "K1"), spelling
    for spelling in ("Bearer\t{}", "Bearer{}", "Bearer ,{}", "xBearer {}", "Basic Bearer {}", "Bearer {} x",
                     "Token {}", "Bearer {}\n"):
        assert verifier.identity(spelling.format(token)) is None, spelling


def test_every_wrong_token_is_no_identity(verifier):
    stranger = DevIssuer()  # right issuer and audience, another key
    now = int(time.time())
    claims = {"iss": ISSUER.issuer, "aud": ISSUER.audience, "sub": "U-1", "tenant": "atlas", "exp": now + 60}
    wrong = [
        None, "", "Bearer", "Basic dXNlcjpwYXNz", "Bearer not.a.jwt",
        bearer(stranger.token("U-1", "atlas")),  # a signature of another key
        bearer(DevIssuer(kid=ISSUER.kid).token("U-1", "atlas")),  # the right kid, another key
        bearer(ISSUER.token("U-1", "atlas", ttl_s=-120)),  # expired (beyond the 30 s leeway)
        bearer(DevIssuer(key=ISSUER.key, issuer="https://elsewhere").token("U-1", "atlas")),  # another issuer
        bearer(DevIssuer(key=ISSUER.key, audience="another-api").token("U-1", "atlas")),  # another audience
        bearer(ISSUER.token("U-1", "atlas", nbf=now + 3_600)),  # not yet valid
        bearer(jwt.encode({k: v for k, v in claims.items() if k != "exp"}, ISSUER.key, algorithm="ES256",
                          headers={"kid": ISSUER.kid})),  # no expiry: refused, not eternal
        bearer(jwt.encode({k: v for k, v in claims.items() if k != "tenant"}, ISSUER.key, algorithm="ES256",
                          headers={"kid": ISSUER.kid})),  # no tenant claim
        bearer(jwt.encode({**claims, "sub": 17}, ISSUER.key, algorithm="ES256",
                          headers={"kid": ISSUER.kid})),  # a user id that is not a string
        bearer(b64({"alg": "none", "typ": "JWT", "kid": ISSUER.kid}) + "." + b64(claims) + "."),  # alg none
        bearer("x" * 20_000),  # too long to look at
    ]
    # alg confusion: HS256 keyed with the public key itself (PEM and JWK text), made by hand
    from cryptography.hazmat.primitives import serialization

    pem = ISSUER.key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    for secret in (pem, json.dumps(ISSUER.jwks()["keys"][0]).encode()):
        signing = b64({"alg": "HS256", "typ": "JWT", "kid": ISSUER.kid}) + "." + b64(claims)
        mac = hmac.new(secret, signing.encode(), hashlib.sha256).digest()
        wrong.append(bearer(signing + "." + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()))
    for header in wrong:
        assert verifier.identity(header) is None, header


def test_claim_names_are_settings(tmp_path):
    path = ISSUER.write_jwks(tmp_path / "jwks.json")
    v = BearerVerifier(str(path), issuer=ISSUER.issuer, audience=ISSUER.audience,
                       claims=["tenant=org", "api_key=key_id"])
    token = ISSUER.token("U-5", "ignored", org="atlas", key_id="K9")
    assert v.identity(bearer(token)) == Identity("atlas", "U-5", "K9")


def test_a_rotated_jwks_file_is_read_again(tmp_path):
    path = ISSUER.write_jwks(tmp_path / "jwks.json")
    clock = [0.0]
    v = BearerVerifier(str(path), issuer=ISSUER.issuer, audience=ISSUER.audience, clock=lambda: clock[0])
    rotated = DevIssuer(kid="dev-2")
    assert v.identity(bearer(rotated.token("U-1", "atlas"))) is None
    rotated.write_jwks(path)
    os.utime(path, (time.time() + 5, time.time() + 5))  # a new mtime even on a coarse clock
    clock[0] += 2.0  # past the reload check interval
    assert v.identity(bearer(rotated.token("U-1", "atlas"))) == Identity("atlas", "U-1", None)
    assert v.identity(bearer(ISSUER.token("U-1", "atlas"))) is None  # the old key is gone with the file


def test_a_bad_jwks_file_is_a_settings_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="JWKS"):
        BearerVerifier(str(bad), issuer="i", audience="a")
    secret_only = tmp_path / "oct.json"
    secret_only.write_text(json.dumps({"keys": [{"kty": "oct", "k": "c2VjcmV0", "alg": "HS256"}]}))
    with pytest.raises(ValueError):
        BearerVerifier(str(secret_only), issuer="i", audience="a")
    with pytest.raises(ValueError):
        BearerVerifier(str(tmp_path / "missing.json"), issuer="i", audience="a")
