"""Figure 2's cross-check client (bench/wrk.py) against the raw ASGI echo
(bench/raw_echo.py), both real processes: every body the Lua script builds decodes
strictly into an AdmitRequest (the echo answers 400 otherwise, which wrk counts as non-2xx), and
the echo's answer is the same request encoded again."""

from __future__ import annotations

import json
import sys

import httpx

from bench import raw_echo, wrk
from bench.workloads import MIX, admit_item
from leasehold.local.procs import Proc, free_port, wait_port


def test_wrk_bodies_are_admission_requests_the_raw_echo_accepts(tmp_path):
    port = free_port()
    echo = Proc("raw-echo", [sys.executable, "-m", raw_echo.__name__, "--port", str(port)], tmp_path / "echo").start()
    try:
        wait_port(port, proc=echo.popen, timeout=30)
        body = admit_item(3)
        got = httpx.post(f"http://127.0.0.1:{port}/v1/admit", json=body)
        assert got.status_code == 200
        echoed = json.loads(got.content)
        assert echoed["requestId"] == body["requestId"] and echoed["principal"]["id"] == body["principal"]["id"]
        assert httpx.post(f"http://127.0.0.1:{port}/v1/admit", json={**body, "extra": 1}).status_code == 400
        res = wrk.run_wrk(port, tmp_path / "wrk", conns=4, duration_s=1, threads=2, principals=100)
        assert res["requests"] > 0
        assert res["non2xx"] == 0 and res["errors"] == 0
        assert res["p50_ms"] <= res["p99_ms"]
    finally:
        echo.stop()


def test_the_lua_script_spells_the_python_mix():
    lua = wrk.script(principals=10_000, tag="t")
    for _share, tenant, ptype, route in MIX:
        assert f'{{"{tenant or ""}","{ptype}","{route}"}}' in lua
    assert "local principals = 10000" in lua
