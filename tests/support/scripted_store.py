"""A store for unit tests of the agent (the ``region_agent.store.protocol.Store`` protocol, no
network): ``submit`` answers with the next scripted item - a list of replies, or an exception
instance, raised - and records what was sent; ``gate`` (when set) holds every answer until it is
set."""

from __future__ import annotations

import asyncio
from typing import Any


class ScriptedStore:
    def __init__(self, *answers: Any):
        self.answers = list(answers)
        self.sent: list[list[tuple[str, list, list]]] = []
        self.gate: asyncio.Event | None = None

    async def submit(self, calls, *, wait_s):
        self.sent.append(list(calls))
        if self.gate is not None:
            await self.gate.wait()
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def release(self, key, lease_id, *, wait_s=None):
        return True

    async def renew(self, key, lease_id, ttl_ms, *, wait_s=None):
        return True
