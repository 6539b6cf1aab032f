"""Pure reference models of the Redis scripts (no I/O, clock passed in).

Same integer arithmetic as ``lua/lib/*.lua``: the test oracle for the scripts and the agent's
in-process fallback limiters. Each ``decide`` returns ``(Decision, new_state | None)``; None
means the script would write nothing (denial)."""

from .common import Decision, InvalidArguments
from .local_buckets import LocalBuckets

__all__ = ["Decision", "InvalidArguments", "LocalBuckets"]
