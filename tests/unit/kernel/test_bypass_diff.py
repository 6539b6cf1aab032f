"""Privileged bypasses compared between bundles (kernel/bypass.py) and the CLI's review exit code."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kernel.bundle import Bundle, Fallback, encode_bundle, load_bundle_file, make_rule, seal
from kernel.bypass import diff_bypasses, needs_review
from leasehold.commands.cli import EXIT_BYPASS, EXIT_OK
from leasehold.commands.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[3]
GLOBAL = load_bundle_file(str(ROOT / "policies" / "northstar-global.json"))
PROBE = next(r for r in GLOBAL.rules if r.exempt)


def with_probe(bundle: Bundle, version: int, **changes) -> Bundle:
    rules = [msgspec.structs.replace(r, **changes) if r.id == PROBE.id else r for r in bundle.rules]
    return seal(msgspec.structs.replace(bundle, bundle_version=version, rules=rules))


def kinds(old, new) -> list[tuple[str, str]]:
    return [(c.kind, c.rule) for c in diff_bypasses(old, new)]


def test_added_removed_and_unchanged():
    without = seal(msgspec.structs.replace(GLOBAL, rules=[r for r in GLOBAL.rules if not r.exempt]))
    assert kinds(without, GLOBAL) == [("added", PROBE.id)]
    assert kinds(None, GLOBAL) == [("added", PROBE.id)]  # nothing published yet
    assert kinds(GLOBAL, without) == [("removed", PROBE.id)]
    assert kinds(GLOBAL, with_probe(GLOBAL, 43)) == []
    # an existing rule made exempt is a new bypass
    made = seal(msgspec.structs.replace(GLOBAL, rules=[
        msgspec.structs.replace(r, exempt=True, owner="team-x", fail_mode="closed")
        if r.id == "export-tenant" else r for r in without.rules]))
    assert ("added", "export-tenant") in kinds(without, made)


def test_every_kind_of_widening_is_flagged():
    cases = {
        "limit": dict(limit=600),  # 60 -> 600 per minute
        "window": dict(window_ms=6_000),  # the same limit every 6 s
        "route": dict(route_group=None),  # the probe route -> every route of the tenant
        "tenant": dict(tenant="atlas"),
        "scope": dict(scope="user"),  # one cap per caller instead of one for the tenant
        "fail mode": dict(fail_mode="local_bounded", fallback=Fallback(limit=30, window_ms=60_000)),
        "not revocable": None,
    }
    for name, change in cases.items():
        if change is None:
            old, new = with_probe(GLOBAL, 43, revocable=True), with_probe(GLOBAL, 44, revocable=False)
        else:
            old, new = GLOBAL, with_probe(GLOBAL, 43, **change)
        changes = diff_bypasses(old, new)
        assert [c.kind for c in changes] == ["widened"], (name, changes)
        assert needs_review(changes)


def test_narrowing_and_owner_changes_are_reported_not_flagged():
    narrowed = diff_bypasses(GLOBAL, with_probe(GLOBAL, 43, limit=10))
    assert [c.kind for c in narrowed] == ["narrowed"] and not needs_review(narrowed)
    assert "burst 60 -> 10" in narrowed[0].line()
    owner = diff_bypasses(GLOBAL, with_probe(GLOBAL, 43, owner="platform"))
    assert [c.kind for c in owner] == ["changed"] and not needs_review(owner)
    mixed = diff_bypasses(GLOBAL, with_probe(GLOBAL, 43, limit=10, route_group=None))
    assert [c.kind for c in mixed] == ["widened"]  # one widening is enough


def test_cli_validate_against_exits_7_on_a_widened_bypass(tmp_path: Path, capsys):
    current = tmp_path / "current.json"
    current.write_bytes(encode_bundle(GLOBAL))
    wider = tmp_path / "wider.json"
    wider.write_bytes(encode_bundle(with_probe(GLOBAL, 43, limit=6_000)))
    same = tmp_path / "same.json"
    same.write_bytes(encode_bundle(with_probe(GLOBAL, 43)))
    assert cli_main(["policy", "validate", str(wider), "--against", str(current)]) == EXIT_BYPASS
    out = capsys.readouterr()
    assert "widened: bypass 'ops-probe-bypass'" in out.out and "burst 60 -> 6000" in out.out
    assert "REVIEW" in out.err
    assert cli_main(["policy", "validate", str(same), "--against", str(current)]) == EXIT_OK
    assert "no change" in capsys.readouterr().out
    assert cli_main(["policy", "validate", str(wider)]) == EXIT_OK  # without --against: validation only


def test_rule_helper_shapes():
    r = make_rule(id="x", scope="tenant", tenant="t", algorithm="token_bucket", capacity_millis=10_000,
             refill_millis=1_000, period_ms=1_000, cost_millis=1_000, fail_mode="closed", exempt=True, owner="o")
    assert r.capacity({}) == (1.0, 10.0)
    assert r.fallback_capacity({}) == (0.0, 0.0)  # fails closed: nothing while the store is down
