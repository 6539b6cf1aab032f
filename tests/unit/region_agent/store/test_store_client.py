"""Redis URLs of the agent's store (region_agent/store/client.py): one node, a cluster, a Sentinel."""

import pytest

from kernel.config import ConfigError
from region_agent.service.settings import load_agent_settings
from region_agent.store.client import (
    CLUSTER,
    SENTINEL,
    STANDALONE,
    is_cluster_url,
    is_sentinel_url,
    make_sentinel_client,
    parse_store_url,
    plain_url,
    redacted,
)


def test_cluster_urls():
    assert is_cluster_url("redis+cluster://h:1") and not is_cluster_url("redis://h:1")
    assert plain_url("rediss+cluster://h:1/0") == "rediss://h:1/0"
    assert redacted("redis://user:pw@h:1/0") == "redis://h:1/0"
    assert redacted("redis+sentinel://:pw@h:1,g:2/svc") == "redis+sentinel://h:1,g:2/svc"


def test_the_three_kinds():
    u = parse_store_url("redis://agent:s3cr%40t@10.0.0.1:6380/2?ssl_cert_reqs=none")
    assert (u.kind, u.hosts, u.db, u.userinfo) == (STANDALONE, (("10.0.0.1", 6380),), 2, "agent:s3cr%40t")
    assert u.node_url("10.0.0.9", 7000) == "redis://agent:s3cr%40t@10.0.0.9:7000/2?ssl_cert_reqs=none"
    c = parse_store_url("rediss+cluster://a:7000,b:7001,[::1]:7002")
    assert (c.kind, c.scheme, c.names) == (CLUSTER, "rediss", ["a:7000", "b:7001", "::1:7002"])
    assert c.node_url("::1", 7002) == "rediss://[::1]:7002/0"
    assert parse_store_url("redis://h:1", cluster=True).kind == CLUSTER  # --redis-cluster true
    s = parse_store_url("redis+sentinel://u:p@s1,s2:26380/lh-main/3")
    assert (s.kind, s.hosts, s.service, s.db) == (SENTINEL, (("s1", 26379), ("s2", 26380)), "lh-main", 3)
    assert is_sentinel_url("redis+sentinel://s1/x")


@pytest.mark.parametrize(("url", "says"), [
    ("localhost:6379", "expected a URL starting with redis://"),
    ("http://h:1", "expected a URL starting with redis://"),
    ("redis+shard://h:1", "expected a URL starting with redis://"),
    ("redis://", "no host"),
    ("redis://a:1,b:2", "several hosts"),
    ("redis://h:99999", "port"),
    ("redis://h:x", "port"),
    ("redis://h:1/zero", "number"),
    ("redis+cluster://h:1/3", "database 0"),
    ("redis+sentinel://h:26379", "service"),
    ("redis+sentinel://h:26379/svc/0/extra", "path"),
])
def test_bad_urls_are_refused_with_a_reason(url, says):
    with pytest.raises(ValueError, match=says):
        parse_store_url(url)


@pytest.mark.parametrize("url", [
    "redis://agent:pa/ss@10.0.0.1:6379/0",  # an unencoded '/' used to be read as the end of the host
    "redis://agent:pa?ss@10.0.0.1:6379/0",
    "redis://agent:pa#ss@10.0.0.1:6379/0",  # accepted, then redis-py read 'pa' as the port
    "redis+sentinel://agent:pa/ss@10.0.0.1:26379/svc",
    "redis+cluster://agent:pa/ss@h1:1,h2:2",
])
def test_a_password_with_a_delimiter_is_refused_naming_none_of_it(url):
    with pytest.raises(ValueError) as e:
        parse_store_url(url)
    assert "percent-encode" in str(e.value) or "%23" in str(e.value)
    assert "pa" not in str(e.value).replace("password", "") and "agent" not in str(e.value)
    with pytest.raises(ConfigError) as c:
        load_agent_settings(["--redis-url", url], env={})
    assert "agent:pa" not in str(c.value) and "ss@" not in str(c.value)


@pytest.mark.parametrize("url", ["unix:///run/redis/redis.sock", "unix:///run/redis/redis.sock?db=2",
                                 "unix://agent@/run/redis/redis.sock", "redis://agent:p%2Fss@h:1/0",
                                 "redis://agent:p@ss@h:1/0", "redis://h:1?db=3"])
def test_url_forms_accepted_at_start(url):
    assert load_agent_settings(["--redis-url", url, "--auth-disabled"], env={}).redis_url == url


def test_an_invalid_url_is_echoed_without_its_password():
    with pytest.raises(ConfigError) as e:
        load_agent_settings(["--redis-url", "redis+shard://agent:s3cr3t@h:1/0"], env={})  # not a scheme of ours
    assert "s3cr3t" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_agent_settings(["--redis-url", "unix://", "--auth-disabled"], env={})  # a socket URL without its path
    assert "socket's path" in str(e.value)


def test_a_bad_url_is_a_settings_error_at_start():
    with pytest.raises(ConfigError, match="several hosts"):
        load_agent_settings(["--redis-url", "redis://a:1,b:2"], env={})


def test_the_sentinel_client_asks_the_sentinels_for_the_named_primary():
    s = parse_store_url("redis+sentinel://agent:pw@127.0.0.1:26379,127.0.0.2:26380/lh/1")
    client = make_sentinel_client(s, max_connections=7, socket_timeout=0.5, sentinel_password="sp")
    pool = client.connection_pool
    assert pool.service_name == "lh" and pool.is_master and pool.max_connections == 7
    kw = pool.connection_kwargs
    assert (kw["username"], kw["password"], kw["db"], kw["socket_timeout"]) == ("agent", "pw", 1, 0.5)
    sentinels = pool.sentinel_manager.sentinels
    assert [(c.connection_pool.connection_kwargs["host"], c.connection_pool.connection_kwargs["port"])
            for c in sentinels] == [("127.0.0.1", 26379), ("127.0.0.2", 26380)]
    assert sentinels[0].connection_pool.connection_kwargs["password"] == "sp"
    assert sentinels[0].connection_pool.connection_kwargs["socket_connect_timeout"] == 0.25
