"""kernel.watch: one read of the policy key hands each new value on once, and the age the
staleness rule (maxAgeMs) is checked against. The etcd watch itself: tests/integration."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kernel.bundle import load_bundle_file
from kernel.errors import StoreUnavailable
from kernel.policy_store import Stored
from kernel.watch import PolicyWatcher
from tests.support.clock import FakeClock

NORTHSTAR = load_bundle_file(str(Path(__file__).resolve().parents[3] / "policies" / "northstar.json"))


class Store:
    """What the watcher reads: the next scripted value (a Stored, None, or an error raised)."""

    def __init__(self, *answers):
        self.answers = list(answers)

    async def read(self):
        a = self.answers.pop(0)
        if isinstance(a, BaseException):
            raise a
        return a


def watcher(store: Store, clock: FakeClock) -> tuple[PolicyWatcher, list, list]:
    offered: list = []
    refused: list = []
    return PolicyWatcher(store, offer=offered.append, refuse=lambda problem, outcome: refused.append((problem, outcome)),  # type: ignore[arg-type]  # a fake store with the methods the watcher calls
                         clock=clock), offered, refused


async def test_each_revision_is_handed_on_once():
    good = Stored(raw=b"{}", mod_revision=7, bundle=NORTHSTAR)
    w, offered, refused = watcher(Store(None, good, good, Stored(b"x", 8, None, "not JSON"),
                                        Stored(b"y", 9, None, "bundle 3 is unsigned", "unsigned")), FakeClock(10.0))
    assert await w.refresh() and offered == []  # nothing published yet
    assert await w.refresh() and offered == [NORTHSTAR]
    assert await w.refresh() and offered == [NORTHSTAR]  # the same revision again: nothing to do
    assert await w.refresh() and refused == [("not JSON", "invalid")]  # a corrupt value is refused, not offered
    assert await w.refresh() and refused[-1] == ("bundle 3 is unsigned", "unsigned")  # with the store's outcome
    assert (w.reads_ok, w.reads_failed) == (5, 0)


async def test_a_failed_read_keeps_the_bundle_and_the_age_grows():
    clock = FakeClock(10.0)
    w, offered, _ = watcher(Store(StoreUnavailable("etcd down"), None), clock)
    clock.t += 2.0
    assert not await w.refresh() and w.reads_failed == 1 and offered == []
    assert w.age_ms() == 2_000.0  # counted from creation until the first good read
    assert await w.refresh()
    assert w.age_ms() == 0.0


async def test_staleness_needs_a_max_age_and_an_age_past_it():
    clock = FakeClock(10.0)
    w, _, _ = watcher(Store(), clock)
    bounded = msgspec.structs.replace(NORTHSTAR, max_age_ms=5_000)
    clock.t += 5.0
    assert not w.is_stale(bounded) and not w.is_stale(NORTHSTAR)
    clock.t += 0.001
    assert w.is_stale(bounded) and not w.is_stale(NORTHSTAR)  # no maxAgeMs: never stale
