"""The log of calls refused for their gateway token, one per door (RLS and RLQS, forward auth): a
WARNING naming the caller's address, at most one per address a minute at each door (the security
signal of LeaseholdRlsUnknownCaller, LeaseholdRlqsUnknownCaller and LeaseholdAuthzUnknownCaller; a
flood from one address costs a line a minute, and the next line says how many were not written)."""

from __future__ import annotations

import logging

from kernel.ratelog import KeyedLog

INTERVAL_S = 60.0


class RefusedCallers:
    """One door's lines, written to that door's logger (``logger``)."""

    def __init__(self, logger: logging.Logger) -> None:
        self.lines = KeyedLog(logger, interval_s=INTERVAL_S)

    def log(self, address: str, what: str) -> bool:
        """``<what> refused: no valid gateway token, from <address>`` unless a line for ``address``
        was written less than a minute ago; returns whether it was written."""
        return self.lines.log(address, logging.WARNING, f"{what} refused: no valid gateway token, from {address}")
