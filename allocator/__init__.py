"""Leasehold allocator: per-window global pools on etcd, granted to regions as leases."""
