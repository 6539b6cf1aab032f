"""The decision path: one admission request -> one decision record (region_agent/README.md)."""
