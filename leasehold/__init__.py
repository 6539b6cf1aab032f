"""Operator tooling: the ``leasehold`` CLI and the local topology supervisor used by
``make run``, the end-to-end and chaos tests and the benchmarks. The services themselves
never import this package."""
