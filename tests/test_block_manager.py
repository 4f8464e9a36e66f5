"""Block manager: reference-counted pages, chained-hash prefix caching, LRU eviction, counters."""

import threading

import numpy as np

from sluice.batching import block_manager
from sluice.batching.block_manager import BlockManager
from sluice.batching.kv_store import KVLayout, KVStore
from sluice.batching.sampling_params import CacheNamespace, SamplingParams
from sluice.batching.sequence import Sequence

from sequences import make_sequence

PAGE = 4


def make_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return make_sequence(seq_id, tokens)


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """Admits `seq` with whatever the cache holds and marks its whole prompt computed."""
    shared, stored = bm.match_prefix(seq)
    bm.admit(seq, shared, stored, count_query=True)
    bm.grow(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def test_grow_allocates_pages_for_the_tokens_and_free_returns_them():
    bm = BlockManager(num_pages=8, page_size=PAGE)
    seq = make_seq(list(range(10)))
    bm.grow(seq, 10)
    assert len(seq.page_table) == 3 and len(set(seq.page_table)) == 3
    assert bm.num_used_pages == 3
    bm.free(seq)
    assert bm.num_used_pages == 0 and seq.page_table == []


def test_shared_prefix_reuses_full_pages_and_counts_hits():
    bm = BlockManager(num_pages=16, page_size=PAGE)
    first = make_seq([5, 6, 7, 8, 9, 10, 11, 12, 13, 14], seq_id=0)
    prefill(bm, first)
    second = make_seq([5, 6, 7, 8, 9, 10, 11, 12, 99, 98, 97], seq_id=1)
    prefill(bm, second)
    assert second.page_table[:2] == first.page_table[:2]
    assert second.page_table[2] != first.page_table[2]
    assert second.num_cached_tokens is None  # set by the scheduler, not the pool
    assert bm.ref_counts[first.page_table[0]] == 2
    assert bm.hit_tokens == 2 * PAGE
    assert bm.query_tokens == 10 + 11


def test_hash_is_chained_so_an_equal_page_after_a_different_prefix_is_not_reused():
    bm = BlockManager(num_pages=16, page_size=PAGE)
    prefill(bm, make_seq([1, 1, 1, 1, 2, 2, 2, 2, 0], seq_id=0))
    other = make_seq([3, 3, 3, 3, 2, 2, 2, 2, 0], seq_id=1)
    assert bm.match_prefix(other) == ([], [])


def python_hash_collision(page: list[int]) -> list[int]:
    """Another page whose tuple has `page`'s `hash`: Python's tuple hash (xxHash's rounds over each item's hash, all
    invertible) is solved for the last item. Ids this large are no token's, but a vocabulary's ids find one by
    meeting in the middle, in about 2^32 steps."""
    mask, prime1, prime2, prime5 = (1 << 64) - 1, 11400714785074694791, 14029467366897019727, 2870177450012600261

    def round_(acc: int, item: int) -> int:
        acc = (acc + item * prime2) & mask
        return (((acc << 31) | (acc >> 33)) & mask) * prime1 & mask

    acc = prime5
    for item in page[:-2]:
        acc = round_(acc, item)
    want = round_(acc, page[-2])
    for item in range(1 << 10, 1 << 11):
        last = (page[-1] + (want - round_(acc, item)) * pow(prime2, -1, 1 << 64)) & mask
        if last < (1 << 61) - 1:  # an int below the modulus of int hashing hashes to itself
            return [*page[:-2], item, last]
    raise AssertionError("no colliding page")


def test_a_page_after_a_prefix_whose_hash_collides_with_another_s_is_not_reused():
    """A client that crafts a first page colliding with a popular prompt's (under a 64-bit, invertible hash) and
    sends it before that prompt's second page: the prompt must not be served the K/V computed after the crafted
    page."""
    popular, crafted = [0, 1, 2, 3], python_hash_collision([0, 1, 2, 3])
    assert crafted != popular and hash((0, tuple(crafted))) == hash((0, tuple(popular)))
    bm = BlockManager(num_pages=16, page_size=PAGE)
    prefill(bm, make_seq(popular + [9], seq_id=0))
    prefill(bm, make_seq(crafted + [4, 5, 6, 7, 9], seq_id=1))
    victim = make_seq(popular + [4, 5, 6, 7, 9], seq_id=2)
    assert len(bm.match_prefix(victim)[0]) == 1  # its first page only


def test_a_cache_salt_shares_pages_only_with_requests_of_the_same_salt(tmp_path):
    layout = KVLayout(model="m", quantization="none", dtype="float32", kv_dtype="float32", page_size=PAGE,
                      num_layers=1, num_kv_heads=1, head_dim=2)
    store = KVStore(layout, tmp_path, ram_bytes=1 << 20, disk_bytes=1 << 20)
    bm = BlockManager(num_pages=32, page_size=PAGE, store=store)
    tokens = list(range(9))

    def salted(salt: str | None, seq_id: int) -> Sequence:
        return make_sequence(seq_id, tokens, SamplingParams(cache_salt=salt))

    prefill(bm, salted("alice", 0))
    assert bm.match_prefix(salted("bob", 1))[0] == [] and bm.match_prefix(salted(None, 2))[0] == []
    assert len(bm.match_prefix(salted("alice", 3))[0]) == 2
    # The persistent store's keys are salted too, and the unsalted ones unchanged.
    saved = [key for _, key in bm.saves]
    assert saved == layout.page_keys(tokens, namespace=CacheNamespace("alice", None))
    assert not set(saved) & set(layout.page_keys(tokens, namespace=CacheNamespace("bob", None))
                                + layout.page_keys(tokens))
    # A salt is never hashed as a page is: one whose bytes are a page's tokens keys no unsalted page.
    page = np.asarray(tokens[:PAGE], "<i4").tobytes().decode()
    assert not set(layout.page_keys(tokens[PAGE:], namespace=CacheNamespace(page, None))) & set(layout.page_keys(tokens))
    store.close()


def test_whole_prompt_cached_still_leaves_the_last_token_to_compute():
    bm = BlockManager(num_pages=16, page_size=PAGE)
    prefill(bm, make_seq(list(range(8)), seq_id=0))
    again = make_seq(list(range(8)), seq_id=1)
    pages, _ = bm.match_prefix(again)
    assert len(pages) == 1  # 8 tokens = 2 full pages, but the second holds the token to sample from


def test_freed_cached_pages_stay_reusable_until_evicted_oldest_first():
    bm = BlockManager(num_pages=4, page_size=PAGE)
    a = make_seq([1] * 8 + [0], seq_id=0)
    prefill(bm, a)
    a_pages = list(a.page_table)
    bm.free(a)
    assert bm.num_used_pages == 0 and bm.counters().pages_cached == 2
    b = make_seq([1] * 8 + [5], seq_id=1)
    prefill(bm, b)
    assert b.page_table[:2] == a_pages[:2]
    bm.free(b)
    # Filling the whole pool evicts the cached pages; the prefix is then gone.
    c = make_seq([7] * 16, seq_id=2)
    bm.grow(c, 16)
    assert bm.num_free_pages == 0
    assert bm.match_prefix(make_seq([1] * 8 + [5], seq_id=3)) == ([], [])


def test_eviction_takes_the_tail_of_a_freed_prefix_before_its_head():
    bm = BlockManager(num_pages=3, page_size=PAGE)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], seq_id=0)
    prefill(bm, a)  # 3 pages, the first two cached
    a_pages = list(a.page_table)
    bm.free(a)
    bm.grow(make_seq([0], seq_id=1), 1)  # takes the uncached third page
    bm.grow(make_seq([0], seq_id=2), 1)  # evicts one cached page: the second, not the first
    pages, _ = bm.match_prefix(make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], seq_id=3))
    assert pages == a_pages[:1]


def test_prefix_caching_off_never_shares():
    bm = BlockManager(num_pages=16, page_size=PAGE, enable_prefix_caching=False)
    prefill(bm, make_seq(list(range(9)), seq_id=0))
    assert bm.match_prefix(make_seq(list(range(9)), seq_id=1)) == ([], [])
    assert bm.counters().pages_cached == 0


def test_can_admit_counts_reclaimed_cached_pages_against_the_free_pool():
    bm = BlockManager(num_pages=3, page_size=PAGE)
    a = make_seq([1] * 8 + [2], seq_id=0)
    prefill(bm, a)
    bm.free(a)  # 2 evictable cached pages + 1 free page
    b = make_seq([1] * 8 + [2, 3, 4, 5, 6], seq_id=1)
    shared, _ = bm.match_prefix(b)
    assert len(shared) == 2
    assert bm.can_admit(b, shared, num_new_tokens=4)  # reuses 2 pages, needs 1 more
    assert not bm.can_admit(b, shared, num_new_tokens=5)  # would need 2 more


def test_with_a_store_full_pages_are_listed_to_save_and_a_stored_prefix_is_admitted_into_fresh_pages(tmp_path,
                                                                                                    monkeypatch):
    layout = KVLayout(model="m", quantization="none", dtype="float32", kv_dtype="float32", page_size=PAGE,
                      num_layers=1, num_kv_heads=1, head_dim=2)
    store = KVStore(layout, tmp_path, ram_bytes=1 << 20, disk_bytes=1 << 20)
    first = BlockManager(num_pages=16, page_size=PAGE, store=store)
    seq = make_seq(list(range(10)), seq_id=0)
    prefill(first, seq)
    assert [page for page, _ in first.saves] == seq.page_table[:2]  # the two full pages, not the partial third
    keys = layout.page_keys(seq.token_ids)
    assert [key for _, key in first.saves] == keys
    for i, key in enumerate(keys):
        store.put(key, tuple(np.full(shape, i, dtype) for shape, dtype in layout.payload_specs))
    store.flush()
    store._ram.clear()  # on disk only, as after a restart
    reads = []
    real_read = KVStore._read
    monkeypatch.setattr(KVStore, "_read", lambda self, key: reads.append(threading.current_thread().name)
                        or real_read(self, key))
    # A fresh pool (a restarted engine) admits the stored prefix instead of computing it, once the store's reader
    # thread has read it.
    second = BlockManager(num_pages=16, page_size=PAGE, store=store)
    again = make_seq(list(range(9)) + [77], seq_id=1)
    second.prefetch(again)
    again.stored_prefix.payloads.result(timeout=10)
    shared, stored = second.match_prefix(again)
    assert shared == [] and [int(p[0].flat[0]) for p in stored] == [0, 1]
    assert len(reads) == 2 and all(name.startswith("kv-store-reader") for name in reads)
    second.admit(again, shared, stored, count_query=True)
    assert again.num_computed_tokens == 2 * PAGE and second.hit_tokens == 2 * PAGE
    assert [page for page, _ in second.loads] == again.page_table
    assert second.saves == []  # already stored
    # The loaded pages are in the pool's own prefix cache now.
    assert second.match_prefix(make_seq(list(range(9)), seq_id=2))[0] == again.page_table
    store.close()


def test_a_stored_prefix_is_not_ready_until_read_and_is_read_again_if_the_pool_lost_pages_meanwhile(tmp_path):
    layout = KVLayout(model="m", quantization="none", dtype="float32", kv_dtype="float32", page_size=PAGE,
                      num_layers=1, num_kv_heads=1, head_dim=2)
    store = KVStore(layout, tmp_path, ram_bytes=1 << 20, disk_bytes=1 << 20)
    tokens = list(range(13))
    for i, key in enumerate(layout.page_keys(tokens[:3 * PAGE])):
        store.put(key, tuple(np.full(shape, i, dtype) for shape, dtype in layout.payload_specs))
    bm = BlockManager(num_pages=16, page_size=PAGE, store=store)
    holder = make_seq(tokens[:PAGE + 1], seq_id=0)
    bm.admit(holder, [], [], count_query=False)  # the pool holds page 0 (computed, not read)
    bm.grow(holder, PAGE + 1)
    holder.num_computed_tokens = PAGE + 1
    bm.commit(holder)
    seq = make_seq(tokens, seq_id=1)
    gate = threading.Event()
    real_get = store.get
    store.get = lambda key: gate.wait(10) and real_get(key)
    bm.prefetch(seq)
    assert seq.stored_prefix.first == 1
    assert bm.match_prefix(seq)[1] is None  # still reading
    gate.set()
    seq.stored_prefix.payloads.result(timeout=10)
    shared, stored = bm.match_prefix(seq)
    assert shared == holder.page_table[:1] and [int(p[0].flat[0]) for p in stored] == [1, 2]
    bm.free(holder)
    bm.reset()  # the pool's pages are gone: page 0 must come from the store too, so it is read again
    assert bm.match_prefix(seq)[1] is None
    seq.stored_prefix.payloads.result(timeout=10)
    assert [int(p[0].flat[0]) for p in bm.match_prefix(seq)[1]] == [0, 1, 2]
    store.close()


def test_a_sequence_preempted_with_placeholders_reads_and_keys_only_its_known_pages(tmp_path):
    """Preempted while its multi-step call runs, a sequence's last tokens are placeholders: the store is asked for
    the pages of its known tokens only, and its store keys, kept on it, are those of its real tokens once they come
    (keys hashed over placeholders filed its pages where no prefix would find them)."""
    layout = KVLayout(model="m", quantization="none", dtype="float32", kv_dtype="float32", page_size=PAGE,
                      num_layers=1, num_kv_heads=1, head_dim=2)
    store = KVStore(layout, tmp_path, ram_bytes=1 << 20, disk_bytes=1 << 20)
    tokens = list(range(3 * PAGE + 1))
    for i, key in enumerate(layout.page_keys(tokens)):
        store.put(key, tuple(np.full(shape, i, dtype) for shape, dtype in layout.payload_specs))
    bm = BlockManager(num_pages=16, page_size=PAGE, store=store)
    seq = make_seq(tokens[:PAGE + 2], seq_id=0)
    index = seq.add_pending(2 * PAGE - 1)  # pages 1 and 2 end in placeholders
    bm.prefetch(seq)
    assert seq.stored_prefix.first == 0 and len(seq.stored_prefix.payloads.result(timeout=10)) == 1
    seq.place(index, tokens[index:])
    assert bm.match_prefix(seq)[1] is None  # the pages known since are read now
    seq.stored_prefix.payloads.result(timeout=10)
    assert [int(p[0].flat[0]) for p in bm.match_prefix(seq)[1]] == [0, 1, 2]
    assert seq.store_keys == layout.page_keys(tokens)
    store.close()


def test_uncache_takes_out_the_cached_pages_of_a_sequence_preempted_since_it_computed_them():
    """Overlapped, a step's logits arrive once the next step is scheduled: a sequence preempted there has freed its
    pages (still cached, evictable) by the time they are found not finite, and no later request may read them."""
    bm = BlockManager(num_pages=8, page_size=PAGE)
    seq = make_seq(list(range(9)))
    prefill(bm, seq)
    bm.free(seq)  # preempted
    bm.uncache(seq)
    assert bm.match_prefix(make_seq(list(range(9)), seq_id=1)) == ([], [])
    assert bm.counters().pages_cached == 0
    bm.grow(make_seq([0], seq_id=2), 8 * PAGE)  # every page allocatable, none evicted as if it were cached
    assert bm.num_free_pages == 0


def test_a_readmitted_sequence_saves_again_the_pages_the_store_evicted_meanwhile_and_only_those(tmp_path):
    """Preempted, a sequence computes its pages again once readmitted: those the store has evicted since it saved
    them are listed to save again (else no later request finds them there), those it still holds are not."""
    layout = KVLayout(model="m", quantization="none", dtype="float32", kv_dtype="float32", page_size=PAGE,
                      num_layers=1, num_kv_heads=1, head_dim=2)
    store = KVStore(layout, tmp_path, ram_bytes=1 << 20, disk_bytes=1 << 20)
    bm = BlockManager(num_pages=16, page_size=PAGE, store=store)
    seq = make_seq(list(range(3 * PAGE + 1)))
    prefill(bm, seq)
    for _, key in bm.saves:
        store.put(key, tuple(np.zeros(shape, dtype) for shape, dtype in layout.payload_specs))
    bm.saves.clear()
    store.flush()
    first, second, third = seq.store_keys
    store.forget([first, third])  # as the tiers' evictions leave it: the second page alone still stored
    bm.free(seq)  # preempted
    bm.reset()  # its pages left the pool meanwhile

    prefill(bm, seq)

    assert bm.saves == [(seq.page_table[0], first), (seq.page_table[2], third)]
    store.close()


def test_a_waiting_sequence_s_prefix_is_hashed_once_however_often_its_admission_is_tried(monkeypatch):
    """The scheduler looks up the head of the queue at each step while it waits for room: its pages' keys are
    made once, and serve its commits after."""
    bm = BlockManager(num_pages=16, page_size=PAGE)
    prefill(bm, make_seq(list(range(3 * PAGE + 1)), seq_id=0))
    hashed = []
    page_hash = block_manager._page_hash
    monkeypatch.setattr(block_manager, "_page_hash", lambda parent, tokens: hashed.append(tokens)
                        or page_hash(parent, tokens))
    waiting = make_seq(list(range(3 * PAGE + 1)), seq_id=1)

    for _ in range(5):
        assert len(bm.match_prefix(waiting)[0]) == 3
    prefill(bm, waiting)

    assert len(hashed) == 3


def test_pages_ending_in_placeholders_are_keyed_by_their_real_tokens_once_these_come():
    """A sequence preempted while its multi-step call runs waits with placeholders for its last tokens: its pages'
    keys, kept on it, are made only over known tokens, so its pages are cached where a prefix finds them."""
    tokens = list(range(3 * PAGE + 1))
    bm = BlockManager(num_pages=16, page_size=PAGE)
    prefill(bm, make_seq(tokens[:PAGE + 1], seq_id=0))  # the pool holds page 0
    seq = make_seq(tokens[:PAGE + 2], seq_id=1)
    index = seq.add_pending(2 * PAGE - 1)  # pages 1 and 2 end in placeholders
    assert len(bm.match_prefix(seq)[0]) == 1
    seq.place(index, tokens[index:])
    prefill(bm, seq)

    assert bm.match_prefix(make_seq(tokens, seq_id=2))[0] == seq.page_table[:3]
