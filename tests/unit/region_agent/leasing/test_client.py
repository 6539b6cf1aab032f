"""The agent's allocator client against allocators answering over a mock transport (httpx): what it
does when a batch is answered item by item."""

from __future__ import annotations

import json

import httpx

from kernel.wire import LeaseError, UsageReceipt, UsageReport
from region_agent.leasing.client import AllocatorClient

A, B = "http://a.test", "http://b.test"  # an unsharded pair: A follows, B leads


def _allocators(seen: list[str]) -> httpx.MockTransport:
    def answer(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}"
        seen.append(url)
        if request.url.path == "/v1/shards":
            return httpx.Response(404)
        reports = json.loads(request.content)["reports"]
        if url == A:  # a follower answers a batch 200, every item not-leader (items name no leader)
            return httpx.Response(200, json={"results": [
                {"leaseId": r["leaseId"], "status": 503, "code": "not-leader", "detail": "not the leader"}
                for r in reports]})
        return httpx.Response(200, json={"results": [
            {"leaseId": r["leaseId"], "granted": 10, "spent": r["spent"], "returned": 10 - r["spent"],
             "windowOpen": True} for r in reports]})
    return httpx.MockTransport(answer)


async def test_reports_answered_not_leader_item_by_item_go_to_the_next_allocator():
    """After a failover the agent still preferred the old leader: its usage batches were answered
    200 with every item not-leader, and the client retried the same allocator until its attempts ran
    out, on every tick — an idle agent's reports were never delivered (a lease request, answered
    not-leader as a whole, was what moved it on)."""
    seen: list[str] = []
    client = AllocatorClient([A, B], transport=_allocators(seen), deadline_s=5.0)
    try:
        out = await client.report_many([UsageReport(lease_id="lease-0000000001", pool="p1", region="eu", spent=3)])
    finally:
        await client.aclose()
    assert isinstance(out[0], UsageReceipt) and out[0].returned == 7, out
    assert [u for u in seen if u in (A, B)][:2] == [A, B]


async def test_a_leader_answering_an_item_not_leader_is_not_left_for_another():
    """Only the preferred URL's not-leader items move the preference: an answer from the leader is
    kept (its items are receipts)."""
    seen: list[str] = []
    client = AllocatorClient([B, A], transport=_allocators(seen), deadline_s=5.0)
    try:
        out = await client.report_many([UsageReport(lease_id="lease-0000000002", pool="p1", region="eu", spent=1)])
    finally:
        await client.aclose()
    assert isinstance(out[0], UsageReceipt) and not isinstance(out[0], LeaseError)
    assert seen == [B]
