"""The RLS A/B experiment's pure parts (bench.rls_ab): an agent's extra arguments split into its
environment and its flags; group and pipeline sizes read from an agent's metrics text."""

from __future__ import annotations

from bench.rls_ab import CHECKOUT, group_sizes, split_flags


def test_env_items_go_to_the_environment_and_the_rest_are_flags():
    env, flags = split_flags(["--rls-group-linger-ms", "10", "env:X_SWITCH=a=b", "--workers", "1"])
    assert env == {"X_SWITCH": "a=b"}
    assert flags == ["--rls-group-linger-ms", "10", "--workers", "1"]


def test_group_and_pipeline_sizes_from_the_metrics_text():
    text = "\n".join([
        "# HELP leasehold_agent_batch_size Script calls per coalesced pipeline",
        'leasehold_agent_batch_size_bucket{le="1.0"} 3.0',
        "leasehold_agent_batch_size_count 10.0",
        "leasehold_agent_batch_size_sum 42.0",
        "leasehold_agent_rls_group_calls_count 4.0",
        "leasehold_agent_rls_group_calls_sum 20.0",
        "leasehold_agent_rls_group_calls_created 1.7e9",
    ])
    assert group_sizes(text) == {"calls_per_group": (20.0, 4.0), "calls_per_pipeline": (42.0, 10.0)}
    assert group_sizes("") == {"calls_per_group": (0.0, 0.0), "calls_per_pipeline": (0.0, 0.0)}


def test_the_agent_of_this_checkout_is_run_from_this_checkout():
    """The agents run in directories of their own: this checkout goes first on their PYTHONPATH,
    or ``python -m region_agent`` would import whichever tree is installed (another worktree's)."""
    assert (CHECKOUT / "region_agent" / "__init__.py").is_file() and (CHECKOUT / "bench" / "rls_ab.py").is_file()
