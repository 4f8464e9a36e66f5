"""The prefix router's index: which replicas were sent which prompt prefixes (app/prefix_router.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from sluice.app.prefix_router import PrefixIndex

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
