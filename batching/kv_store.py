"""Full KV pages kept past the device pool, keyed by content: a host-RAM tier in front of a directory on disk.

Keys: a page's key chains blake2b over (the previous page's key, this page's token ids), the first page's chained
from the fingerprint of the `KVLayout` (model, weights, dtypes, page layout), so equal prefixes under one model
map to equal keys and another model never reads them.

Payload: one page's `PagePayload`, the leaves of the pool's (k, v) tree (`model.llama.empty_kv_cache`) with the
page axis taken out, in `jax.tree.leaves` order: k, v each `[num_layers, num_kv_heads, page_size, head_dim]` of
the KV dtype, or for an int8 pool k.values, k.scales, v.values, v.scales, the scales
`[num_layers, num_kv_heads, page_size]` float32 (`KVLayout.payload_specs`).

Tiers: `put` keeps a page in RAM and writes it through to disk, so it survives a SIGKILL once written. RAM is an
LRU bounded in bytes, which bounds the payloads waiting for the writer too (they are RAM's own): a page it evicts
becomes the disk tier's most recent, or, its write still waiting, is not written (counted); only the page being
written may be held past the bound. The disk tier, `directory/<fingerprint>/<key>.kv`, is an LRU bounded in bytes,
ordered by a file's mtime (refreshed on use) and rebuilt from the directory when a store opens.

Slots: a store holds its folder alone, by a flock on the folder's `lock` file (the kernel lets go of it when the
process dies). A second process of the same layout on the same directory (a replica beside another) takes the
next free slot, `<fingerprint>-1`, `-2`, ..., so a restarted replica takes a slot back with its pages. Other
slots (another model's pages, a replica's that is gone) are never read; those no live store holds are removed,
least recently used first, when a store opens and the whole directory holds more than the disk bound.

File: a header, then the payload's arrays' bytes in order. Header (little-endian): magic 8s, format version u32,
fingerprint 32s, key 32s, payload length u64, then the checksum 32s (blake2b of the payload). A write goes to a
temporary file beside it, is fsynced, then renamed over the name (`os.replace`), so a name only ever holds a
whole file; a file whose size, header or checksum is wrong is removed, logged once and counted, never served.

Threads: the engine thread owns the store and calls every method. Disk writes and the marks of a file's use run in
order on one writer thread (its queue bounded: `_queue_write`, `_mark`), and `prefetch` reads pages on one reader
thread, so the engine's steps never wait on the disk; `_lock` guards what the threads share (both tiers' indexes and
counters).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import struct
import tempfile
import threading
import uuid
import weakref
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import cached_property
from math import prod
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sluice.batching.config import InvalidEngineConfig
from sluice.batching.sampling_params import CacheNamespace
from sluice.model.config import ModelConfig
from sluice.pallas_kernels.kv_cache import empty_pages

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"SLUICEKV"
DIGEST_SIZE = 32
_FIELDS = struct.Struct(f"<8sI{DIGEST_SIZE}s{DIGEST_SIZE}sQ")  # magic, version, fingerprint, key, payload length
HEADER_SIZE = _FIELDS.size + DIGEST_SIZE  # the fields, then the payload's checksum
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
SLOT_LOCK = "lock"
MAX_SLOTS = 64
_SLOT_NAME = re.compile(f"[0-9a-f]{{{2 * DIGEST_SIZE}}}(-[0-9]+)?")
_TRASH = ".trash-"  # a trimmed slot's folder while it is removed (a name no slot has)

PageKey = str
"""A page's key: 64 hex digits (`KVLayout.page_keys`), also its file's name."""
PagePayload = tuple[np.ndarray, ...]
"""One page's K/V arrays, as the module docstring lays them out."""


@dataclass(frozen=True)
class KVLayout:
    """Everything a page's K/V depends on besides its tokens: two stores share pages only if these are equal.

    model: the weights' identity as loaded (a name plus a digest of the file, or its path, size and mtime)
    quantization: how the weights run (`--quantization`), which changes the K/V they compute
    dtype, kv_dtype: the activation and pool dtypes' names ("bfloat16", "int8", ...)
    """

    model: str
    quantization: str
    dtype: str
    kv_dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: ModelConfig, *, model: str, quantization: str, dtype, kv_dtype, page_size: int) -> KVLayout:
        """The layout of an engine's pool (`ModelRunner.kv_dtype`, `EngineConfig.page_size`)."""
        return cls(model, quantization, jnp.dtype(dtype).name, jnp.dtype(kv_dtype).name, page_size,
                   config.num_layers, config.num_kv_heads, config.head_dim)

    @cached_property
    def fingerprint(self) -> bytes:
        """blake2b of the fields and the file format's version: [32] bytes."""
        fields = json.dumps({**asdict(self), "format": FORMAT_VERSION}, sort_keys=True)
        return hashlib.blake2b(fields.encode(), digest_size=DIGEST_SIZE).digest()

    @cached_property
    def payload_specs(self) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
        """(shape, dtype) of each array of a page's payload: the pool's own pages (`empty_pages`) with one page."""
        shape = (self.num_layers, self.num_kv_heads, self.page_size, self.head_dim)
        leaves = jax.tree.leaves(jax.eval_shape(lambda: (empty_pages(shape, self.kv_dtype),) * 2))
        return tuple((leaf.shape, np.dtype(leaf.dtype)) for leaf in leaves)

    @cached_property
    def page_nbytes(self) -> int:
        return sum(prod(shape) * dtype.itemsize for shape, dtype in self.payload_specs)

    def page_keys(self, token_ids: Sequence[int], parent: PageKey | None = None,
                  namespace: CacheNamespace | None = None) -> list[PageKey]:
        """Keys of the full pages of `token_ids` (a trailing partial page has none). `parent`: the key of the page
        before `token_ids[0]`, so a sequence's keys can be extended a page at a time; None: `token_ids` start the
        sequence (its first page chains from the fingerprint, salted with the request's `cache_namespace` if any: its
        salt alone, or the salt and its LoRA adapter's fingerprint, each kind personalized apart)."""
        if parent is not None:
            digest = bytes.fromhex(parent)
        elif namespace is not None:  # keyed and personalized: no salt hashes to a page's key, whatever its bytes
            text, person = ((namespace.salt, b"cache_salt") if namespace.adapter is None
                            else (json.dumps(list(namespace)), b"lora"))
            digest = hashlib.blake2b(text.encode(), digest_size=DIGEST_SIZE, key=self.fingerprint,
                                     person=person).digest()
        else:
            digest = self.fingerprint
        tokens = np.asarray(token_ids, "<i4")
        keys = []
        for start in range(0, len(tokens) - self.page_size + 1, self.page_size):
            digest = hashlib.blake2b(digest + tokens[start:start + self.page_size].tobytes(),
                                     digest_size=DIGEST_SIZE).digest()
            keys.append(digest.hex())
        return keys


class KVStoreBusy(OSError):
    """Every slot of the layout in the directory is held by a live store."""


def _lock_slot(folder: Path) -> int | None:
    """An open descriptor holding `folder`'s lock, or None if a live store holds it."""
    fd = os.open(folder / SLOT_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _holds(fd: int, folder: Path) -> bool:
    """Whether `fd` is the lock file `folder` holds now (not one removed with its folder meanwhile)."""
    try:
        now = os.stat(folder / SLOT_LOCK)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _claim_slot(root: Path, fingerprint: str) -> tuple[Path, int]:
    """The first free slot of `fingerprint` under `root` (made if new) and the descriptor holding its lock. A slot
    that another store's trim removes meanwhile (it holds the lock while it does) is made again."""
    i = 0
    while i < MAX_SLOTS:
        folder = root / (fingerprint if i == 0 else f"{fingerprint}-{i}")
        folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = _lock_slot(folder)
        except FileNotFoundError:  # removed since the mkdir
            continue
        if fd is None:
            i += 1
        elif _holds(fd, folder):
            return folder, fd
        else:  # the lock of a folder removed since it was opened
            os.close(fd)
    raise KVStoreBusy(f"{root}: the {MAX_SLOTS} slots of this model's KV pages are all held by live processes")


def _remove_slot(folder: Path) -> None:
    """Removes a slot whose lock the caller holds: renamed away first, in one step, so that a store claiming the
    slot meanwhile makes a new folder of that name rather than take this one while it is removed file by file (its
    new lock file then removed with it, and the slot claimed twice)."""
    trash = folder.with_name(f"{_TRASH}{uuid.uuid4().hex}")
    try:
        folder.rename(trash)
    except OSError:  # gone meanwhile
        return
    shutil.rmtree(trash, ignore_errors=True)


def _usage(folder: Path) -> tuple[int, int]:
    """(the latest mtime in ns, the bytes) of the files in `folder`; a live store's files may go meanwhile, and a
    slot another store's trim holds may go whole."""
    last_used = size = 0
    try:
        paths = list(folder.iterdir())
    except FileNotFoundError:
        return last_used, size
    for path in paths:
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue
        last_used, size = max(last_used, stat.st_mtime_ns), size + stat.st_size
    return last_used, size


@dataclass(eq=False)
class _Generation:
    """A page's content between two `forget`s of it: a read or a queued write holding one the page no longer has is
    discarded. `unwritten`: the payload a queued write of it waits to write, the RAM tier's (None once the writer
    takes it, or it is dropped: RAM evicted the page first, or it was forgotten)."""

    unwritten: PagePayload | None = None


class _Write(NamedTuple):
    """A page for the writer to write: its key's `generation.unwritten` (not written if forgotten since)."""

    key: PageKey
    generation: _Generation


class _Mark(NamedTuple):
    """A page on disk whose file the writer marks used (`_touch`)."""

    key: PageKey


class StoredPrefix(NamedTuple):
    """A waiting sequence's pages being read from the store (`KVStore.prefetch`): from its page `first` on, before
    page `end`, as far as the store holds them."""

    first: int
    end: int
    payloads: Future[list[PagePayload]]


@dataclass(frozen=True)
class TierCounters:
    hits: int
    misses: int
    pages: int  # held now
    bytes: int  # held now: payloads in RAM, whole files on disk
    evictions: int


@dataclass(frozen=True)
class KVStoreCounters:
    ram: TierCounters
    disk: TierCounters
    corrupt: int  # files found torn, truncated or corrupt (each removed)
    dropped_writes: int  # pages not written to disk: the writer's queue was full, RAM evicted one first, a write failed


@dataclass
class _Tally:
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    def counters(self, pages: int, page_bytes: int) -> TierCounters:
        return TierCounters(self.hits, self.misses, pages, pages * page_bytes, self.evictions)


class KVStore:
    """The two tiers of `layout`'s pages under `directory`: at most `ram_bytes` of payloads in RAM (those waiting to
    be written among them) and `disk_bytes` of files on disk; `queue_pages` writes may wait for the writer thread."""

    def __init__(self, layout: KVLayout, directory: Path | str, *, ram_bytes: int, disk_bytes: int,
                 queue_pages: int = 256):
        """InvalidEngineConfig where a tier holds no page: pages reach the disk through RAM, so either keeps none."""
        for setting, bound, page in (("prefix_cache_ram", ram_bytes, layout.page_nbytes),
                                     ("prefix_cache_size", disk_bytes, HEADER_SIZE + layout.page_nbytes)):
            if bound < page:
                raise InvalidEngineConfig(setting, f"of {bound:,} bytes holds no KV page of {page:,} bytes")
        self.layout = layout
        self.directory, lock = _claim_slot(Path(directory), layout.fingerprint.hex())
        self.ram_bytes = ram_bytes
        self.disk_bytes = disk_bytes
        self.file_bytes = HEADER_SIZE + layout.page_nbytes
        self._ram: OrderedDict[PageKey, PagePayload] = OrderedDict()  # least recently used first
        self._disk: OrderedDict[PageKey, None] = OrderedDict()  # the files; least recently used first
        self._lock = threading.RLock()
        self._ram_tally, self._disk_tally = _Tally(), _Tally()
        self._corrupt = 0
        self._dropped = 0
        # Weakly: a page's generation stays while a read or a queued write holds it, not for each page ever forgotten.
        self._generations: weakref.WeakValueDictionary[PageKey, _Generation] = weakref.WeakValueDictionary()
        self._queue_pages = queue_pages
        self._num_queued: Counter[bool] = Counter()  # writes (False) and marks (True) waiting for the writer
        self._touch_failed = False  # warned once: `_touch` runs at every use of a page on disk
        try:
            self._open_directory()
        except BaseException:
            os.close(lock)
            raise
        self._queue: queue.Queue[_Write | _Mark | None] = queue.Queue()  # bounded by `_num_queued`'s
        # The writer holds the store weakly, so that a store dropped without `close` (an engine a test or a fuzz
        # drops) is freed, and with it its RAM tier, its threads and its slot (a later store on the directory
        # would take the next slot, never reading its pages, and the 65th none).
        self._writer = threading.Thread(target=_write_loop, args=(weakref.ref(self), self._queue),
                                        name="kv-store-writer", daemon=True)
        self._writer.start()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-store-reader")
        self._release = weakref.finalize(self, _let_go, self._queue, lock)
        self._release.atexit = False  # at exit the kernel frees the slot, after the last write

    def put(self, key: PageKey, payload: PagePayload) -> None:
        """Keeps one page (the store holds the arrays from now on: leave them unchanged), in RAM and written
        through to disk. A payload that does not match the layout's `payload_specs` is a ValueError."""
        payload = tuple(np.ascontiguousarray(a) for a in payload)
        got = tuple((a.shape, a.dtype) for a in payload)
        if got != self.layout.payload_specs:
            raise ValueError(f"page payload {got} does not match the layout's {self.layout.payload_specs}")
        with self._lock:
            if key in self._ram:
                self._ram.move_to_end(key)
                return
            if key in self._disk:
                self._mark(key)
            else:
                self._queue_write(key, payload)
            self._keep_in_ram(key, payload)

    def get(self, key: PageKey) -> PagePayload | None:
        """The page's payload (the store's own arrays: leave them unchanged), or None; a disk hit is brought into
        RAM. Reads the disk on the calling thread: the engine's is `prefetch`'s reader."""
        with self._lock:
            payload = self._ram.get(key)
            if payload is not None:
                self._ram.move_to_end(key)
                self._ram_tally.hits += 1
                return payload
            self._ram_tally.misses += 1
            generation = self._generations.setdefault(key, _Generation())
        payload = self._read(key)
        touched = payload is not None and self._touch(key)
        with self._lock:
            # A page forgotten while it was read is a miss: its file's payload is suspect, even once put anew.
            if payload is None or self._generations.get(key) is not generation:
                self._disk_tally.misses += 1
                return None
            self._disk_tally.hits += 1
            if touched and key in self._disk:
                self._disk.move_to_end(key)
            self._keep_in_ram(key, payload)
        return payload

    def prefetch(self, keys: list[PageKey]) -> Future[list[PagePayload]]:
        """The payloads of `keys` in order, as far as the store holds them, read on the reader thread. A page
        that cannot be read (an I/O error) ends them, as a miss does."""
        return self._reader.submit(self._get_run, keys)

    def _get_run(self, keys: list[PageKey]) -> list[PagePayload]:
        payloads = []
        try:
            for key in keys:
                if (payload := self.get(key)) is None:
                    break
                payloads.append(payload)
        except OSError as e:
            logger.warning("KV store: could not read a page: %s", e)
        return payloads

    def contains(self, key: PageKey) -> bool:
        with self._lock:
            return key in self._ram or key in self._disk

    def forget(self, keys: list[PageKey]) -> None:
        """Removes pages (their K/V is suspect) from RAM and from disk now, without waiting for the writes queued
        before (those of these pages are not made, and a file one of them is being written never lands: `_land`). A
        process killed once this returns leaves no file of them for the next store to serve."""
        with self._lock:
            written = [key for key in keys if key in self._disk]
            for key in keys:
                if (generation := self._generations.pop(key, None)) is not None:
                    generation.unwritten = None
                self._ram.pop(key, None)
                self._disk.pop(key, None)
        for key in written:
            _remove_file(self._path(key))  # one left behind is no longer served here; a next store would index it

    def counters(self) -> KVStoreCounters:
        with self._lock:
            return KVStoreCounters(self._ram_tally.counters(len(self._ram), self.layout.page_nbytes),
                                   self._disk_tally.counters(len(self._disk), self.file_bytes), self._corrupt,
                                   self._dropped)

    def flush(self) -> None:
        """Returns once every page put so far is on disk (or dropped), and those forgotten so far are not."""
        self._queue.join()

    def close(self) -> None:
        """Finishes the reads asked for, flushes, stops the threads, then lets go of the slot."""
        self._reader.shutdown()
        self._queue.put(None)
        self._writer.join()
        self._release()  # once: closing again, or the store's collection, does nothing more

    def _path(self, key: PageKey) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def _open_directory(self) -> None:
        """Indexes the files a previous store left, oldest use first; removes temporaries (writes a dead process
        left unfinished) and files of the wrong size."""
        found = []
        for path in self.directory.iterdir():
            if path.suffix == TMP_SUFFIX:
                path.unlink(missing_ok=True)
            elif path.suffix == SUFFIX:
                stat = path.stat()
                if stat.st_size != self.file_bytes:
                    self._discard(path, f"{stat.st_size} bytes, not {self.file_bytes}")
                else:
                    found.append((stat.st_mtime_ns, path.stem))
        with self._lock:
            for _, key in sorted(found):
                self._disk[key] = None
            self._evict_disk()
            self._trim_other_slots(len(self._disk) * self.file_bytes)

    def _trim_other_slots(self, own_bytes: int) -> None:
        """Removes the slots no live store holds, least recently used first, while the whole directory (live
        stores' slots too) holds more than the disk bound; each is locked while it is measured and removed."""
        total, idle = own_bytes, []
        try:
            for folder in self.directory.parent.iterdir():
                if folder.name.startswith(_TRASH):  # a trim's that a crash left behind
                    shutil.rmtree(folder, ignore_errors=True)
                if folder == self.directory or not _SLOT_NAME.fullmatch(folder.name) or not folder.is_dir():
                    continue
                try:
                    fd = _lock_slot(folder)
                except FileNotFoundError:  # removed meanwhile, by another store opening
                    continue
                last_used, size = _usage(folder)
                total += size
                if fd is not None:
                    idle.append((last_used, size, folder, fd))
            for _, size, folder, _ in sorted(idle, key=lambda slot: slot[0]):
                if total <= self.disk_bytes:
                    break
                logger.info("KV store: removed %s (pages of another model or of a process gone, %d bytes) to keep "
                            "within %d bytes", folder, size, self.disk_bytes)
                _remove_slot(folder)
                total -= size
        finally:
            for *_, fd in idle:
                os.close(fd)

    def _keep_in_ram(self, key: PageKey, payload: PagePayload) -> None:
        """Keeps a page in RAM, evicting the least recently used past the bound: one on disk has its file marked used,
        and one whose write still waits is not written (counted), as its payload, held for the writer, is memory the
        bound caps. The caller holds `_lock`."""
        self._ram[key] = payload
        while len(self._ram) * self.layout.page_nbytes > self.ram_bytes:
            old, _ = self._ram.popitem(last=False)
            self._ram_tally.evictions += 1
            if old in self._disk:
                self._mark(old)
            elif (generation := self._generations.get(old)) is not None and generation.unwritten is not None:
                generation.unwritten = None
                self._dropped += 1

    def _queue_write(self, key: PageKey, payload: PagePayload) -> None:
        """Queues the write of a page RAM keeps; a full queue drops it (counted). The caller holds `_lock`."""
        if self._num_queued[False] < self._queue_pages:
            self._num_queued[False] += 1
            generation = self._generations.setdefault(key, _Generation())
            generation.unwritten = payload
            self._queue.put(_Write(key, generation))
        else:
            self._dropped += 1

    def _mark(self, key: PageKey) -> None:
        """Makes `key` the disk tier's most recent page and queues the mark of its file's use; a full queue drops it
        (only the next store's order is off). Marks count apart from writes, so that no burst of them drops a write.
        The caller holds `_lock`."""
        self._disk.move_to_end(key)
        if self._num_queued[True] < self._queue_pages:
            self._num_queued[True] += 1
            self._queue.put(_Mark(key))

    def _touch(self, key: PageKey) -> bool:
        """Marks `key`'s file used now (its mtime, for the next store's order); whether it is still there. Not on the
        engine thread: a filesystem call."""
        try:
            os.utime(self._path(key))
        except FileNotFoundError:  # removed from outside the store: forgotten, so it is written again
            with self._lock:
                self._disk.pop(key, None)
            return False
        except OSError as e:  # a filesystem turned read-only: the file stands, only the next store's order is off
            if not self._touch_failed:
                logger.warning("KV store: could not mark page files used (%s); their order is kept in memory", e)
                self._touch_failed = True
        return True

    def _read(self, key: PageKey) -> PagePayload | None:
        with self._lock:
            if key not in self._disk:
                return None
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # evicted meanwhile, or removed from outside the store
            with self._lock:
                self._disk.pop(key, None)
            return None
        problem = self._problem(key, data)
        if problem is not None:
            self._discard(path, problem)
            return None
        arrays, offset = [], HEADER_SIZE
        for shape, dtype in self.layout.payload_specs:
            arrays.append(np.frombuffer(data, dtype, prod(shape), offset).reshape(shape))
            offset += prod(shape) * dtype.itemsize
        return tuple(arrays)

    def _fields(self, key: PageKey) -> bytes:
        """The header a file of `key` must begin with, up to its checksum."""
        return _FIELDS.pack(MAGIC, FORMAT_VERSION, self.layout.fingerprint, bytes.fromhex(key),
                            self.layout.page_nbytes)

    def _problem(self, key: PageKey, data: bytes) -> str | None:
        """What is wrong with the file `data` read for `key`, or None."""
        if len(data) != self.file_bytes:
            return f"{len(data)} bytes, not {self.file_bytes}"
        if data[:_FIELDS.size] != self._fields(key):
            return "header does not match its name and layout"
        checksum = hashlib.blake2b(memoryview(data)[HEADER_SIZE:], digest_size=DIGEST_SIZE).digest()
        if checksum != data[_FIELDS.size:HEADER_SIZE]:
            return "checksum mismatch"
        return None

    def _discard(self, path: Path, problem: str) -> None:
        logger.warning("KV store: removed corrupt page file %s (%s)", path, problem)
        _remove_file(path)  # forgotten all the same: a file left behind is checked again by the next store
        with self._lock:
            self._disk.pop(path.stem, None)
            self._corrupt += 1

    def _evict_disk(self) -> None:
        """Removes the least recently used files until the tier fits its bound. A file that cannot be removed (EACCES,
        EIO) stays, so it stays indexed, as the most recent (counted against the bound, tried again last), and the
        next goes instead. The caller holds `_lock`."""
        for _ in range(len(self._disk)):  # each file tried once
            if len(self._disk) * self.file_bytes <= self.disk_bytes:
                return
            key = next(iter(self._disk))
            if not _remove_file(self._path(key)):
                self._disk.move_to_end(key)
                continue
            del self._disk[key]
            self._disk_tally.evictions += 1

    def _mark_used(self, key: PageKey) -> None:
        """The writer's part of `_mark`: marks the page's file used, if it is still on disk."""
        with self._lock:
            self._num_queued[True] -= 1
            on_disk = key in self._disk
        if on_disk:
            self._touch(key)

    def _write_page(self, job: _Write) -> None:
        """The writer's part of `_queue_write`: takes the payload, unless it was dropped or forgotten meanwhile."""
        with self._lock:
            self._num_queued[False] -= 1
            payload, job.generation.unwritten = job.generation.unwritten, None
        if payload is None:
            return
        try:
            self._write(job.key, payload, job.generation)
        except OSError as e:  # disk full, directory gone: the page stays in RAM only
            logger.warning("KV store: could not write page %s: %s", job.key, e)
            with self._lock:
                self._dropped += 1

    def _write(self, key: PageKey, payload: PagePayload, generation: _Generation) -> None:
        """Writes one page's file atomically (temporary file, fsync, rename), then evicts what no longer fits; only
        marks it used if it is on disk (put again while its first write ran)."""
        with self._lock:
            if self._generations.get(key) is not generation:  # forgotten since it was queued
                return
            on_disk = key in self._disk
        if on_disk and self._touch(key):
            return
        data = [a.reshape(-1).view(np.uint8) for a in payload]
        checksum = hashlib.blake2b(digest_size=DIGEST_SIZE)
        for chunk in data:
            checksum.update(chunk)
        fd, tmp = tempfile.mkstemp(suffix=TMP_SUFFIX, prefix=key, dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self._fields(key) + checksum.digest())
                for chunk in data:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            self._land(key, Path(tmp), generation)
        finally:
            Path(tmp).unlink(missing_ok=True)  # a failed write's, or a forgotten page's; gone once renamed

    def _land(self, key: PageKey, tmp: Path, generation: _Generation) -> None:
        """Renames a page's written file into place and indexes it, unless the page was forgotten meanwhile. Under
        `_lock`, so that `forget` finds the file indexed (and removes it) or the file never lands: renamed after
        `forget` returned, a process killed before it was removed again left the suspect page for the next store."""
        with self._lock:
            if self._generations.get(key) is generation:
                os.replace(tmp, self._path(key))
                self._disk[key] = None
                self._evict_disk()


def _remove_file(path: Path) -> bool:
    """Removes a page's file; whether it is gone (a missing one is). A failure (EACCES, EIO) is logged."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        logger.warning("KV store: could not remove %s: %s", path, e)
        return False
    return True


def _write_loop(store: weakref.ref[KVStore], jobs: queue.Queue[_Write | _Mark | None]) -> None:
    """The writer thread: runs the queued jobs in order until `close` or the store's collection (None); the writes
    still queued once the store is collected go with it."""
    while (job := jobs.get()) is not None:
        try:
            if (writer := store()) is not None:
                if isinstance(job, _Mark):
                    writer._mark_used(job.key)
                else:
                    writer._write_page(job)
                del writer  # held only while it writes: waiting, the thread must not keep the store alive
        finally:
            del job  # nor the last page it wrote, or did not: a forgotten page's key goes with the store's
            jobs.task_done()
    jobs.task_done()


def _let_go(jobs: queue.Queue[_Write | _Mark | None], slot_lock: int) -> None:
    """A store's end, by `close` or its collection: stops the writer, after the jobs queued, and frees the slot."""
    jobs.put(None)
    os.close(slot_lock)
