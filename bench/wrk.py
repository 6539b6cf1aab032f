"""The cross-check of the bench's own load generator (``loadgen.py``): the same admission
bodies sent by ``wrk`` (Debian package, C + LuaJIT, installed by ``make bench``), so a figure's
ratio does not depend on our client. ``run_wrk(port, ...)`` writes a Lua script that builds the
i-th body of the Northstar mix exactly as :func:`.workloads.admit_item` does (each wrk thread
with its own request-id tag), runs wrk for a bounded time and returns its counts and latency
percentiles in the load generator's units (requests/s, ms)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from .workloads import MIX

# the Lua twin of workloads.admit_item (tenant, principal type, route group per slot of 20)
_LUA = r"""
local slots = {%(slots)s}
local principals = %(principals)d
local counter = 0
local tag = "%(tag)s"
local n = 0

function setup(thread)
  n = n + 1
  thread:set("tid", n)
end

function init(args)
  tag = tag .. "w" .. tostring(tid or 0)
end

local headers = {["Content-Type"] = "application/json"}

function request()
  local i = counter
  counter = counter + 1
  local s = slots[((i * 7) %% #slots) + 1]
  local p = (i * 7919) %% principals
  local pid
  if s[2] == "anonymous" then
    pid = string.format("10.%%d.%%d.%%d", math.floor(p / 65536) %% 256, math.floor(p / 256) %% 256, p %% 256)
  else
    pid = "user-" .. p
  end
  local body = string.format('{"requestId":"%%s-%%010d","principal":{"type":"%%s","id":"%%s"},"routeGroup":"%%s"',
                             tag, i, s[2], pid, s[3])
  if s[1] ~= "" then
    body = body .. ',"tenantId":"' .. s[1] .. '"'
  end
  return wrk.format("POST", "%(path)s", headers, body .. "}")
end

function done(summary, latency, requests)
  local non2xx = summary.errors.status
  io.write(string.format('WRKJSON {"requests":%%d,"duration_us":%%d,"non2xx":%%d,"errors":%%d,' ..
                         '"p50_us":%%d,"p99_us":%%d}\n', summary.requests, summary.duration, non2xx,
                         summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
                         latency:percentile(50), latency:percentile(99)))
end
"""


def available() -> bool:
    return shutil.which("wrk") is not None


def script(path: str = "/v1/admit", principals: int = 10_000, tag: str = "wrk") -> str:
    slots = ",".join(f'{{"{tenant or ""}","{ptype}","{route}"}}'
                     for share, tenant, ptype, route in MIX for _ in range(share))
    return _LUA % {"slots": slots, "principals": principals, "tag": tag, "path": path}


def run_wrk(port: int, workdir: Path, *, conns: int, duration_s: float, threads: int = 2, principals: int = 10_000,
            tag: str = "wrk", path: str = "/v1/admit") -> dict:
    """One bounded wrk run against ``127.0.0.1:port``; requests/s of 2xx answers, p50/p99 in ms.
    (wrk has no warm-up phase: the caller warms the server with the load generator first.)"""
    workdir.mkdir(parents=True, exist_ok=True)
    lua = workdir / f"{tag}.lua"
    lua.write_text(script(path, principals, tag))
    secs = max(1, round(duration_s))
    out = subprocess.run(["wrk", "-t", str(threads), "-c", str(conns), "-d", f"{secs}s", "--timeout", "5s",
                          "-s", str(lua), f"http://127.0.0.1:{port}"],
                         capture_output=True, text=True, timeout=secs + 30)
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr[-1000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("WRKJSON "))
    res = json.loads(line.removeprefix("WRKJSON "))
    elapsed = res["duration_us"] / 1e6
    ok = res["requests"] - res["non2xx"]
    return {"rps": ok / elapsed if elapsed else 0.0, "requests": res["requests"], "non2xx": res["non2xx"],
            "errors": res["errors"], "p50_ms": res["p50_us"] / 1000, "p99_ms": res["p99_us"] / 1000}
