"""The door system-call counter's pure parts (bench.syscalls): ``perf stat --per-thread`` output
read by thread name and system call, ``/proc`` thread CPU split into user and kernel time, both
turned into amounts per call, and the summary's medians over rounds."""

from __future__ import annotations

from collections import Counter

from bench.syscalls import (
    PREFIX,
    STAT_COLUMNS,
    MachineSampler,
    cpu_per_call,
    parse_perf,
    parse_stat,
    per_call,
    perf_events,
    summary,
    thread_waits,
    waits_per_call,
)

PERF = """# started on Mon Dec  7 18:47:18 2026

python-7323;5673;;raw_syscalls:sys_enter;107769912;100.00;;
python-7323;68;;context-switches;107780952;100.00;;
python-7323;54;;syscalls:sys_enter_getpid;107790440;100.00;;
python-7400;10;;syscalls:sys_enter_getpid;107790440;100.00;;
event_engine-7330;7;;syscalls:sys_enter_futex;107790440;100.00;;
redis-server-81;3;;syscalls:sys_enter_writev;107790440;100.00;;
event_engine-7331;<not counted>;;syscalls:sys_enter_futex;0;0.00;;
"""


def test_perf_counts_by_thread_name_and_call():
    counts = parse_perf(PERF)
    assert counts["python"] == Counter({"raw_syscalls:sys_enter": 5673, "context-switches": 68, "getpid": 64})
    assert counts["event_engine"] == Counter({"futex": 7})  # the uncounted line left out
    assert counts["redis-server"] == Counter({"writev": 3})  # a name with a dash keeps it
    assert set(counts) == {"python", "event_engine", "redis-server"}


def test_per_call_amounts_leave_out_the_rare_events():
    counts = {"python": Counter({"getpid": 3900, "madvise": 1, "futex": 10})}
    assert per_call(counts, 1000) == {"python": {"getpid": 3.9, "futex": 0.01}}
    assert per_call(counts, 1000, floor=0.0) == {"python": {"getpid": 3.9, "futex": 0.01, "madvise": 0.001}}


def test_the_events_asked_of_perf():
    assert perf_events("getpid,futex") == f"raw_syscalls:sys_enter,context-switches,{PREFIX}getpid,{PREFIX}futex"


def test_a_threads_stat_line_gives_its_user_and_kernel_time():
    line = ("7323 (event_engine) S 1 7323 7323 0 -1 4194560 1000 0 0 0 250 75 0 0 20 0 6 0 100 "
            "1000000 2000 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n")
    assert parse_stat(line, 100) == ("event_engine", 2.5, 0.75)
    # a name with a space and a parenthesis: the last ")" ends it
    odd = line.replace("(event_engine)", "(a (b) c)")
    assert parse_stat(odd, 100) == ("a (b) c", 2.5, 0.75)


def test_cpu_per_call_sums_the_threads_of_one_name_and_counts_new_ones_from_zero():
    before = {(1, 1): ("python", 1.0, 0.5), (1, 2): ("event_engine", 0.1, 0.1)}
    after = {(1, 1): ("python", 1.2, 0.6), (1, 2): ("event_engine", 0.15, 0.1),
             (1, 3): ("event_engine", 0.05, 0.02)}
    assert cpu_per_call(before, after, 1000) == {"python": {"user": 200.0, "sys": 100.0},
                                                 "event_engine": {"user": 100.0, "sys": 20.0}}


def test_summary_gives_the_median_over_rounds_with_missing_events_as_zero():
    def row(name, getpid, rps):
        calls = {"python": {"getpid": getpid}} if getpid else {"python": {}}
        return {"name": name, "rps": rps, "loadgen_cpu_us": 300.0,
                "server": {"per_call": calls, "cpu_us": {"python": {"user": 10.0, "sys": 5.0}}}}
    lines = summary([row("bare", 2.0, 100), row("bare", 0.0, 120), row("bare", 3.0, 110)])
    assert lines[0] == "bare: calls/s 100, 120, 110; load generator CPU us/call 300, 300, 300"
    assert "  server python getpid: 2.00 per call (0.00-3.00)" in lines
    assert "  server python CPU us/call: user 10, 10, 10; kernel 5, 5, 5" in lines


def test_summary_gives_the_agents_group_sizes_and_the_machines_columns():
    machine = dict.fromkeys(STAT_COLUMNS, 0.0) | {"user": 500.0, "softirq": 20.0, "busy_cores": 1.5}
    rows = [{"name": "branch", "rps": 1000, "loadgen_cpu_us": 310.0, "calls_per_group": g, "calls_per_pipeline": 3.0,
             "machine_us": machine, "server": {"cpu_us": {}}} for g in (3.44, 4.0)]
    lines = summary(rows)
    assert "  calls per group 3.4, 4.0; calls per Redis pipeline 3.0, 3.0" in lines
    assert "  machine softirq: 20, 20 us/call" in lines and "  machine busy_cores: 1.5, 1.5" in lines


def _stat(**cols: float) -> dict[str, float]:
    return dict.fromkeys(STAT_COLUMNS, 0.0) | cols


def test_the_machines_cpu_is_read_over_the_measured_window_alone():
    m = MachineSampler.__new__(MachineSampler)  # its samples only: no thread
    # 10 s of samples: a start-up second at 0.5 busy cores, then 1.5 cores (1.2 user, 0.3 softirq), 0.5 idle
    m.samples = [(0.0, _stat()), (1.0, _stat(user=0.5, idle=1.5))]
    for t in range(2, 11):
        d = t - 1
        m.samples.append((float(t), _stat(user=0.5 + 1.2 * d, softirq=0.3 * d, idle=1.5 + 0.5 * d)))
    out = m.window_per_call(elapsed_s=8.0, rps=1000.0)  # the window 2.3-9.7 s: samples 3..9
    assert out["busy_cores"] == 1.5
    assert out["user"] == 1200.0 and out["softirq"] == 300.0 and out["idle"] == 500.0
    # with the start-up second (samples 0..9): (0.5 + 1.2 x 8 user + 0.3 x 8 softirq) / 9 s, diluted
    assert m.window_per_call(elapsed_s=11.0, rps=1000.0)["busy_cores"] == 1.39


def test_the_sampler_reads_proc_stat_until_stopped():
    m = MachineSampler(every=0.01)
    m.stop()
    assert len(m.samples) >= 2 and set(m.samples[-1][1]) == set(STAT_COLUMNS)
    assert m.samples[-1][0] >= m.samples[0][0]


def test_waits_per_call_sum_the_threads_of_one_name():
    before = {(1, 1): ("python", 1.0, 100), (1, 2): ("event_engine", 0.5, 10)}
    after = {(1, 1): ("python", 1.2, 1100), (1, 2): ("event_engine", 0.6, 510), (1, 3): ("event_engine", 0.1, 500)}
    assert waits_per_call(before, after, 1000) == {"python": {"wait": 200.0, "turns": 1.0},
                                                   "event_engine": {"wait": 200.0, "turns": 1.0}}


def test_this_process_threads_have_waits():
    import os

    got = thread_waits([os.getpid()])
    assert (os.getpid(), os.getpid()) in got and got[(os.getpid(), os.getpid())][2] >= 1
