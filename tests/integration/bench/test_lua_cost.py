"""bench.lua_cost at a tiny size on the redis-server it starts: every workload (the agent's own
multi_rule, hot_chunk and single-rule calls) runs without an error reply and gets a time per call
for both trees; a workload whose calls are refused by the script is refused by the bench."""

from __future__ import annotations

import pytest

from bench import lua_cost


def test_every_workload_of_both_trees_is_measured(tmp_path):
    work = lua_cost.workloads()
    got = lua_cost.measure({"base": lua_cost.CHECKOUT, "this": lua_cost.CHECKOUT}, work, calls=30, users=10,
                           rounds=1, workdir=tmp_path)
    assert list(got) == [w.name for w in work]
    assert all(len(t) == 1 and t[0] > 0 for per_tree in got.values() for t in per_tree.values())
    text = lua_cost.table(got)
    assert len(text.splitlines()) == len(work) + 2 and "this us/call" in text and " %)" in text
    # the agent's scripts are all there: multi_rule (with and without a record), hot_chunk
    assert {w.script.split("[")[0] for w in work} >= {"multi_rule", "hot_chunk", "token_bucket"}
    assert any("record" in w.name for w in work) and any("record" not in w.name for w in work)
    cpu = lua_cost.measure({"this": lua_cost.CHECKOUT}, work[:1], calls=200, users=10, rounds=1, workdir=tmp_path / "c",
                           cpu=True)
    assert cpu[work[0].name]["this"][0] > 0  # the redis-server process's CPU per call


def test_a_workload_answered_by_errors_is_refused(tmp_path):
    good = lua_cost.single("token_bucket", lambda i: [20_000, 2_000, 1_000, 1_000, 5_000])
    bad = lua_cost.single("token_bucket", lambda i: [0, 2_000, 1_000, 1_000, 5_000])  # capacity 0: invalid
    lua_cost.measure({"this": lua_cost.CHECKOUT}, [good], calls=5, users=5, rounds=1, workdir=tmp_path / "a")
    with pytest.raises(RuntimeError, match="answered an error"):
        lua_cost.measure({"this": lua_cost.CHECKOUT}, [bad], calls=5, users=5, rounds=1, workdir=tmp_path / "b")
