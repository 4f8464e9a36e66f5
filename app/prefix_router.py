"""Ray Serve request routers for Sluice replicas: prefix affinity, and round-robin and power of two choices to
compare it with.

`PrefixAffinityRouter` sends a request to the replica that was sent the longest prefix of its prompt, so that
replica's prefix cache serves it; a request no replica has seen the start of goes to the replica that holds
the fewest prefixes among those not overloaded (so that prefixes spread evenly over the caches). A replica is
overloaded when its ongoing requests (Ray's cached queue lengths) exceed the least loaded replica's by more than
`imbalanced_threshold`; a request whose prefix's replica is overloaded goes to the less loaded of two random
replicas (power of two choices), which becomes a second holder of the prefix. Where the replicas chosen are all
full (at Ray's `max_ongoing_requests`), the least loaded of the others with room takes the request.

Why not Ray's shipped `PrefixCacheAffinityRouter` (ray.llm): it matches characters of OpenAI request objects
(`.prompt` / `.messages`), where Sluice prompts are often token ids, and it keeps its tree in a detached actor
that it queries with a blocking `ray.get` on the routing event loop for every request. Here the index lives in
the router itself (one per ingress process: an approximation of what each replica caches, as SGLang's router
keeps): `PrefixIndex` maps chained hashes of fixed-size blocks of the request's routing key (the prompt fields
of its JSON body, `app/ingress.py`) to the replicas that were sent them, forgetting the least recently used
blocks beyond its capacity, as the replicas' caches evict theirs.

A request that names state one replica holds (a stored response, `app/response_ids.py`) goes to that replica
alone while it runs, whatever the router.

The `Routing` (routing key, pinned replica) is the first positional argument of the replica call
(`SluiceReplica.forward`'s caller passes it); Ray's `RequestRouter` base probes queue lengths and picks the least
loaded replica of the rank returned.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica


class PrefixIndex:
    """Which replicas were sent which prefixes: chained block hashes -> replica ids, least recently used first out.

    A key's i-th hash covers its first (i + 1) * `block_chars` characters, so equal hashes mean equal prefixes
    (up to hash collisions); a trailing partial block is not indexed, as the engine caches only full pages.
    """

    def __init__(self, block_chars: int = 64, capacity_blocks: int = 200_000) -> None:
        self.block_chars = block_chars
        self.capacity_blocks = capacity_blocks
        self._owners: OrderedDict[int, set[str]] = OrderedDict()
        self._held: Counter[str] = Counter()  # blocks each replica holds

    def hashes(self, key: str) -> list[int]:
        chained, out = 0, []
        for start in range(0, len(key) - self.block_chars + 1, self.block_chars):
            chained = hash((chained, key[start:start + self.block_chars]))
            out.append(chained)
        return out

    def match(self, hashes: list[int], candidates: Iterable[str]) -> tuple[set[str], int]:
        """The candidates holding the longest indexed prefix of `hashes`, and its length in blocks."""
        holders, depth = set(candidates), 0
        for block in hashes:
            owners = self._owners.get(block)
            deeper = holders & owners if owners else set()
            if not deeper:
                break
            holders, depth = deeper, depth + 1
            self._owners.move_to_end(block)
        return (holders, depth) if depth else (set(), 0)

    def record(self, hashes: list[int], replica: str) -> None:
        for block in hashes:
            owners = self._owners.setdefault(block, set())
            if replica not in owners:
                owners.add(replica)
                self._held[replica] += 1
            self._owners.move_to_end(block)
        while len(self._owners) > self.capacity_blocks:
            _, owners = self._owners.popitem(last=False)
            self._held.subtract(owners)

    def forget(self, replica: str) -> None:
        for block in [b for b, owners in self._owners.items() if replica in owners]:
            owners = self._owners[block]
            owners.discard(replica)
            if not owners:
                del self._owners[block]
        del self._held[replica]

    def held(self, replica: str) -> int:
        """How many indexed blocks `replica` holds: its share of the prefixes in play."""
        return self._held[replica]

    def __len__(self) -> int:
        return len(self._owners)


class Routing(NamedTuple):
    """What a request tells the router: `key`, the text whose prefixes choose its replica (`app/ingress.py`), and
    `replica`, the one that must take it (it holds what the request names), if any."""

    key: str
    replica: str | None = None


def _routing(pending_request: PendingRequest | None) -> Routing:
    # By its shape, not its class: the router may be handed a copy of the class the ingress made it with.
    arg = pending_request.args[0] if pending_request is not None and pending_request.args else None
    return Routing(*arg) if isinstance(arg, tuple) and len(arg) == 2 else Routing("")


class _SluiceRouter(RequestRouter):
    """A request naming a replica's state goes to that replica while it runs; any other, where `_ranks` says."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        routing = _routing(pending_request)
        pinned = [r for r in candidate_replicas if routing.replica and r.replica_id.unique_id == routing.replica]
        if pinned or not candidate_replicas:
            return [pinned] if pinned else []
        return self._ranks(candidate_replicas, routing.key)

    def _ranks(self, candidate_replicas: list[RunningReplica], key: str) -> list[list[RunningReplica]]:
        """Ranks of replicas for a request with the routing key `key`: Ray takes the least loaded replica with room
        of the first rank that has one."""
        raise NotImplementedError


class PrefixAffinityRouter(_SluiceRouter):
    """Prefix affinity with a load guard (module docstring). Set with Ray Serve's `request_router_config`."""

    def initialize_state(self, imbalanced_threshold: int = 64, block_chars: int = 64,
                         capacity_blocks: int = 200_000) -> None:
        self._imbalanced_threshold = imbalanced_threshold
        self._index = PrefixIndex(block_chars, capacity_blocks)

    def _ranks(self, candidate_replicas: list[RunningReplica], key: str) -> list[list[RunningReplica]]:
        preferred = self._preferred(candidate_replicas, key)
        # The others come second, so that a full replica (at --max-ongoing-requests, which may be below
        # --imbalanced-threshold) never holds a request while another has room.
        rest = [r for r in candidate_replicas if r not in preferred]
        return [preferred, rest] if rest else [preferred]

    def _preferred(self, candidate_replicas: list[RunningReplica], key: str) -> list[RunningReplica]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        hashes = self._index.hashes(key) if key else []
        holders, _ = self._index.match(hashes, by_id)
        least = min(self._load(r) for r in candidate_replicas)
        if holders and min(self._load(by_id[h]) for h in holders) - least <= self._imbalanced_threshold:
            return [by_id[h] for h in holders]
        if holders:
            return random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        # A new prefix: of the replicas not overloaded, the one holding the fewest prefixes takes it, so that the
        # groups spread evenly over the caches; recorded now, so that the requests sharing it that are routed
        # before this one lands follow it there instead of spreading.
        fit = [r for r in candidate_replicas if self._load(r) - least <= self._imbalanced_threshold]
        fewest = min(self._index.held(r.replica_id.unique_id) for r in fit)
        chosen = random.choice([r for r in fit if self._index.held(r.replica_id.unique_id) == fewest])
        if hashes:
            self._index.record(hashes, chosen.replica_id.unique_id)
        return [chosen]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: object) -> None:
        if key := _routing(pending_request).key:
            self._index.record(self._index.hashes(key), replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self._replica_id_set) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self._index.forget(replica_id.unique_id)

    def _load(self, replica: RunningReplica) -> int:
        """The replica's ongoing requests as last reported (0 if unknown: a fresh replica)."""
        return self._replica_queue_len_cache.get(replica.replica_id) or 0


class RoundRobinRouter(_SluiceRouter):
    """Each request to the next replica in a fixed order, whatever its prompt or load: the baseline."""

    def initialize_state(self) -> None:
        self._turn = 0

    def _ranks(self, candidate_replicas: list[RunningReplica], key: str) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        self._turn += 1
        return [[ordered[self._turn % len(ordered)]]]


class PowerOfTwoRouter(_SluiceRouter):
    """The less loaded of two random replicas (Ray Serve's default policy, which cannot follow a request to the
    replica that stores what it names)."""

    def _ranks(self, candidate_replicas: list[RunningReplica], key: str) -> list[list[RunningReplica]]:
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
