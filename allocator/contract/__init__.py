"""Contracts both services speak: the lease API wire types, the policy bundle format and
the error hierarchy with its one mapping to HTTP problem details.

The allocator owns these because it owns etcd, where pools live and bundles are published.
Nothing in this package does I/O; ``region_agent`` imports it, the allocator never imports
``region_agent``.
"""
