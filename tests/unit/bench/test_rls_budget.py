"""The RLS budget experiment's pure parts (bench.rls_budget): the work values, the servers it
starts, the ratios it reports; and a group's decision holding the loop for the stated time."""

from __future__ import annotations

import argparse
import asyncio
import time

import pytest

from bench.rls_budget import _servers, group_decider, parse_models, parse_work, ratios


def test_work_values_are_microseconds_at_or_above_zero():
    assert parse_work("0,30, 60") == [0.0, 30.0, 60.0]
    for bad in ("", "x", "-1", "nan", "10,-5"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_work(bad)


def test_server_models_are_named_from_the_known_ones():
    assert parse_models("aio, sync") == ["aio", "sync"]
    for bad in ("", "aio,threads", "grpclib"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_models(bad)


def test_one_model_server_per_value_and_model():
    assert _servers([0.0, 30.0], ["aio"]) == [("w0", ["--work-us", "0", "--model", "aio"]),
                                             ("w30", ["--work-us", "30", "--model", "aio"])]
    assert [n for n, _ in _servers([30.0], ["aio", "thread", "sync"])] == ["w30", "w30-thread", "w30-sync"]


def test_ratios_are_per_round_against_the_bare_server_of_that_round():
    res = {"bare": [{"rps": 1000.0, "p50_ms": 10.0, "cpu_us": 200.0}, {"rps": 500.0, "p50_ms": 20.0, "cpu_us": 210.0},
                    {"rps": 800.0, "p50_ms": 12.0, "cpu_us": 205.0}],
           "w30": [{"rps": 900.0, "p50_ms": 11.0, "cpu_us": 240.0}, {"rps": 450.0, "p50_ms": 24.0, "cpu_us": 250.0},
                   {"rps": 400.0, "p50_ms": 24.0, "cpu_us": None}]}
    out = ratios(res)
    assert out["bare"]["ratio"] == 1.0
    assert out["w30"]["ratios"] == [0.9, 0.9, 0.5]
    assert out["w30"]["ratio"] == 0.9  # the median of the rounds, not the ratio of the medians (450/800)
    assert out["w30"]["p50_x"] == pytest.approx(1.2)
    assert out["w30"]["cpu_us"] == 245.0  # a round without a CPU reading is left out


def test_a_group_decision_holds_the_loop_for_its_work_and_answers_each_question():
    decide = group_decider(2000.0)  # 2 ms a question

    async def one_group() -> tuple[list, float]:
        t0 = time.process_time()
        got = await decide(["a", "b", "c"])
        return got, time.process_time() - t0

    got, cpu_s = asyncio.run(one_group())
    assert got == [None, None, None]
    assert cpu_s >= 0.006  # 3 questions x 2 ms of Python on the CPU (the thread's time: not a sleep, load or not)
