"""The agent's start-up (``create_app(freeze_heap=True)``, as ``python -m region_agent`` builds it)
ends with the collector set for serving: the start-up heap frozen and the young generation's
threshold raised to ``kernel.httpserver.YOUNG_THRESHOLD`` (decision 0085); an app built without
it (tests, an embedding) leaves the process's collector alone."""

from __future__ import annotations

import gc
from pathlib import Path

from litestar.testing import AsyncTestClient

from kernel.httpserver import YOUNG_THRESHOLD
from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_json, make_settings


async def test_the_started_agent_raises_the_young_threshold(redis_url: str, policy_file: Path):
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        app = create_app(make_settings(redis_url, policy_file), pepper=PEPPER, freeze_heap=True)
        assert gc.get_threshold() == (700, 10, 10)  # building the app is not starting it
        async with AsyncTestClient(app=app) as agent:
            assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
            assert gc.get_freeze_count() > 0
            assert (await admit_json(agent, "heap-0001"))["allowed"]
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


async def test_an_app_built_without_it_leaves_the_collector_alone(redis_url: str, policy_file: Path):
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        async with AsyncTestClient(app=create_app(make_settings(redis_url, policy_file), pepper=PEPPER)):
            assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*before)
