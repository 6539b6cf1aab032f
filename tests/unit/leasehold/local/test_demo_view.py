"""leasehold.local.demo's live view: what README.md ("What you see") promises is visible whole on an
80-column terminal (and on a pipe, which rich draws 80 columns wide)."""

from __future__ import annotations

from types import SimpleNamespace

from rich.console import Console

from leasehold.local.demo import RegionPanel, _render


def test_the_live_view_shows_every_column_and_the_top_denials_at_80_columns():
    """The counters took the whole width and the rules that denied most got none: at 80 columns the
    headers read "regi…", "admitted…", "erro…" and no rule name was shown."""
    eu = RegionPanel(allowed=51, denied=51, exports_in_flight=3)
    eu.deny_by_rule.update({"read-user-v3": 120, "tenant-atlas-global": 77, "export-tenant": 5})
    driver = SimpleNamespace(stats={"eu": eu, "us": RegionPanel(allowed=48, denied=40)})
    pools = [{"pool": "atlas-minute", "window": {"index": 29942262}, "limit": 1000, "remaining": 28,
              "regions": [{"region": "eu", "granted": 497}, {"region": "us", "granted": 475}],
              "leasesOutstanding": 9}]
    console = Console(width=80, record=True, color_system=None)
    console.print(_render(driver, {}, 1.0, "leader alloc-1 epoch 4", pools, 25.0))
    text = console.export_text()
    assert "…" not in text, text
    for word in ("region", "admitted/s", "denied/s", "503/s", "fallback/s", "exports in", "flight", "errors",
                 "read-user-v3: 120, tenant-atlas-global: 77, export-tenant: 5", "granted by region",
                 "eu 497, us 475", "leader alloc-1 epoch 4"):
        assert word in text, (word, text)
    assert max(len(line) for line in text.splitlines()) <= 80
