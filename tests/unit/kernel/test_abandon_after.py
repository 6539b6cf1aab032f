"""kernel.etcd_store.abandon_after: a call past its deadline is given up on without waiting for
its cancellation (a gRPC call can hang there), unlike asyncio.wait_for."""

from __future__ import annotations

import asyncio

import pytest

from kernel.etcd_store import abandon_after


async def _hangs_in_cancellation(release: asyncio.Event) -> None:
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await release.wait()  # a driver that does not let go when cancelled
        raise


async def test_returns_the_result_in_time():
    async def quick() -> int:
        return 7

    assert await abandon_after(quick(), 1.0) == 7


async def test_gives_up_without_waiting_for_a_cancellation_that_hangs():
    release = asyncio.Event()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        await abandon_after(_hangs_in_cancellation(release), 0.05)
    assert loop.time() - started < 5  # asyncio.wait_for would wait here until release is set
    release.set()
    await asyncio.sleep(0)


async def test_errors_pass_through_and_a_cancelled_caller_cancels_the_call():
    async def fails() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError):
        await abandon_after(fails(), 1.0)
    inner_cancelled = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            inner_cancelled.set()
            raise

    outer = asyncio.ensure_future(abandon_after(slow(), 3600))
    await asyncio.sleep(0.01)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    await asyncio.wait_for(inner_cancelled.wait(), 5)


async def test_a_call_cancelled_under_us_is_an_interrupted_call_not_our_cancellation():
    """grpc.aio cancels the calls in flight on a channel that is closed (another call failed over
    and closed the shared channel): that must reach the caller as a retriable error, never as a
    CancelledError that would end the caller's own loop."""
    from kernel.etcd_store import CallInterrupted

    async def cancelled_by_its_channel() -> None:
        raise asyncio.CancelledError

    with pytest.raises(CallInterrupted):
        await abandon_after(cancelled_by_its_channel(), 1.0)
    assert issubclass(CallInterrupted, TimeoutError)  # _call fails over on it like on a timeout
