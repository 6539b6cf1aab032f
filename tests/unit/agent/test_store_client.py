"""Redis URLs of the agent's client (region_agent/store/client.py)."""

from region_agent.store.client import is_cluster_url, plain_url, redacted


def test_cluster_urls():
    assert is_cluster_url("redis+cluster://h:1") and not is_cluster_url("redis://h:1")
    assert plain_url("rediss+cluster://h:1/0") == "rediss://h:1/0"
    assert redacted("redis://user:pw@h:1/0") == "redis://h:1/0"
