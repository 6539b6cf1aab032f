"""The Redis sizing (leasehold/commands/redis_sizing.py) and ``leasehold capacity`` (leasehold/commands/capacity_cli.py)."""

from __future__ import annotations

import json

import pytest

from leasehold.commands import redis_sizing as rs
from leasehold.commands.cli import main

# round placeholder inputs: a 40,000 executions/s budget per primary, 200 B per key
REFERENCE = rs.Measured(cpu_us={rs.multi_rule_variant(n): 25.0 for n in (1, 3, 5)},
                        sustained={rs.multi_rule_variant(n): 40_000.0 for n in (1, 3, 5)},
                        bytes_per_key={"token_bucket": 200.0}, memory_keys=1_000_000)


def test_the_reference_sizing_comes_out_of_the_arithmetic():
    p = rs.plan(REFERENCE, calls_per_s=500_000, active_keys=2_000_000)
    assert p.per_core == 40_000
    assert p.shards == 20 and p.per_shard_calls == 25_000  # 62.5 % of the budget each
    assert p.live_bytes == 400e6 and p.per_copy_bytes == 800e6 and p.total_bytes == 1.6e9
    assert p.per_shard_copy_bytes == 40e6
    assert p.hot_budget == 40_000 < 75_000  # a 15 %-of-peak flood on one tenant is more than its primary
    assert p.hot_room == 15_000
    assert rs.plan(REFERENCE, calls_per_s=500_000, active_keys=1, utilisation=1.0).shards == 13  # the minimum


def test_cost_per_rule_is_interpolated_on_the_measured_line():
    m = rs.Measured(cpu_us={rs.multi_rule_variant(1): 10.0, rs.multi_rule_variant(3): 20.0,
                            rs.multi_rule_variant(5): 30.0}, sustained={}, bytes_per_key={"token_bucket": 1},
                    memory_keys=1)
    assert [m.multi_rule_cpu_us(n) for n in (1, 2, 4, 8)] == [10.0, 15.0, 25.0, 45.0]
    with pytest.raises(ValueError):
        m.multi_rule_cpu_us(9)


@pytest.mark.parametrize("kw", [dict(calls_per_s=0), dict(active_keys=-1), dict(utilisation=1.5),
                                dict(algorithm="nope"), dict(replicas=-1)])
def test_bad_inputs_are_refused(kw):
    args = dict(calls_per_s=1_000, active_keys=10) | kw
    with pytest.raises(ValueError):
        rs.plan(REFERENCE, **args)


def test_a_measurement_is_read_from_a_bench_run():
    rows = [{"figure": "redis", "name": f"{rs.multi_rule_variant(n)}: script executions/s, one redis-server",
             "value": 1000.0 * n, "extra": {"kind": "throughput", "cpu_us_per_call": 10.0 * n, "load_average": 1.5,
                                             "trials": [{"redis_cores": 0.9}], "clients": 16, "pipeline": 32,
                                             "commit": "abc1234", "redis_version": "7.0.15"}} for n in (1, 3, 5)]
    rows.append({"figure": "redis", "name": "token_bucket: bytes per key at 1,000,000 keys", "value": 199.4,
                 "extra": {"kind": "memory", "keys": 1_000_000}})
    rows.append({"figure": "1", "name": "other", "value": 1.0, "extra": {}})
    m = rs.from_results({"meta": {"started": 0, "trials": 3, "env": {"cpus": 2}}, "rows": rows})
    assert m.cpu_us[rs.multi_rule_variant(3)] == 30.0 and m.sustained[rs.multi_rule_variant(5)] == 5000
    assert m.bytes_per_key == {"token_bucket": 199.4} and m.memory_keys == 1_000_000
    assert m.meta["commit"] == "abc1234" and m.meta["redis"] == "7.0.15" and m.meta["load_average"] == [1.5, 1.5]
    assert rs.Measured.from_json(m.to_json()) == m
    with pytest.raises(ValueError, match="--only redis"):
        rs.from_results({"rows": rows[-1:]})


def test_the_shipped_measurement_is_a_full_bench_run():
    m = rs.shipped()
    assert {rs.multi_rule_variant(n) for n in (1, 3, 5)} <= set(m.cpu_us)
    assert len(m.cpu_us) >= 15 and set(m.cpu_us) == set(m.sustained)
    assert {"token_bucket", "gcra", "fixed_window", "sliding_counter", "sliding_log"} <= set(m.bytes_per_key)
    assert m.memory_keys == 1_000_000 and not m.meta.get("quick") and m.meta.get("commit")


def test_the_command(capsys):
    assert main(["capacity", "--calls-per-s", "500000", "--active-keys", "2,000,000"]) == 0
    out = capsys.readouterr().out
    assert "shards:" in out and "primaries" in out and "per copy" in out and "hottest key" in out
    assert main(["capacity", "--calls-per-s", "1000", "--active-keys", "10", "--rules", "5", "-o", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["plan"]["rules"] == 5 and got["plan"]["shards"] >= 1


def test_the_command_refuses_bad_input_with_a_message(capsys, tmp_path):
    assert main(["capacity", "--calls-per-s", "10", "--active-keys", "1", "--algorithm", "nope"]) == 2
    assert "leasehold: no measured bytes per key for 'nope'" in capsys.readouterr().err
    missing = tmp_path / "none.json"
    assert main(["capacity", "--calls-per-s", "10", "--active-keys", "1", "--results", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "cannot read" in err and "Traceback" not in err
    assert main(["-o", "json", "capacity", "--calls-per-s", "10", "--active-keys", "1", "--rules", "3",
                 "--results", str(missing)]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["exit"] == 2
    for bad in (["--calls-per-s", "0"], ["--calls-per-s", "x"], ["--active-keys", "-5"], ["--rules", "9"]):
        args = {"--calls-per-s": "10", "--active-keys": "1"} | dict(zip(bad[0::2], bad[1::2], strict=True))
        with pytest.raises(SystemExit) as e:
            main(["capacity", *[x for kv in args.items() for x in kv]])
        assert e.value.code == 2
