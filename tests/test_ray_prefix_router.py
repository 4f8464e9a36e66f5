"""The prefix router (app/prefix_router.py): its index of which replicas were sent which prompt prefixes, and the
ranks of replicas it gives Ray Serve."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from sluice.app.prefix_router import (  # noqa: E402
    PowerOfTwoRouter, PrefixAffinityRouter, PrefixIndex, RoundRobinRouter, Routing)

SYSTEM = "You are a helpful assistant. " * 20  # 580 characters: 9 blocks of 64


def test_a_prompt_matches_the_replica_sent_the_longest_shared_prefix():
    index = PrefixIndex(block_chars=64)
    index.record(index.hashes(SYSTEM + "first question"), "a")
    index.record(index.hashes(SYSTEM[:200] + "another system prompt entirely" * 10), "b")
    holders, depth = index.match(index.hashes(SYSTEM + "second question"), ["a", "b"])
    assert holders == {"a"} and depth == len(SYSTEM) // 64


def test_only_candidates_count_and_no_shared_block_is_no_match():
    index = PrefixIndex(block_chars=64)
    index.record(index.hashes(SYSTEM), "a")
    assert index.match(index.hashes(SYSTEM), ["b"]) == (set(), 0)
    assert index.match(index.hashes("x" * 600), ["a"]) == (set(), 0)
    assert index.match(index.hashes("short"), ["a"]) == (set(), 0)  # under one block: nothing to match


def test_a_prefix_sent_to_two_replicas_matches_both():
    index = PrefixIndex(block_chars=64)
    index.record(index.hashes(SYSTEM + "one"), "a")
    index.record(index.hashes(SYSTEM + "two"), "b")
    assert index.match(index.hashes(SYSTEM + "three"), ["a", "b", "c"])[0] == {"a", "b"}


def test_a_forgotten_replica_holds_nothing():
    index = PrefixIndex(block_chars=64)
    index.record(index.hashes(SYSTEM), "a")
    index.record(index.hashes(SYSTEM), "b")
    index.forget("a")
    assert index.match(index.hashes(SYSTEM), ["a", "b"])[0] == {"b"}
    index.forget("b")
    assert len(index) == 0


def test_the_least_recently_used_blocks_go_first_past_capacity():
    index = PrefixIndex(block_chars=4, capacity_blocks=4)
    index.record(index.hashes("aaaabbbb"), "r")
    index.record(index.hashes("ccccdddd"), "r")
    index.match(index.hashes("aaaabbbb"), ["r"])  # used again: now the most recent
    index.record(index.hashes("eeeeffff"), "r")
    assert index.match(index.hashes("aaaabbbb"), ["r"])[1] == 2
    assert index.match(index.hashes("ccccdddd"), ["r"])[1] == 0


def test_each_replica_counts_the_blocks_it_holds():
    index = PrefixIndex(block_chars=64, capacity_blocks=12)
    index.record(index.hashes(SYSTEM), "a")  # 9 blocks
    index.record(index.hashes(SYSTEM[:128]), "b")  # 2 of them
    assert (index.held("a"), index.held("b")) == (9, 2)
    index.record(index.hashes("z" * 320), "b")  # 5 more: 14 blocks, 2 least recently used out (a's)
    assert (index.held("a"), index.held("b")) == (7, 7)
    index.forget("b")
    assert (index.held("a"), index.held("b")) == (7, 0)


# --- The router: the ranks it gives Ray Serve, which takes the least loaded replica with room (fewer ongoing
# requests than its max_ongoing_requests) of the first rank that has one.

def make_router(imbalanced_threshold: int = 64) -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(DeploymentID("replicas"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(imbalanced_threshold=imbalanced_threshold)
    return router


def replica(name: str, max_ongoing_requests: int = 4) -> SimpleNamespace:
    """What the router reads of Ray Serve's `RunningReplica`."""
    return SimpleNamespace(replica_id=ReplicaID(name, DeploymentID("replicas")),
                           max_ongoing_requests=max_ongoing_requests)


def route(router: PrefixAffinityRouter | RoundRobinRouter, replicas: list[SimpleNamespace], key: str | None,
          loads: dict[str, int], pinned: str | None = None) -> str | None:
    """The replica Ray Serve sends the request to, by the router's ranks and these ongoing requests (None: it waits)."""
    for name, load in loads.items():
        router.replica_queue_len_cache.update(ReplicaID(name, DeploymentID("replicas")), load)

    async def routed() -> str | None:  # a PendingRequest belongs to a running event loop
        routing = None if key is None else Routing(key, pinned)
        pending = None if routing is None else PendingRequest([routing], {}, RequestMetadata("request", "request"))
        for rank in await router.choose_replicas(replicas, pending):
            room = [r for r in rank if loads.get(r.replica_id.unique_id, 0) < r.max_ongoing_requests]
            if room:
                chosen = min(room, key=lambda r: loads.get(r.replica_id.unique_id, 0)).replica_id
                router.on_request_routed(pending, chosen, None)
                return chosen.unique_id
        return None

    return asyncio.run(routed())


def test_a_prompt_follows_its_prefix_to_the_replica_that_was_sent_it():
    router, replicas = make_router(), [replica("a"), replica("b")]
    first = route(router, replicas, SYSTEM + "first question", {})
    assert route(router, replicas, SYSTEM + "second question", {first: 1}) == first


def test_a_full_replica_does_not_hold_a_request_for_its_prefix_while_another_has_room():
    """Below --imbalanced-threshold (here larger than --max-ongoing-requests) the prefix's replica is not
    overloaded; but it is full, so waiting for it would leave the other replica idle."""
    router, replicas = make_router(imbalanced_threshold=64), [replica("a"), replica("b")]
    first = route(router, replicas, SYSTEM + "first question", {})
    other = ({"a", "b"} - {first}).pop()
    assert route(router, replicas, SYSTEM + "second question", {first: 4, other: 0}) == other


def test_a_new_prefix_does_not_wait_for_a_full_replica_holding_the_fewest_prefixes():
    router, replicas = make_router(imbalanced_threshold=64), [replica("a"), replica("b")]
    fewest = route(router, replicas, SYSTEM, {})  # 9 blocks
    more = route(router, replicas, "another system prompt entirely " * 40, {})  # 19 blocks, to the other
    assert route(router, replicas, "a third one " * 20, {fewest: 4, more: 0}) == more


def test_a_dead_replicas_prefixes_go_to_the_live_ones():
    router, replicas = make_router(), [replica("a"), replica("b")]
    first = route(router, replicas, SYSTEM + "first question", {})
    router.on_replica_actor_died(ReplicaID(first, DeploymentID("replicas")))
    live = [r for r in replicas if r.replica_id.unique_id != first]
    assert route(router, live, SYSTEM + "second question", {}) == live[0].replica_id.unique_id
    assert router._index.held(first) == 0


def test_a_request_without_a_routing_key_or_with_an_empty_one_is_routed_and_indexes_nothing():
    router, replicas = make_router(), [replica("a"), replica("b")]
    assert route(router, replicas, None, {}) in {"a", "b"}
    assert route(router, replicas, "", {}) in {"a", "b"}
    assert len(router._index) == 0


@pytest.mark.parametrize("kind", [PrefixAffinityRouter, RoundRobinRouter, PowerOfTwoRouter])
def test_a_request_naming_a_replicas_stored_response_goes_there_whatever_its_prompt_or_load(kind):
    router = kind(DeploymentID("replicas"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    replicas = [replica("a"), replica("b")]
    first = route(router, replicas, SYSTEM + "first question", {})
    other = ({"a", "b"} - {first}).pop()
    assert all(route(router, replicas, SYSTEM + "more", {first: 0, other: 3}, pinned=other) == other
               for _ in range(4))
    assert route(router, replicas, "", {other: 4}, pinned=other) is None  # full: it waits for that replica
    # A replica that is gone stores nothing: any replica answers that the response is unknown.
    assert route(router, [replica(first)], "", {}, pinned=other) == first
