"""Figure 8's "no check" variants of the shipped gateway configs (bench/fig_gateways.py):
exactly the check is removed, everything else of the file stays."""

from __future__ import annotations

import re

import yaml

from bench.fig_gateways import auth_request_off, filter_off
from leasehold.local.gateways import render

VALUES = {"ENVOY_LISTEN_HOST": "127.0.0.1", "ENVOY_PORT": 1, "ENVOY_ADMIN_PORT": 2, "AGENT_HOST": "127.0.0.1",
          "AGENT_RLS_PORT": 3, "AGENT_HTTP_PORT": 4, "UPSTREAM_HOST": "127.0.0.1", "UPSTREAM_PORT": 5,
          "GATEWAY_TOKEN": "t", "NGINX_LISTEN_HOST": "127.0.0.1", "NGINX_PORT": 6, "JWT_ISSUER": "i",
          "JWT_AUDIENCE": "a", "JWKS_FILE": "/j", "TRACE_SAMPLE_PERCENT": 0, "OTLP_HOST": "127.0.0.1",
          "OTLP_PORT": 7}


def _filters(config: str) -> list[str]:
    doc = yaml.safe_load(config)
    return [h["name"] for lst in doc["static_resources"]["listeners"] for ch in lst["filter_chains"]
            for f in ch["filters"] for h in f["typed_config"]["http_filters"]]


def _render(name: str) -> str:
    from leasehold.local.gateways import tracing_values
    return render(name, **{**VALUES, **tracing_values()})


def test_filter_off_removes_only_the_named_filter():
    for template, name in (("envoy-rls.yaml", "envoy.filters.http.ratelimit"),
                           ("envoy-ext-authz.yaml", "envoy.filters.http.ext_authz")):
        before = _filters(_render(template))
        after = _filters(filter_off(_render(template), name))
        assert name in before and name not in after
        assert after == [f for f in before if f != name]


def test_auth_request_off_keeps_every_variable_and_location():
    cfg = _render("nginx.conf")
    off = auth_request_off(cfg)
    assert not re.search(r"^\s*auth_request", off, re.M)
    for var in set(re.findall(r"auth_request_set\s+(\$\w+)", cfg)):
        assert f'set {var} "";' in off
    assert re.findall(r"^\s*location\s.*$", off, re.M) == re.findall(r"^\s*location\s.*$", cfg, re.M)
