"""The persistent prefix store: pages keyed by content and layout round-trip through RAM and disk, each tier evicts
its least recently used pages under its byte bound, the disk tier outlives the store, and a damaged file is never
served; the device half moves pages between a real pool and the host."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
import threading
import weakref
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sluice.batching import kv_store
from sluice.batching.config import InvalidEngineConfig
from sluice.batching.kv_store import HEADER_SIZE, KVLayout, KVStore
from sluice.batching.kv_transfer import PageCopy, load_pages
from sluice.model.config import ModelConfig
from sluice.model.llama import empty_kv_cache

LAYOUT = KVLayout(model="test-model", quantization="none", dtype="float32", kv_dtype="float32", page_size=2,
                  num_layers=1, num_kv_heads=1, head_dim=4)
FILE_BYTES = HEADER_SIZE + LAYOUT.page_nbytes
A, B, C = LAYOUT.page_keys(range(6))


def payload(layout: KVLayout, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return tuple(rng.integers(-100, 100, shape).astype(dtype) for shape, dtype in layout.payload_specs)


def assert_same(got, want) -> None:
    assert got is not None
    for x, y in zip(got, want, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


@pytest.fixture
def open_store(tmp_path):
    """open_store(layout, ram_pages, disk_pages) -> a store over tmp_path, closed after the test."""
    stores = []

    def open_(layout: KVLayout = LAYOUT, ram_pages: int = 4, disk_pages: int = 8, **kwargs) -> KVStore:
        store = KVStore(layout, tmp_path, ram_bytes=ram_pages * layout.page_nbytes,
                        disk_bytes=disk_pages * (HEADER_SIZE + layout.page_nbytes), **kwargs)
        stores.append(store)
        return store

    yield open_
    for store in stores:
        store.close()


class SlowDisk:
    """Stands in for the store writer's fsync: each waits until `release` is set (by the test, or after 20 s, the
    bound of a test that must not wait for it); `writing` is set once one does."""

    def __init__(self, monkeypatch):
        self.writing, self.release = threading.Event(), threading.Event()
        self._fsync = kv_store.os.fsync
        monkeypatch.setattr(kv_store.os, "fsync", self)
        timer = threading.Timer(20, self.release.set)
        timer.daemon = True
        timer.start()

    def __call__(self, fd: int) -> None:
        self.writing.set()
        self.release.wait()
        self._fsync(fd)


def files(store: KVStore) -> set[str]:
    return {path.name for path in store.directory.iterdir()} - {kv_store.SLOT_LOCK}


def test_page_keys_chain_over_the_whole_prefix_and_the_layout():
    keys = LAYOUT.page_keys([1, 2, 3, 4, 5])

    assert len(keys) == 2  # the trailing partial page has no key
    assert LAYOUT.page_keys([1, 2, 3, 9])[0] == keys[0] and LAYOUT.page_keys([1, 2, 3, 9])[1] != keys[1]
    assert LAYOUT.page_keys([0, 2, 3, 4])[1] != keys[1]  # a change in an earlier page changes every later key
    assert LAYOUT.page_keys([3, 4], parent=keys[0]) == keys[1:]
    assert replace(LAYOUT, quantization="int4").page_keys([1, 2]) != keys[:1]


def test_a_page_round_trips_through_ram(open_store):
    store = open_store()
    store.put(A, payload(LAYOUT, 0))

    assert_same(store.get(A), payload(LAYOUT, 0))
    assert store.get(B) is None
    counters = store.counters()
    assert (counters.ram.hits, counters.ram.misses, counters.disk.misses) == (1, 1, 1)
    assert (counters.ram.pages, counters.ram.bytes) == (1, LAYOUT.page_nbytes)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_a_page_survives_a_restart_on_disk(open_store, kv_dtype):
    layout = replace(LAYOUT, kv_dtype=kv_dtype)
    first = open_store(layout)
    first.put(A, payload(layout, 0))
    first.close()

    store = open_store(layout)

    assert store.contains(A)
    assert_same(store.get(A), payload(layout, 0))
    assert_same(store.get(A), payload(layout, 0))
    counters = store.counters()
    assert (counters.disk.hits, counters.ram.hits) == (1, 1)  # the disk hit was brought into RAM
    assert (counters.disk.pages, counters.disk.bytes) == (1, HEADER_SIZE + layout.page_nbytes)


@pytest.mark.parametrize(("ram_pages", "disk_pages", "setting"), [(0, 8, "prefix_cache_ram"),
                                                                   (4, 0, "prefix_cache_size")])
def test_a_tier_that_holds_no_page_is_refused_naming_its_setting(open_store, tmp_path, ram_pages, disk_pages,
                                                                   setting):
    """Pages reach the disk through RAM: a tier under one page would keep nothing, silently."""
    with pytest.raises(InvalidEngineConfig, match="holds no KV page") as refused:
        open_store(ram_pages=ram_pages, disk_pages=disk_pages)
    assert refused.value.setting == setting and not any(tmp_path.iterdir())


def test_ram_evicts_the_least_recently_used_page_to_disk(open_store):
    store = open_store(ram_pages=2)
    store.put(A, payload(LAYOUT, 0))
    store.put(B, payload(LAYOUT, 1))
    store.flush()
    store.get(A)
    store.put(C, payload(LAYOUT, 2))
    store.flush()

    assert store.counters().ram.evictions == 1
    assert_same(store.get(A), payload(LAYOUT, 0))
    assert store.counters().ram.hits == 2
    assert_same(store.get(B), payload(LAYOUT, 1))
    assert store.counters().disk.hits == 1


def test_disk_evicts_the_least_recently_used_file(open_store):
    store = open_store(ram_pages=1, disk_pages=2)
    for i, key in enumerate((A, B)):
        store.put(key, payload(LAYOUT, i))
        store.flush()
    store.get(A)
    store.put(C, payload(LAYOUT, 2))
    store.flush()

    assert files(store) == {f"{A}.kv", f"{C}.kv"}
    assert store.get(B) is None
    counters = store.counters()
    assert (counters.disk.pages, counters.disk.bytes, counters.disk.evictions) == (2, 2 * FILE_BYTES, 1)


def test_a_file_that_cannot_be_evicted_stays_indexed_and_the_next_least_recently_used_goes(open_store, monkeypatch):
    """Removing the least recently used file fails otherwise than for a missing file (EACCES, EIO): the file stays,
    so the index keeps it (counted against the bound, and served), and the tier evicts the next file instead."""
    store = open_store(disk_pages=2)
    for i, key in enumerate((A, B)):
        store.put(key, payload(LAYOUT, i))
        store.flush()
    unlink = kv_store.Path.unlink

    def unlink_but_a(path, missing_ok=False):
        if path.name == f"{A}.kv":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(kv_store.Path, "unlink", unlink_but_a)
    store.put(C, payload(LAYOUT, 2))
    store.flush()

    assert files(store) == {f"{A}.kv", f"{C}.kv"}
    counters = store.counters()
    assert (counters.disk.pages, counters.disk.evictions, counters.dropped_writes) == (2, 1, 0)
    store._ram.clear()  # served from its file
    assert_same(store.get(A), payload(LAYOUT, 0))


def test_a_reopened_store_orders_its_files_by_last_use_and_keeps_its_bound(open_store):
    first = open_store(disk_pages=3)
    for i, key in enumerate((A, B, C)):
        first.put(key, payload(LAYOUT, i))
    first.close()
    for key, last_used in ((A, 3), (B, 1), (C, 2)):
        os.utime(first.directory / f"{key}.kv", (last_used, last_used))

    store = open_store(disk_pages=2)

    assert files(store) == {f"{A}.kv", f"{C}.kv"}
    assert store.counters().disk.evictions == 1


def test_another_fingerprint_misses_and_leaves_the_files_alone(open_store):
    first = open_store()
    first.put(A, payload(LAYOUT, 0))
    first.close()

    other = open_store(replace(LAYOUT, model="other-weights"))

    assert not other.contains(A) and other.get(A) is None
    assert files(first) == {f"{A}.kv"}
    assert_same(open_store().get(A), payload(LAYOUT, 0))


def test_another_fingerprint_s_folder_is_removed_once_the_directory_outgrows_the_bound(open_store):
    first = open_store()
    for i in range(6):
        first.put(f"{i:064x}", payload(LAYOUT, i))
        first.flush()  # before RAM evicts it
    first.close()
    other_layout = replace(LAYOUT, model="other-weights")
    other = open_store(other_layout)  # 6 pages of the first, none of its own: within the 8-page bound
    assert files(first) == {f"{i:064x}.kv" for i in range(6)}
    for i in range(4):
        other.put(f"{i:064x}", payload(other_layout, i))
    other.close()
    again = open_store(other_layout)  # 4 + 6 pages: the first layout's folder goes
    assert not first.directory.exists()
    assert files(again) == {f"{i:064x}.kv" for i in range(4)}
    assert_same(again.get(f"{3:064x}"), payload(other_layout, 3))


def test_every_corrupted_byte_is_detected_never_served_and_the_file_removed(open_store, caplog):
    first = open_store()
    first.put(A, payload(LAYOUT, 0))
    first.close()
    path = first.directory / f"{A}.kv"
    good = path.read_bytes()
    assert len(good) == FILE_BYTES

    caplog.set_level(logging.WARNING, logger=kv_store.__name__)
    for position in range(len(good)):  # the header's every field, the checksum and the payload
        for mask in (0x01, 0xFF):
            bad = bytearray(good)
            bad[position] ^= mask
            path.write_bytes(bad)
            store = open_store()
            assert store.get(A) is None, (position, mask)
            assert not path.exists()
            assert store.counters().corrupt == 1
            store.close()
    assert len(caplog.records) == 2 * len(good)
    assert all(path.name in record.getMessage() for record in caplog.records)


def test_a_truncated_or_extended_file_is_removed_when_the_store_opens(open_store):
    first = open_store()
    first.put(A, payload(LAYOUT, 0))
    first.close()
    path = first.directory / f"{A}.kv"
    good = path.read_bytes()

    for bad in [good[:length] for length in range(len(good))] + [good + b"\0"]:
        path.write_bytes(bad)
        store = open_store()
        assert not store.contains(A) and store.get(A) is None
        assert not path.exists()
        assert store.counters().corrupt == 1
        store.close()


def test_a_file_corrupted_under_a_running_store_is_a_miss(open_store):
    store = open_store()
    store.put(A, payload(LAYOUT, 0))
    store.flush()
    store._ram.clear()  # on disk only
    path = store.directory / f"{A}.kv"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x10
    path.write_bytes(data)

    assert store.get(A) is None
    counters = store.counters()
    assert (counters.corrupt, counters.disk.misses, counters.disk.pages) == (1, 1, 0)
    assert not path.exists()


def test_a_file_removed_from_outside_is_forgotten_and_written_again(open_store):
    store = open_store(ram_pages=1)
    store.put(A, payload(LAYOUT, 0))
    store.flush()
    store.put(B, payload(LAYOUT, 1))  # both written through; A leaves RAM
    store.flush()
    (store.directory / f"{A}.kv").unlink()
    (store.directory / f"{B}.kv").unlink()

    assert store.get(A) is None and not store.contains(A)  # read: a miss, and forgotten
    assert store.counters().disk.pages == 1
    store.put(A, payload(LAYOUT, 0))  # B leaves RAM: still listed, found missing when its file is marked used
    store.flush()
    assert not store.contains(B)
    store.put(B, payload(LAYOUT, 1))  # forgotten, so written again
    store.flush()
    assert files(store) == {f"{A}.kv", f"{B}.kv"}
    assert store.counters().disk.pages == 2


def test_ram_evicting_a_page_on_disk_marks_its_file_used_off_the_calling_thread(open_store, monkeypatch):
    store = open_store(ram_pages=1)
    store.put(A, payload(LAYOUT, 0))
    store.flush()
    path = store.directory / f"{A}.kv"
    os.utime(path, (1, 1))
    utime, marked_on = os.utime, []

    def recording_utime(*args, **kwargs):
        marked_on.append(threading.current_thread())
        utime(*args, **kwargs)

    monkeypatch.setattr(kv_store.os, "utime", recording_utime)
    store.put(B, payload(LAYOUT, 1))  # RAM evicts A, already on disk: a filesystem call the engine must not make
    store.flush()

    assert marked_on and threading.current_thread() not in marked_on
    assert path.stat().st_mtime > 1


def test_marks_of_files_used_waiting_for_the_writer_never_drop_a_write(open_store, monkeypatch):
    a, b, c, d, e, f = LAYOUT.page_keys(range(100, 112))
    store = open_store(ram_pages=2, queue_pages=1)
    for key, i in ((a, 0), (b, 1), (c, 2), (d, 3), (e, 4), (a, 0), (b, 1)):
        store.put(key, payload(LAYOUT, i))
        store.flush()
    # a to e on disk, a and b in RAM too
    marking, release, utime = threading.Event(), threading.Event(), os.utime

    def slow_utime(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():  # the writer's marks (a get marks its own)
            marking.set()
            release.wait()
        utime(*args, **kwargs)

    monkeypatch.setattr(kv_store.os, "utime", slow_utime)
    store.get(c)  # a disk hit: RAM evicts a, on disk, whose mark the writer takes and waits in
    assert marking.wait(10)
    store.get(d)  # RAM evicts b: a mark waiting, as many as the queue takes
    store.put(f, payload(LAYOUT, 5))  # a write, which must not wait behind marks for a place
    release.set()
    store.flush()

    assert f"{f}.kv" in files(store) and store.counters().dropped_writes == 0


def test_a_leftover_temporary_file_is_ignored_and_removed(open_store):
    first = open_store()
    leftover = first.directory / f"{A}x1y2.tmp"
    leftover.write_bytes(b"SLUICEKV half a page")
    first.close()

    store = open_store()

    assert not store.contains(A)
    assert files(store) == set()


def test_a_second_store_on_the_directory_takes_a_slot_of_its_own_and_a_reopened_one_takes_the_first_back(
        open_store):
    first = open_store()
    first.put(A, payload(LAYOUT, 0))
    first.flush()
    in_flight = first.directory / f"{B}x1y2.tmp"  # a write of the first store's, not yet renamed
    in_flight.write_bytes(b"SLUICEKV half a page")

    second = open_store()  # a replica beside the first, on the same directory
    second.put(B, payload(LAYOUT, 1))
    second.flush()

    assert second.directory.name == f"{LAYOUT.fingerprint.hex()}-1" and not second.contains(A)
    assert files(first) == {f"{A}.kv", in_flight.name} and files(second) == {f"{B}.kv"}
    first.close()
    assert_same(open_store().get(A), payload(LAYOUT, 0))  # the first slot, free again, with its pages


def test_a_live_store_s_slot_is_never_trimmed_and_a_gone_one_s_is(open_store):
    live = open_store()
    for i in range(6):
        live.put(f"{i:064x}", payload(LAYOUT, i))
        live.flush()  # before RAM evicts it
    gone = open_store()
    gone.put(A, payload(LAYOUT, 9))
    gone.close()
    live.flush()
    other_layout = replace(LAYOUT, model="other-weights")
    other = open_store(other_layout, disk_pages=2)  # 7 pages besides its own, over its 2-page bound

    assert not gone.directory.exists()
    assert files(live) == {f"{i:064x}.kv" for i in range(6)}
    live.put(B, payload(LAYOUT, 7))
    live.flush()
    assert f"{B}.kv" in files(live) and live.counters().dropped_writes == 0
    other.close()



@pytest.mark.parametrize("when", ["before its lock is opened", "after it is locked", "while it is measured"])
def test_a_store_opens_while_another_stores_trim_removes_a_slot(open_store, monkeypatch, when):
    """Replicas starting together on one directory: another store's trim, holding an idle slot's lock, removes it
    (rmtree) at any point of this store's claiming its own slot or measuring that one."""
    other = replace(LAYOUT, model="other-weights")
    gone = open_store(other)
    gone.put(A, payload(other, 0))
    gone.put(B, payload(other, 1))
    gone.flush()
    gone.close()
    lock_slot, usage = kv_store._lock_slot, kv_store._usage
    removed = []

    def remove_once(folder) -> None:
        if not removed:
            removed.append(folder)
            shutil.rmtree(folder)

    if when == "before its lock is opened":
        monkeypatch.setattr(kv_store, "_lock_slot", lambda folder: remove_once(folder) or lock_slot(folder))
    elif when == "after it is locked":
        monkeypatch.setattr(kv_store, "_lock_slot", lambda folder: (lock_slot(folder), remove_once(folder))[0])
    else:  # the other store holds the idle slot's lock meanwhile
        monkeypatch.setattr(kv_store, "_lock_slot", lambda folder: None if folder == gone.directory
                            else lock_slot(folder))
        monkeypatch.setattr(kv_store, "_usage", lambda folder: (folder == gone.directory and remove_once(folder),
                                                                usage(folder))[1])
    store = open_store(disk_pages=1)  # over its bound: it trims the other slots
    store.put(B, payload(LAYOUT, 1))
    store.flush()
    assert removed and store.directory.is_dir() and store.counters().dropped_writes == 0

def test_a_store_claiming_a_slot_another_stores_trim_is_removing_gets_a_folder_of_its_own(open_store, monkeypatch):
    """The trim removes the slot file by file: a store claiming it midway (its lock file already gone) must not
    take that folder, whose removal would then take its new lock file too (and a third store the slot again)."""
    other = replace(LAYOUT, model="other-weights")
    gone = open_store(other)
    gone.put(A, payload(other, 0))
    gone.put(B, payload(other, 1))
    gone.flush()
    gone.close()
    claimed = []
    rmtree = shutil.rmtree

    def claim_midway(path, **kwargs) -> None:
        (path / kv_store.SLOT_LOCK).unlink(missing_ok=True)  # as far as the removal has got
        claimed.append(kv_store._claim_slot(gone.directory.parent, other.fingerprint.hex()))
        rmtree(path, **kwargs)

    monkeypatch.setattr(kv_store.shutil, "rmtree", claim_midway)
    open_store(disk_pages=1)  # over its bound: it trims the idle slot
    (folder, fd), = claimed
    assert folder == gone.directory and kv_store._holds(fd, folder)
    os.close(fd)


def test_a_page_forgotten_while_it_is_read_is_neither_served_nor_kept(open_store, monkeypatch):
    """A prefetch reading a page when the engine forgets it (its K/V is suspect) must not bring it back."""
    store = open_store()
    store.put(A, payload(LAYOUT, 1))
    store.flush()
    store._ram.clear()  # on disk only
    read = KVStore._read
    monkeypatch.setattr(KVStore, "_read", lambda self, key: (read(self, key), self.forget([key]))[0])
    assert store.get(A) is None and not store.contains(A)
    monkeypatch.setattr(KVStore, "_read", read)
    store.put(A, payload(LAYOUT, 2))  # put anew: served again
    assert_same(store.get(A), payload(LAYOUT, 2))


def test_a_page_forgotten_and_put_anew_while_its_old_file_is_read_serves_the_new_payload(open_store, monkeypatch):
    """A prefetch reading a page's file when the engine forgets the page and a recomputation puts it anew: the
    suspect payload it read is neither served nor kept in RAM over the new one."""
    store = open_store()
    store.put(A, payload(LAYOUT, 1))
    store.flush()
    store._ram.clear()  # on disk only
    read = KVStore._read

    def read_then_recompute(self: KVStore, key: str):
        old = read(self, key)
        self.forget([key])
        self.put(key, payload(LAYOUT, 2))
        return old

    monkeypatch.setattr(KVStore, "_read", read_then_recompute)
    assert store.get(A) is None
    monkeypatch.setattr(KVStore, "_read", read)
    assert_same(store.get(A), payload(LAYOUT, 2))


def references(keys: list[str]) -> list[int]:
    """How many references each of `keys` has: one more for each the store keeps."""
    return [sys.getrefcount(key) for key in keys]


def test_the_store_keeps_nothing_of_the_pages_it_forgets(open_store):
    """The engine forgets a failed request's pages (`Engine._forget_pages`) as long as it serves: a store that kept
    a mark of each page it forgot grew without bound."""
    store = open_store()
    keys = LAYOUT.page_keys(range(200))
    held = references(keys)

    store.forget(keys)
    store.flush()

    assert references(keys) == held


def test_pages_forgotten_while_their_writes_wait_are_not_written_and_the_store_keeps_nothing_of_them(open_store,
                                                                                                       monkeypatch):
    """Each page is forgotten while its write waits behind a stuck one: none is written, and what the store kept to
    discard them goes once their writes are done."""
    disk = SlowDisk(monkeypatch)
    store = open_store()
    keys = LAYOUT.page_keys(range(2, 202))  # A's tokens are 0, 1
    held = references(keys)

    store.put(A, payload(LAYOUT, 0))
    disk.writing.wait()
    for key in keys:
        store.put(key, payload(LAYOUT, 1))
        store.forget([key])
    del key  # the loop's own reference
    disk.release.set()
    store.flush()

    assert files(store) == {f"{A}.kv"} and store.counters().dropped_writes == 0
    assert references(keys) == held


def test_a_failed_write_leaves_no_file_and_keeps_the_page_in_ram(open_store, monkeypatch):
    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kv_store.os, "fsync", failing_fsync)
    store = open_store()
    store.put(A, payload(LAYOUT, 0))
    store.flush()

    assert files(store) == set()
    assert store.counters().dropped_writes == 1
    assert_same(store.get(A), payload(LAYOUT, 0))


def read_only(*args, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system")


def test_a_filesystem_turned_read_only_leaves_puts_and_disk_hits_working(open_store, monkeypatch):
    """Remounted read-only (after an I/O error): marking a file used fails as writing one does, and neither may
    raise into the engine's step, which would fail every request in flight."""
    store = open_store(ram_pages=1)
    store.put(A, payload(LAYOUT, 0))
    store.flush()
    monkeypatch.setattr(kv_store.os, "utime", read_only)
    monkeypatch.setattr(kv_store.tempfile, "mkstemp", read_only)

    store.put(B, payload(LAYOUT, 1))  # RAM evicts A, already on disk: its use is marked there
    store.flush()

    assert_same(store.get(A), payload(LAYOUT, 0))  # a disk hit, marked used too
    assert store.counters().disk.hits == 1 and store.counters().dropped_writes >= 1  # B's write


def test_a_corrupt_file_that_cannot_be_removed_is_forgotten_and_never_served(open_store, monkeypatch):
    first = open_store()
    first.put(A, payload(LAYOUT, 0))
    first.close()
    path = first.directory / f"{A}.kv"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    store = open_store()
    monkeypatch.setattr(kv_store.Path, "unlink", read_only)

    assert store.get(A) is None
    assert not store.contains(A) and store.counters().corrupt == 1


def test_a_full_write_queue_drops_the_write_and_counts_it(open_store, monkeypatch):
    disk = SlowDisk(monkeypatch)
    store = open_store(queue_pages=1)
    store.put(A, payload(LAYOUT, 0))
    disk.writing.wait()
    store.put(B, payload(LAYOUT, 1))
    store.put(C, payload(LAYOUT, 2))
    disk.release.set()
    store.flush()

    assert files(store) == {f"{A}.kv", f"{B}.kv"}
    assert store.counters().dropped_writes == 1
    assert_same(store.get(C), payload(LAYOUT, 2))


def test_pages_waiting_for_the_writer_are_held_within_the_ram_bound(open_store, monkeypatch):
    """The writer stuck in a page's fsync while pages keep coming: the queued writes held every page's payload past
    the RAM bound (up to twice the queue's pages, marks included). A page RAM evicts while its write still waits is
    not written now (counted); the page being written lands, and those RAM holds are written after it."""
    disk = SlowDisk(monkeypatch)
    store = open_store(ram_pages=2)
    keys = LAYOUT.page_keys(range(2 * 10))
    payloads = [payload(LAYOUT, i) for i in range(10)]
    alive = [weakref.ref(page[0]) for page in payloads]
    store.put(keys[0], payloads[0])
    disk.writing.wait()  # the first page's write is in progress
    for key, page in zip(keys[1:], payloads[1:], strict=True):
        store.put(key, page)
    del payloads, page

    assert sum(ref() is not None for ref in alive) == 3  # RAM's two pages and the one being written
    disk.release.set()
    store.flush()
    assert files(store) == {f"{key}.kv" for key in (keys[0], keys[8], keys[9])}
    assert store.counters().dropped_writes == 7


def test_put_rejects_a_payload_of_another_layout(open_store):
    with pytest.raises(ValueError, match="does not match"):
        open_store().put(A, payload(replace(LAYOUT, kv_dtype="int8"), 0))


@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.int8])
def test_pool_pages_round_trip_through_the_store_into_other_pages(open_store, kv_dtype):
    config, num_pages, page_size = ModelConfig.tiny(), 8, 4
    rng = np.random.default_rng(0)
    pool = jax.tree.map(lambda x: jnp.asarray(rng.integers(-100, 100, x.shape), x.dtype),
                        empty_kv_cache(config, num_pages, page_size, kv_dtype))
    before = jax.device_get(pool)
    layout = KVLayout.of(config, model="tiny", quantization="none", dtype=jnp.float32, kv_dtype=kv_dtype,
                         page_size=page_size)
    keys = layout.page_keys(range(3 * page_size))
    first = open_store(layout)
    for key, page in zip(keys, PageCopy(pool, [5, 2, 7]).payloads(), strict=True):
        first.put(key, page)
    first.close()

    target = empty_kv_cache(config, num_pages, page_size, kv_dtype)
    store = open_store(layout)
    loaded = load_pages(target, [1, 3, 0], [store.get(key) for key in keys])

    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(target))  # donated: written in place
    for got, want in zip(jax.tree.leaves(jax.device_get(loaded)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(got[:, [1, 3, 0]], want[:, [5, 2, 7]])
        assert not got[:, [2, 4, 5, 6, 7]].any()  # the padding wrote nothing
