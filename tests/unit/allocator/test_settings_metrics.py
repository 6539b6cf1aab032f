"""Allocator settings (flags, env, validation) and metric label bounds. No network."""

from __future__ import annotations

import pytest

from allocator.metrics import MAX_REGION_LABELS, AllocatorMetrics
from allocator.settings import load
from kernel.config import ConfigError
from kernel.etcd_store import parse_endpoints

BASE = ["--etcd", "127.0.0.1:2379,127.0.0.1:2380", "--policy", "b.json", "--node-id", "a1",
        "--region-tokens", "eu:" + "0" * 64]


def test_flags_env_and_defaults() -> None:
    s = load(BASE + ["--port", "9000"], env={"LEASEHOLD_ALLOCATOR_ELECTION_TTL_S": "5",
                                            "LEASEHOLD_ALLOCATOR_PORT": "1234"})
    assert s.port == 9000  # flag beats env
    assert s.election_ttl_s == 5
    assert s.prefix == "/leasehold/" and s.url == "http://127.0.0.1:9000"
    s = load([], env={"LEASEHOLD_ALLOCATOR_ETCD": "h:1", "LEASEHOLD_ALLOCATOR_POLICY": "p",
                      "LEASEHOLD_ALLOCATOR_NODE_ID": "n", "LEASEHOLD_ALLOCATOR_ADVERTISE_URL": "http://x:1",
                      "LEASEHOLD_ALLOCATOR_AUTH_DISABLED": "true"})
    assert s.url == "http://x:1"


@pytest.mark.parametrize("extra", [["--port", "0"], ["--election-ttl-s", "1"], ["--etcd", "nohostport"],
                                   ["--prefix", "noslash"], ["--advertise-url", "x:1"], ["--log-level", "loud"]])
def test_bad_settings_exit_with_a_clear_message(extra: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        load(BASE + extra, env={})
    assert e.value.message.startswith(f"invalid value {extra[1]!r} for {extra[0]}: ")


def test_region_authentication_without_a_region_token_is_refused_at_start(tmp_path) -> None:
    """Authentication is on unless --auth-disabled: with no region token every lease request would
    be a 401 and every agent would live on its fallback allowance, while the allocator looked up."""
    empty = tmp_path / "region-token-hashes"
    empty.write_text("# none yet\n")
    base = BASE[:-2]
    for argv in (base, [*base, "--region-tokens-file", str(empty)]):
        with pytest.raises(ConfigError, match="no region token is configured"):
            load(argv, env={})
    assert load([*base, "--auth-disabled"], env={}).auth_disabled
    assert not load([*base, "--region-tokens-file", str(empty), "--region-tokens", "us:" + "1" * 64],
                    env={}).auth_disabled


def test_an_etcd_password_file_without_an_etcd_user_is_refused(tmp_path) -> None:
    """A password file alone was ignored: the allocator called etcd without a user, and an etcd
    with authentication on refused it at every call."""
    pw = tmp_path / "etcd-allocator.password"
    pw.write_text("secret\n")
    with pytest.raises(ConfigError, match="--etcd-password-file needs --etcd-user"):
        load([*BASE, "--etcd-password-file", str(pw)], env={})
    assert load([*BASE, "--etcd-password-file", str(pw), "--etcd-user", "allocator"], env={}).etcd_user == "allocator"


def test_missing_required_setting() -> None:
    with pytest.raises(ConfigError, match="etcd|policy|node_id"):
        load(["--policy", "b.json"], env={})


def test_parse_endpoints() -> None:
    assert parse_endpoints("http://a:1, b:2") == [("a", 1), ("b", 2)]
    with pytest.raises(ValueError):
        parse_endpoints(" , ")


def test_region_labels_are_bounded() -> None:
    m = AllocatorMetrics()
    labels = {m.region(f"r{i}") for i in range(MAX_REGION_LABELS + 50)}
    assert len(labels) == MAX_REGION_LABELS + 1 and "other" in labels
    assert m.region("r0") == "r0"


def test_trailing_newline_is_not_a_valid_node_id() -> None:
    with pytest.raises(ConfigError):
        load(["--etcd", "h:1", "--policy", "p", "--node-id", "a1\n"], env={})
