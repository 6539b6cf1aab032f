"""The shared kernel: what both services speak, owned by neither.

``errors`` (the error hierarchy and its one mapping to problem+json), ``bundle`` (the policy
bundle format and its validation), ``wire`` (the lease API types), ``config`` (the settings
loader), ``auth`` (bearer tokens), ``openapi_problems``, and the etcd adapter both services use
(``etcd_store``, ``etcd_tls``, ``policy_store``, ``watch``). ``allocator`` and ``region_agent``
import this package; it imports neither of them.
"""
