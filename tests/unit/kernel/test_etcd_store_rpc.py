"""kernel.etcd_store speaks etcd's gRPC API through the etcdserverpb code aetcd ships
(``aetcd.rpc``) and nothing else of aetcd: these checks fail when an aetcd release moves or
changes a generated name or field the adapter builds requests with or reads answers from —
before a deployment finds out on its first etcd call."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import grpc.aio
from aetcd import rpc

from kernel import etcd_store, etcd_tls
from kernel.etcd_store import TxnBuilder, prefix_range_end

ROOT = Path(__file__).resolve().parents[3]


def _fields(message: type) -> set[str]:
    return {f.name for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]  # a generated protobuf class: DESCRIPTOR is set at import, not declared


async def test_the_stubs_and_their_methods_are_there():
    channel = grpc.aio.insecure_channel("127.0.0.1:9")  # never dialled: stubs only bind methods
    try:
        assert {"Range", "Txn", "Compact"} <= set(vars(rpc.KVStub(channel)))
        assert {"LeaseGrant", "LeaseKeepAlive", "LeaseRevoke"} <= set(vars(rpc.LeaseStub(channel)))
        assert "Watch" in vars(rpc.WatchStub(channel))
        assert "Authenticate" in vars(rpc.AuthStub(channel))
        assert rpc.MaintenanceStub(channel) is not None
    finally:
        await channel.close()


def test_the_request_and_response_fields_the_adapter_uses():
    assert {"key", "range_end"} <= _fields(rpc.RangeRequest)
    assert {"compare", "success", "failure"} <= _fields(rpc.TxnRequest)
    assert {"succeeded", "header", "responses"} <= _fields(rpc.TxnResponse)
    assert {"request_range", "request_put", "request_delete_range"} <= _fields(rpc.RequestOp)
    assert {"response_range"} <= _fields(rpc.ResponseOp)
    assert {"result", "target", "key", "version", "create_revision", "mod_revision", "value"} <= _fields(rpc.Compare)
    assert {"key", "value", "create_revision", "mod_revision", "version", "lease"} <= _fields(rpc.KeyValue)
    assert {"TTL"} <= _fields(rpc.LeaseGrantRequest) and {"ID"} <= _fields(rpc.LeaseGrantResponse)
    assert {"ID"} <= _fields(rpc.LeaseKeepAliveRequest) and {"TTL"} <= _fields(rpc.LeaseKeepAliveResponse)
    assert {"ID"} <= _fields(rpc.LeaseRevokeRequest)
    assert {"revision"} <= _fields(rpc.CompactionRequest)
    assert {"name", "password"} <= _fields(rpc.AuthenticateRequest) and {"token"} <= _fields(rpc.AuthenticateResponse)
    assert {"create_request"} <= _fields(rpc.WatchRequest)
    assert {"key", "range_end"} <= _fields(rpc.WatchCreateRequest)
    assert {"created", "canceled", "cancel_reason", "events"} <= _fields(rpc.WatchResponse)
    # the compare enums (a Compare's defaults, EQUAL on VERSION, are what TxnBuilder.absent relies on)
    assert (rpc.Compare.EQUAL, rpc.Compare.VERSION) == (0, 0)
    assert {rpc.Compare.CREATE, rpc.Compare.MOD, rpc.Compare.VALUE} == {1, 2, 3}


def test_a_built_transaction_is_the_protobuf_etcd_reads():
    txn = TxnBuilder()
    txn.created_at(b"/l", 7)
    txn.modified_at(b"/w", 9)
    txn.absent(b"/g")
    txn.holds(b"/s", b"4")
    txn.put(b"/g", b"v", 5)
    txn.delete(b"/d")
    txn.get_range(b"/p/", prefix_range_end(b"/p/"), failure=True)
    back = rpc.TxnRequest.FromString(txn.request.SerializeToString())
    assert [(c.target, c.key) for c in back.compare] == [(rpc.Compare.CREATE, b"/l"), (rpc.Compare.MOD, b"/w"),
                                                         (rpc.Compare.VERSION, b"/g"), (rpc.Compare.VALUE, b"/s")]
    assert back.compare[0].create_revision == 7 and back.compare[1].mod_revision == 9
    assert back.success[0].request_put.lease == 5 and back.success[1].request_delete_range.key == b"/d"
    assert back.failure[0].request_range.range_end == b"/p0"


def test_as_read_compares_each_key_as_modified_at_or_absent_would():
    one, each = TxnBuilder(), TxnBuilder()
    one.as_read([(b"/w1", 9), (b"/w2", 0), (b"/w3", 4)])
    each.modified_at(b"/w1", 9)
    each.absent(b"/w2")
    each.modified_at(b"/w3", 4)
    assert one.request.SerializeToString() == each.request.SerializeToString()


def test_prefix_range_end_is_etcds_rule():
    assert prefix_range_end(b"/a/") == b"/a0"
    assert prefix_range_end(b"a\xff") == b"b"
    assert prefix_range_end(b"\xff\xff") == b"\0"


def test_only_the_adapter_imports_aetcd_and_it_takes_only_the_generated_code():
    """One door to the dependency: no other module of the services imports aetcd, and the
    adapter imports ``aetcd.rpc`` alone (no aetcd client, nothing private). (The benchmarks'
    single-CAS ceiling measures aetcd's own client on purpose: bench/fig_alloc.py.)"""
    importers = []
    for folder in ("kernel", "allocator", "region_agent", "leasehold", "chaos"):
        for path in (ROOT / folder).rglob("*.py"):
            if "bench" in path.parts:
                continue
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                if any(n == "aetcd" or n.startswith("aetcd.") for n in names):
                    importers.append(str(path.relative_to(ROOT)))
    assert sorted(set(importers)) == ["kernel/etcd_store.py"]
    source = inspect.getsource(etcd_store)
    assert "from aetcd import rpc" in source and "aetcd." not in source.replace("aetcd.rpc", "")
    assert "aetcd" not in inspect.getsource(etcd_tls)


def test_etcds_refusals_are_typed_by_cause():
    """The words etcd 3.4/3.5 answers with (seen against a real etcd in
    tests/integration/allocator/test_etcd_refusals.py) map to one EtcdRefused cause each; other
    statuses stay a plain Unavailable."""
    from kernel.errors import Unavailable
    from kernel.etcd_store import EtcdRefused, _refusal

    code = grpc.StatusCode
    cases = {(code.INVALID_ARGUMENT, "etcdserver: authentication failed, invalid user ID or password"): "auth",
             (code.INVALID_ARGUMENT, "etcdserver: user name not found"): "auth",
             (code.INVALID_ARGUMENT, "etcdserver: user name is empty"): "auth",
             (code.UNAUTHENTICATED, "etcdserver: invalid auth token"): "auth",
             (code.PERMISSION_DENIED, "etcdserver: permission denied"): "permission",
             (code.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded"): "nospace"}
    for (status, detail), cause in cases.items():
        err = _refusal("txn", status, detail)
        assert isinstance(err, EtcdRefused) and err.cause == cause and err.retriable, (detail, err)
    other = _refusal("txn", code.INVALID_ARGUMENT, "etcdserver: duplicate key given in txn request")
    assert type(other) is Unavailable and "duplicate key" in other.detail


def test_a_transaction_writes_when_either_branch_puts_or_deletes():
    from kernel.etcd_store import _writes

    reads = TxnBuilder()
    reads.get(b"/a")
    reads.get_range(b"/p/", prefix_range_end(b"/p/"))
    assert not _writes(reads.request)
    failing_put = TxnBuilder()
    failing_put.get(b"/a")
    failing_put.put(b"/a", b"x", failure=True)
    assert _writes(failing_put.request)
    deletes = TxnBuilder()
    deletes.delete(b"/a")
    assert _writes(deletes.request)
