"""The agent's settings: flags, environment, pepper, switches, TLS rules (region_agent/service/settings.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel.config import ConfigError
from region_agent.service.settings import AgentSettings, load_agent_settings, resolve_pepper

GW = {"LEASEHOLD_AGENT_GATEWAY_TOKENS": "edge:" + "0" * 64}  # authentication is on by default: one gateway


def test_authentication_on_without_a_gateway_token_refuses_to_start(tmp_path: Path):
    """Every decision door would answer 401 / UNAUTHENTICATED (Envoy's fail-open filter then lets
    every request through undecided): refused at start, as the allocator refuses to run without a
    region token. Operator tokens are optional (no operator access)."""
    for argv, env in (([], {}), (["--operator-tokens", "ops:" + "1" * 64], {}),
                      (["--gateway-tokens-file", str(tmp_path / "empty")], {})):
        (tmp_path / "empty").write_text("# no entry yet\n")
        with pytest.raises(ConfigError, match="gateway authentication is on but no gateway token is configured"):
            load_agent_settings(argv, env=env)
    assert load_agent_settings([], env=GW).gateway_tokens
    assert load_agent_settings(["--auth-disabled"], env={}).auth_disabled


def test_settings_flags_env_and_pepper(tmp_path: Path):
    s = load_agent_settings(["--redis-url", "redis+cluster://127.0.0.1:7000", "--port", "9000"],
                            env={**GW, "LEASEHOLD_AGENT_REGION": "eu"})
    assert (s.port, s.region, s.redis_url) == (9000, "eu", "redis+cluster://127.0.0.1:7000")
    with pytest.raises(ConfigError):
        load_agent_settings(["--port", "70000"], env=GW)
    with pytest.raises(ConfigError):
        resolve_pepper(AgentSettings(), env=GW)
    assert resolve_pepper(AgentSettings(), env={"LEASEHOLD_AGENT_PEPPER": "s3cret"}) == b"s3cret"
    f = tmp_path / "pepper"
    f.write_text("from-file\n")
    assert resolve_pepper(AgentSettings(pepper_file=str(f)), env=GW) == b"from-file"
    assert resolve_pepper(AgentSettings(insecure_dev_pepper=True), env=GW)


def test_switches_are_flags_and_the_old_valued_form_is_refused():
    s = load_agent_settings(["--insecure-dev-pepper", "--redis-cluster", "--port", "1"], env=GW)
    assert s.insecure_dev_pepper and s.redis_cluster and s.port == 1
    s = load_agent_settings(["--no-lease-warmup"], env={**GW, "LEASEHOLD_AGENT_LEASE_WARMUP": "true"})
    assert s.lease_warmup is False  # the flag wins over the environment
    for argv in (["--redis-cluster", "true"], ["--auth-disabled=false"], ["--lease-warmup", "no"]):
        with pytest.raises(ConfigError, match="is a switch and takes no value") as e:
            load_agent_settings(argv, env=GW)
        assert "--no-" in e.value.message


def test_every_agent_option_has_a_meaning_and_shows_its_default():
    from kernel.options import options
    from region_agent.service.settings import ENV_PREFIX

    for o in options(AgentSettings, ENV_PREFIX):
        assert len(o.help) > 10, f"{o.flag} has no Help(...) meaning"
        assert "(default: " in o.help_line() or "(required)" in o.help_line()


def test_log_level_is_checked_at_load():
    with pytest.raises(ConfigError, match="one of: debug, info, warning, error"):
        load_agent_settings(["--log-level", "verbose"], env=GW)


def test_policy_etcd_tls_rules(tmp_path: Path):
    from region_agent.service.settings import policy_etcd_tls

    assert policy_etcd_tls(load_agent_settings(["--policy-etcd", "h:1"], env=GW)) is None
    assert policy_etcd_tls(load_agent_settings(["--policy-etcd", "https://h:1"], env=GW)) is not None
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate")
    with pytest.raises(ConfigError, match="not a PEM CA"):
        load_agent_settings(["--policy-etcd", "h:1", "--policy-etcd-ca-file", str(ca)], env=GW)
    with pytest.raises(ConfigError, match="needs --policy-etcd "):
        load_agent_settings(["--policy-etcd-ca-file", str(ca)], env=GW)
    with pytest.raises(ConfigError, match="mix http:// and https://"):
        load_agent_settings(["--policy-etcd", "http://a:1,https://b:2"], env=GW)


def test_an_rlqs_time_to_live_must_leave_time_to_renew_within_the_delivery_bound():
    """A renewal is sent only while the assignment has longer than --rlqs-delivery-ms to live, due
    300 ms before that: a time to live not longer than both would end every assignment in use at its
    expiry and fund it again from the store (what made an agent without renewals collapse)."""
    assert load_agent_settings(["--rls-port", "8081", "--rlqs-max-ttl-s", "3"], env=GW).rlqs_delivery_ms == 2_500
    with pytest.raises(ConfigError, match=r"--rlqs-delivery-ms \(2500\) leaves no time to renew .* above 2.8 s"):
        load_agent_settings(["--rls-port", "8081", "--rlqs-max-ttl-s", "2"], env=GW)
    with pytest.raises(ConfigError, match="--rlqs-delivery-ms"):
        load_agent_settings(["--rls-port", "8081", "--rlqs-delivery-ms", "9800"], env=GW)
    assert load_agent_settings(["--rls-port", "8081", "--rlqs-max-ttl-s", "1", "--rlqs-delivery-ms", "600"], env=GW)
    assert load_agent_settings(["--rls-port", "8081", "--rlqs-max-ttl-s", "2", "--no-rlqs"], env=GW)


def test_rlqs_streams_must_leave_slots_of_the_port_to_rls_calls():
    assert load_agent_settings(["--rls-port", "8081"], env=GW).rlqs_max_streams < 4_096
    with pytest.raises(ConfigError, match="--rlqs-max-streams .* must be below --rls-max-concurrent-rpcs"):
        load_agent_settings(["--rls-port", "8081", "--rls-max-concurrent-rpcs", "512"], env=GW)
    s = load_agent_settings(["--rls-port", "8081", "--rls-max-concurrent-rpcs", "512", "--rlqs-max-streams", "256"],
                            env=GW)
    assert (s.rls_max_concurrent_rpcs, s.rlqs_max_streams) == (512, 256)
    assert load_agent_settings(["--rls-port", "8081", "--rls-max-concurrent-rpcs", "512", "--no-rlqs"], env=GW)
