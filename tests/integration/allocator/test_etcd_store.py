"""The etcd adapter against a real cluster: endpoint failover, error translation, transactions,
etcd leases, watches."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess

import pytest

from kernel.errors import StoreUnavailable
from kernel.etcd_store import EtcdLeaseMissing, EtcdStore, EtcdTxnTooLarge, TxnBuilder, prefix_range_end
from leasehold.local.procs import EtcdCluster, free_port
from tests.support.allocator_app import unique_prefix


async def test_moves_past_a_dead_endpoint(etcd_cluster: EtcdCluster) -> None:
    seen: list[str] = []
    store = EtcdStore(f"127.0.0.1:{free_port()}," + ",".join(etcd_cluster.endpoints), timeout_s=1,
                      observe=lambda op, s: seen.append(op))
    key = (unique_prefix() + "k").encode()
    try:
        txn = TxnBuilder()
        txn.absent(key)
        txn.put(key, b"v1")
        res = await store.commit(txn)
        assert res.succeeded and res.revision > 0
        kv = await store.get(key)
        assert kv is not None and kv.value == b"v1" and kv.mod_revision == res.revision
        txn = TxnBuilder()
        txn.absent(key)
        txn.put(key, b"v2")
        assert not (await store.commit(txn)).succeeded  # the compare protects a retried write
        assert (await store.get_many([key]))[key].value == b"v1"
        assert "txn" in seen
    finally:
        await store.close()


async def test_all_endpoints_dead_is_store_unavailable() -> None:
    store = EtcdStore(f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}", timeout_s=0.5)
    try:
        with pytest.raises(StoreUnavailable) as e:
            await store.get(b"/x")
        assert e.value.retriable and e.value.status == 503
    finally:
        await store.close()


async def test_etcd_leases_keepalive_revoke_and_a_missing_one(etcd_cluster: EtcdCluster) -> None:
    store = EtcdStore(",".join(etcd_cluster.endpoints), timeout_s=2)
    key = (unique_prefix() + "on-lease").encode()
    try:
        lease = await store.lease_grant(30)
        assert 25 <= await store.lease_keepalive(lease) <= 30
        txn = TxnBuilder()
        txn.put(key, b"v", lease)
        assert (await store.commit(txn)).succeeded
        await store.lease_revoke(lease)
        assert await store.get(key) is None  # revoking deletes what is attached
        assert await store.lease_keepalive(lease) <= 0  # gone: etcd answers TTL 0
        with pytest.raises(EtcdLeaseMissing):
            await store.lease_revoke(lease)
        txn = TxnBuilder()
        txn.put(key, b"v", lease)
        with pytest.raises(EtcdLeaseMissing):
            await store.commit(txn)
    finally:
        await store.close()


async def test_a_snapshot_and_a_watch(etcd_cluster: EtcdCluster) -> None:
    store = EtcdStore(",".join(etcd_cluster.endpoints), timeout_s=2)
    p = unique_prefix()
    try:
        txn = TxnBuilder()
        for k in ("a/1", "a/2", "b"):
            txn.put(f"{p}{k}".encode(), k.encode())
        written = (await store.commit(txn)).revision
        rev, (under_a, b, missing) = await store.snapshot([f"{p}a/".encode()], [f"{p}b".encode(), f"{p}c".encode()])
        assert rev == written and [kv.value for kv in under_a] == [b"a/1", b"a/2"]
        assert [kv.value for kv in b] == [b"b"] and missing == []
        assert [kv.key for kv in await store.get_prefix(f"{p}a/".encode())] == [kv.key for kv in under_a]
        watch = await store.watch(f"{p}a/".encode(), prefix_range_end(f"{p}a/".encode()))
        txn = TxnBuilder()
        txn.put(f"{p}b".encode(), b"not watched")
        txn.put(f"{p}a/3".encode(), b"watched")
        await store.commit(txn)
        events = aiter(watch)
        first = await asyncio.wait_for(anext(events), 5)
        assert [bytes(e.kv.key) for e in first.events] == [f"{p}a/3".encode()]
        await watch.cancel()
    finally:
        await store.close()


async def test_txn_builder_commits_one_protobuf_transaction(etcd_cluster: EtcdCluster) -> None:
    store = EtcdStore(",".join(etcd_cluster.endpoints), timeout_s=2)
    p = unique_prefix()
    a, b, c = (f"{p}{x}".encode() for x in "abc")
    try:
        lease = await store.lease_grant(30)
        txn = TxnBuilder()
        txn.absent(a)
        txn.absent_many([b])
        txn.put(a, b"A", lease)
        txn.put_many([(b, b"B", 0)])
        res = await store.commit(txn)
        assert res.succeeded and res.revision > 0
        got = await store.get_many([a, b, c])
        assert set(got) == {a, b} and got[a].value == b"A" and got[a].lease == lease and got[b].lease == 0
        assert got[a].mod_revision == got[b].mod_revision == res.revision
        # a create/mod compare that holds commits; one that does not refuses the whole transaction
        txn = TxnBuilder()
        txn.created_at(a, res.revision)
        txn.modified_at(b, res.revision)
        txn.put(c, b"C")
        ok = await store.commit(txn)
        assert ok.succeeded and ok.revision == res.revision + 1
        for compare in ("created_at", "modified_at", "absent"):
            txn = TxnBuilder()
            if compare == "absent":
                txn.absent(c)
            else:
                getattr(txn, compare)(b, res.revision - 1)
            txn.put(b, b"never")
            txn.get(a, failure=True)
            refused = await store.commit(txn)
            assert not refused.succeeded, compare
            assert [kv.value for kv in refused.kvs()] == [b"A"]  # the failure branch's read
        assert (await store.get(b)).value == b"B"
        await store.lease_revoke(lease)
    finally:
        await store.close()


async def test_the_op_limit_is_read_from_etcd_and_a_refused_size_lowers_it(etcd_cluster: EtcdCluster,
                                                                           big_txn_etcd: EtcdCluster) -> None:
    default = EtcdStore(",".join(etcd_cluster.endpoints), timeout_s=5)
    big = EtcdStore(",".join(big_txn_etcd.endpoints), timeout_s=5)
    wrong = EtcdStore(",".join(etcd_cluster.endpoints), timeout_s=5, max_txn_ops=1024)  # configured too high
    key = (unique_prefix() + "probe").encode()
    try:
        assert (default.max_txn_ops, default.txn_ops_known) == (128, False)
        assert await default.discover_max_txn_ops(key) == 128 and default.txn_ops_known
        assert await big.discover_max_txn_ops(key) == 1024 == big.max_txn_ops
        assert wrong.txn_ops_known and wrong.max_txn_ops == 1024
        txn = TxnBuilder()
        for i in range(300):
            txn.put(key + str(i).encode(), b"x")
        with pytest.raises(EtcdTxnTooLarge) as e:
            await wrong.commit(txn)
        assert e.value.retriable and e.value.status == 503
        assert wrong.max_txn_ops == 150  # halved from the refused size; nothing was written
        assert await wrong.get_many([key + b"0", key + b"299"]) == {}
        assert (await big.commit(txn)).succeeded  # 300 ops fit etcd --max-txn-ops 1024
        with pytest.raises(EtcdTxnTooLarge, match="allows 128"):
            await default.commit(txn)  # over the known limit: never sent
    finally:
        for s in (default, big, wrong):
            await s.close()


def read_at(etcd: EtcdCluster, key: bytes, revision: int) -> str:
    """``etcdctl get --rev``: the value, or etcd's error."""
    r = subprocess.run(["etcdctl", "--endpoints", ",".join(etcd.endpoints), "get", key.decode(), f"--rev={revision}",
                        "--print-value-only"], capture_output=True, text=True, timeout=15,
                       env={**os.environ, "ETCDCTL_API": "3"})
    return r.stdout.strip() if r.returncode == 0 else r.stderr


async def test_compact_drops_history_below_a_revision_and_keeps_latest_values(tmp_path) -> None:
    etcd = EtcdCluster(tmp_path / "etcd", members=1).start()  # compaction is cluster-wide: a private one
    store = EtcdStore(",".join(etcd.endpoints), timeout_s=5)
    key = b"/compact/k"
    try:
        first = await store.revision(key)
        for i in range(5):
            txn = TxnBuilder()
            txn.put(key, str(i).encode())
            await store.commit(txn)
        now = await store.revision(key)
        assert now == first + 5
        assert read_at(etcd, key, now - 2) == "2"
        assert await store.compact(now - 1)
        assert "required revision has been compacted" in read_at(etcd, key, now - 2)
        kv = await store.get(key)
        assert kv is not None and kv.value == b"4" and kv.create_revision == first + 1  # latest version kept
        assert not await store.compact(now - 3)  # already compacted past it: a no-op, not an error
    finally:
        await store.close()
        etcd.stop()


async def test_an_etcd_outage_writes_a_line_per_interval_not_per_call(fresh_etcd_cluster: EtcdCluster, caplog) -> None:
    """The allocator's election retries its etcd calls every poll (a few times a second): with etcd
    paused, each failed call wrote its own warning (hundreds of lines a minute per replica, found on
    a real topology). Now one line per operation and endpoint per interval, counting the rest."""
    store = EtcdStore(",".join(fresh_etcd_cluster.endpoints), timeout_s=0.1)
    await store.get(b"warm")  # connected
    pids = [p.pid for p in fresh_etcd_cluster.procs]
    caplog.set_level(logging.WARNING, logger="kernel.etcd_store")
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(20):
            with pytest.raises(StoreUnavailable):
                await store.get(b"k")
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        await store.close()
    lines = [r.getMessage() for r in caplog.records if "trying the next endpoint" in r.getMessage()]
    assert 1 <= len(lines) <= len(pids), lines
    assert all(line.startswith("etcd get failed on ") for line in lines), lines
