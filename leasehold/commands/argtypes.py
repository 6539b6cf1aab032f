"""Option types of the ``leasehold`` commands: each value is checked once, where argparse reads it,
so a bad one is a usage error (``leasehold: argument --x: ...``, exit 2) before anything starts,
is written or is sent (docs/cli.md).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

import httpx

from kernel.ids import ETCD_PREFIX, REGION, REGION_RE, human


def whole(lo: int, hi: int) -> Callable[[str], int]:
    """An integer in ``[lo, hi]``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], not {v}")
        return v

    parse.__name__ = "whole number"
    return parse


def finite(lo: float, *, above: bool = False) -> Callable[[str], float]:
    """A finite number ``>= lo`` (``> lo`` with ``above``)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(v) or v < lo or (above and v == lo):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>' if above else '>='} {lo:g}, not {text!r}")
        return v

    parse.__name__ = "number"
    return parse


def http_url(text: str) -> str:
    """A service's base URL: ``http://`` or ``https://`` and a host (a trailing ``/`` is dropped)."""
    try:
        url = httpx.URL(text)
    except (httpx.InvalidURL, ValueError) as e:
        raise argparse.ArgumentTypeError(f"not a URL: {text!r} ({e})") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise argparse.ArgumentTypeError(f"expected http://host:port or https://host:port, not {text!r}")
    return text.rstrip("/")


def regions(text: str) -> tuple[str, ...]:
    """Comma-separated region names: at least one, distinct, each matching the services' pattern."""
    names = tuple(x.strip() for x in text.split(","))
    bad = [n for n in names if not REGION_RE.match(n)]
    if bad:
        raise argparse.ArgumentTypeError(f"a region name is {human(REGION)}, not {bad[0]!r}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"regions must be distinct: {text!r}")
    return names


def names(pattern: str, what: str) -> Callable[[str], list[str]]:
    """Comma-separated names of one kind (a canary's regions, agents or tenants), sorted and distinct,
    each matching the services' pattern: a name no service can have would name nobody (``EU`` for
    ``eu``), and the slice staged with it could never be narrowed again."""
    rx = re.compile(pattern)

    def parse(text: str) -> list[str]:
        got = sorted({x.strip() for x in text.split(",") if x.strip()})
        bad = [n for n in got if not rx.match(n)]
        if bad:
            raise argparse.ArgumentTypeError(f"{what} is {human(pattern)}, not {bad[0]!r}")
        if not got:
            raise argparse.ArgumentTypeError(f"no {what} in {text!r}")
        return got

    parse.__name__ = what
    return parse


def etcd_prefix(text: str) -> str:
    """The fleet's etcd key prefix, as the services accept it (``/`` first and last): a prefix
    without them would name keys no service reads."""
    if not re.match(ETCD_PREFIX, text):
        raise argparse.ArgumentTypeError(f"expected {human(ETCD_PREFIX)} (e.g. /leasehold/), not {text!r}")
    return text


__all__ = ["etcd_prefix", "finite", "http_url", "names", "regions", "whole"]
