"""lua/approx_reconcile.lua on a real redis-server and a real Redis Cluster: deltas add up per
window, old windows are dropped, the key expires after its next window, bad arguments are refused
before any write."""

from __future__ import annotations

import pytest

from kernel.errors import ScriptRejected

KEY = "rl:v3:{t:atlas}:tenant:atlas:all:approx"
W = 60_000


async def test_deltas_add_up_and_the_counts_come_back(aclient, scripts):
    now, cur, prev = await scripts.call(aclient, "approx_reconcile", [KEY], [W, 5_000, 0, 0])
    idx = now // W
    assert (cur, prev) == (0, 0)
    assert await aclient.exists(KEY) == 0  # a read writes nothing
    _, cur, prev = await scripts.call(aclient, "approx_reconcile", [KEY], [W, 5_000, idx, 7, idx - 1, 3])
    assert (cur, prev) == (7, 3)
    _, cur, prev = await scripts.call(aclient, "approx_reconcile", [KEY], [W, 5_000, idx, 5])
    assert (cur, prev) == (12, 3)
    ttl = await aclient.pttl(KEY)
    assert 0 < ttl <= 2 * W + 5_000


async def test_old_windows_are_dropped_and_future_ones_count_now(aclient, scripts):
    now, _, _ = await scripts.call(aclient, "approx_reconcile", [KEY], [W, 0, 0, 0])
    idx = now // W
    await aclient.hset(KEY, mapping={str(idx - 5): 99})
    _, cur, prev = await scripts.call(aclient, "approx_reconcile", [KEY], [W, 0, idx - 3, 4, idx + 2, 6])
    assert (cur, prev) == (6, 0)  # the old delta is not applied, the future one counts in the current window
    assert set(await aclient.hkeys(KEY)) == {str(idx).encode()}


@pytest.mark.parametrize("argv", [[0, 0], [W], [W, -1], [W, 0, 1], [W, 0, 1, -2], [W, 0, "x", 1],
                                  [W, 0, 1.5, 1], [W, 0, *([1, 1] * 5)]])
async def test_bad_arguments_are_refused_before_any_write(aclient, scripts, argv):
    with pytest.raises(ScriptRejected):
        await scripts.call(aclient, "approx_reconcile", [KEY], argv)
    assert await aclient.exists(KEY) == 0
