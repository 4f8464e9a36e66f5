"""The prefix cache's hits per replica over a benchmark run, read from the server's `/metrics` before and after.

A single Sluice process exports `sluice_prefix_cache_hit_tokens_total` and `..._query_tokens_total`; the ingress of
`sluice serve --replicas N` exports the same names once per replica, labelled `replica="..."`. Either way the
run's figures are the differences, per replica (the single process is one replica, named "server").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import httpx

_SAMPLE = re.compile(r'^sluice_prefix_cache_(hit|query)_tokens_total(?:\{replica="([^"]*)"\})? (\S+)$', re.MULTILINE)


@dataclass(frozen=True)
class CacheCounters:
    hit_tokens: int
    query_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def parse(metrics_text: str) -> dict[str, CacheCounters]:
    values: dict[str, dict[str, int]] = {}
    for kind, replica, value in _SAMPLE.findall(metrics_text):
        values.setdefault(replica or "server", {})[kind] = int(float(value))
    return {replica: CacheCounters(v.get("hit", 0), v.get("query", 0)) for replica, v in values.items()}


def read(url: str) -> dict[str, CacheCounters]:
    """The counters of the server at `url`; none for a server without Sluice's /metrics (another system)."""
    response = httpx.get(url + "/metrics", timeout=30)
    return parse(response.text) if response.status_code == 200 else {}


def difference(after: dict[str, CacheCounters], before: dict[str, CacheCounters]) -> dict[str, CacheCounters]:
    zero = CacheCounters(0, 0)
    return {
        replica: CacheCounters(now.hit_tokens - before.get(replica, zero).hit_tokens,
                               now.query_tokens - before.get(replica, zero).query_tokens)
        for replica, now in sorted(after.items())
    }


def total(per_replica: dict[str, CacheCounters]) -> CacheCounters:
    return CacheCounters(sum(c.hit_tokens for c in per_replica.values()),
                         sum(c.query_tokens for c in per_replica.values()))


def report_rows(per_replica: dict[str, CacheCounters]) -> list[tuple[str, str]]:
    """Table rows: each replica's hits / queries (hit rate), then all replicas' cached-token share (none without
    figures)."""
    if not per_replica:
        return []
    rows = [(f"Prefix cache, replica {replica}", f"{c.hit_tokens} / {c.query_tokens} tokens ({c.hit_rate:.1%})")
            for replica, c in per_replica.items()]
    all_ = total(per_replica)
    rows.append(("Prefix cache, all replicas", f"{all_.hit_tokens} / {all_.query_tokens} tokens ({all_.hit_rate:.1%})"))
    return rows
