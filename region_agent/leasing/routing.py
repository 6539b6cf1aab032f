"""Which allocator replica to ask for a pool — pure, no I/O (the client does the asking).

An unsharded allocator (``--shards 1``) has one leader for every pool: the client sends every
call to its preferred URL and follows not-leader answers, as it always did, and this table
stays empty. A sharded allocator says so in its not-leader answers (``shard``, ``shards``,
``leaderNodeId``, ``leader``) and in ``GET /v1/shards`` (shard -> leader node and URL); from
then on each pool's calls go to the replica leading ``shard_of(pool, shards)``.

The agent reaches replicas through the URLs it was configured with (``--allocator-urls``),
which may be proxies or load-balancer entries rather than the URLs replicas advertise. A
replica's node id is tied to a configured URL when ``GET /v1/shards`` asked at that URL
answers with it; until then an advertised URL is used only if it is one of the configured ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kernel.shards import MAX_SHARDS, shard_of
from kernel.wire import ShardMap


@dataclass
class ShardRoutes:
    urls: list[str]  # the configured allocator URLs, normalised (no trailing slash)
    shards: int = 1  # 1 until a sharded allocator said otherwise
    leader_of: dict[int, str] = field(default_factory=dict)  # shard -> leader node id
    at_url: dict[str, str] = field(default_factory=dict)  # node id -> configured URL it answered on
    advertised: dict[str, str] = field(default_factory=dict)  # node id -> the URL it advertises
    revision: int = 0  # etcd revision of the map leader_of came from
    stale: bool = False  # something changed that a GET /v1/shards would tell

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    def url_for(self, pool: str) -> str | None:
        """The configured URL of the replica leading ``pool``'s shard, or None (unsharded, or not
        known: the caller uses its preferred URL and learns from the answer)."""
        if not self.sharded:
            return None
        node = self.leader_of.get(shard_of(pool, self.shards))
        return None if node is None else self.url_of(node)

    def url_of(self, node: str) -> str | None:
        url = self.at_url.get(node)
        if url is None:
            adv = self.advertised.get(node)
            url = adv if adv in self.urls else None
        return url

    def _reset(self, shards: int) -> None:
        self.shards, self.leader_of, self.revision, self.stale = shards, {}, 0, shards > 1

    def learn_map(self, answered_at: str, m: ShardMap) -> None:
        """A ``GET /v1/shards`` answer received from configured URL ``answered_at``."""
        if not 1 <= m.shards <= MAX_SHARDS:
            return
        for node, url in list(self.at_url.items()):  # one node per URL
            if url == answered_at and node != m.node_id:
                del self.at_url[node]
        self.at_url[m.node_id] = answered_at
        self.advertised[m.node_id] = m.url.rstrip("/")
        for r in m.members:
            self.advertised[r.node_id] = r.url.rstrip("/")
        if m.shards != self.shards:
            self._reset(m.shards)
        if m.revision >= self.revision:
            self.revision = m.revision
            self.leader_of = {sl.shard: sl.node_id for sl in m.leaders if sl.node_id and 0 <= sl.shard < m.shards}
            for sl in m.leaders:
                if sl.node_id and sl.url:
                    self.advertised.setdefault(sl.node_id, sl.url.rstrip("/"))
        self.stale = any(self.url_of(n) is None for n in set(self.leader_of.values()))

    def learn_not_leader(self, problem: dict[str, Any]) -> None:
        """A not-leader problem; from a sharded allocator it names the shard and its leader."""
        shards, shard = problem.get("shards"), problem.get("shard")
        if not isinstance(shards, int) or not isinstance(shard, int) or not 1 <= shards <= MAX_SHARDS:
            return  # an unsharded allocator: the client follows ``leader`` as it always did
        if shards != self.shards:
            self._reset(shards)
        node, url = problem.get("leaderNodeId"), problem.get("leader")
        if isinstance(node, str) and node:
            self.leader_of[shard] = node
            if isinstance(url, str) and url:
                self.advertised[node] = url.rstrip("/")
            if self.url_of(node) is None:
                self.stale = True
        else:
            self.leader_of.pop(shard, None)  # an election or a handoff under way
            self.stale = True

    def forget_url(self, url: str) -> None:
        """``url`` did not answer: the shards led by the node behind it are unknown for now."""
        if not self.sharded:
            return
        nodes = {n for n, u in self.at_url.items() if u == url} | \
            {n for n, u in self.advertised.items() if u == url and n not in self.at_url}
        if nodes:
            self.leader_of = {s: n for s, n in self.leader_of.items() if n not in nodes}
        self.stale = True

    def split(self, pools: list[str], fallback: str) -> dict[str, list[int]]:
        """Indices of ``pools`` grouped by the URL to send them to (``fallback`` when unknown)."""
        out: dict[str, list[int]] = {}
        for i, pool in enumerate(pools):
            out.setdefault(self.url_for(pool) or fallback, []).append(i)
        return out
