"""INFO -> store-health snapshot (region_agent/service/store_health.py); the live poll is tested against
real Redis primaries and replicas in tests/integration/region_agent/test_store_health.py."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from region_agent.service.store_health import StoreHealth, parse_info

INFO = {"used_memory": 1_048_576, "maxmemory": 0, "evicted_keys": 3, "expired_keys": 17, "connected_clients": 4,
        "db0": {"keys": 10, "expires": 9, "avg_ttl": 1000}, "db1": {"keys": 2, "expires": 0, "avg_ttl": 0},
        "connected_slaves": 2, "master_repl_offset": 5_000,
        "slave0": {"ip": "127.0.0.1", "port": 1, "state": "online", "offset": 4_900, "lag": 0},
        "slave1": {"ip": "127.0.0.1", "port": 2, "state": "online", "offset": 3_000, "lag": 2},
        "cmdstat_evalsha": {"calls": 100, "usec": 2_500, "usec_per_call": 25.0},
        "cmdstat_eval": {"calls": 1, "usec": 500}}


def test_parse_info_fields():
    s = parse_info(INFO)
    assert s["keys"] == 12 and s["replicas"] == 2 and s["replica_lag_seconds"] == 2
    assert s["replica_lag_bytes"] == 2_000 and s["script_calls"] == 101 and s["script_seconds"] == 0.003
    assert parse_info({})["replicas"] == 0


def test_collector_exports_one_series_per_shard_and_drops_vanished_shards():
    h = StoreHealth(clock=lambda: 10.0)
    reg = CollectorRegistry()
    reg.register(h)
    h.replace({"a:1": INFO, "b:2": INFO})
    out = generate_latest(reg).decode()
    assert 'leasehold_agent_redis_evicted_keys_total{shard="a:1"} 3.0' in out
    assert 'leasehold_agent_redis_script_seconds_total{shard="b:2"} 0.003' in out
    h.replace({"a:1": INFO})
    assert 'shard="b:2"' not in generate_latest(reg).decode()
