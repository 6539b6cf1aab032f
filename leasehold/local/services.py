"""The command lines of the two services, built in one place.

Every place that starts a service as a process (``leasehold up`` / ``make run``, the chaos
topology, the benchmarks, the tests) builds its command here: settings are keyword arguments named
as the service's settings fields (``redis_url=...`` is ``--redis-url``), checked against
:class:`region_agent.service.settings.AgentSettings` / :class:`allocator.settings.AllocatorSettings` when
the command is built; ``*flags`` are already-formed flags passed through (secrets helpers, a test's
extra arguments)."""

from __future__ import annotations

import sys
from typing import Any

from allocator.settings import AllocatorSettings
from kernel.config import settings_flags
from region_agent.service.settings import AgentSettings


def agent_command(*flags: str, python: str = sys.executable, **settings: Any) -> list[str]:
    """``python -m region_agent`` with ``settings`` as flags, then ``flags``."""
    return [python, "-m", "region_agent", *settings_flags(AgentSettings, settings), *flags]


def allocator_command(*flags: str, python: str = sys.executable, **settings: Any) -> list[str]:
    """``python -m allocator`` with ``settings`` as flags, then ``flags``."""
    return [python, "-m", "allocator", *settings_flags(AllocatorSettings, settings), *flags]


__all__ = ["agent_command", "allocator_command"]
