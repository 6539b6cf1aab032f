"""The local topology supervisor: real etcd, Redis, allocator, agents and gateways as processes on
loopback ports (``leasehold up``, ``make run``, the end-to-end, chaos and benchmark suites)."""
