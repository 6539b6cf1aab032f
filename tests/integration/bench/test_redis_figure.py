"""The "redis" bench figure's workloads (bench/fig_redis.py) on a real redis-server: every
script call it measures, and every key it writes for the memory measurement, is a real execution
(no error reply) — a figure of error replies would measure nothing."""

from __future__ import annotations

import redis

from bench import fig_redis as fig
from region_agent.store import scripts as sc


def test_every_workload_and_every_memory_population_runs_without_an_error(redis_server):
    redis_server.cli("FLUSHALL")
    r = redis.Redis(port=redis_server.port)
    scripts = sc.Scripts()
    for w in fig.workloads():
        scripts.sha(w.script)  # lean variants of several kinds are registered when first named
    try:
        for s in scripts.scripts.values():
            r.script_load(s.source)
        for w in fig.workloads():
            if w.setup is not None:
                w.setup(r, scripts, 10)
            keys = [k.replace(fig.RAND, "000000000003") for k in w.keys]
            argv = [a.replace(fig.RAND, "000000000003") for a in w.argv]
            reply = r.evalsha(scripts.sha(w.script), len(keys), *keys, *argv)  # an error reply raises
            assert reply is not None, w.name
            r.flushall()
        assert {fig.multi_rule_workload(n).name for n in (1, 3, 5)} <= {w.name for w in fig.workloads()}
        # every script of lua/ has a workload: itself or (multi_rule, hot_chunk) the lean variant the agent runs
        assert {s for s in scripts.scripts if "[" not in s} <= {w.script.split("[")[0] for w in fig.workloads()}
        now = fig._now_ms(r)
        for name, (script, suffix, argv) in fig.MEMORY_CALLS.items():
            r.flushall()
            args = [a.replace("{now}", str(now)).replace("{expires}", str(now + 60_000)) for a in argv]
            fig.populate(r, scripts, script, f"string.format('{fig.KEY_FORMAT}', i % 50000, i * 2654435761) .. "
                                             f"'{suffix}'", 300, args)
            assert r.dbsize() == 300, name
            assert r.pttl(r.randomkey()) > 0, name  # the script set the expiry
    finally:
        r.flushall()
        r.close()
