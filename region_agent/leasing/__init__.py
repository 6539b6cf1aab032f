"""Spending allocator leases in a region: the pure lease book, the allocator client and the
manager that keeps each pool's regional balance (in Redis) topped up."""
