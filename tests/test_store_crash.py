"""The persistent prefix store through crashes: writers killed (SIGKILL) at random points leave only whole page
files, which a new store on the directory serves, and nothing torn or wrong; a failed engine step with the store on
leaks no pages and the next request on the prefix answers a fresh engine's tokens from the stored pages."""

from __future__ import annotations

import hashlib
import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict

import numpy as np

from sluice.batching.kv_store import HEADER_SIZE, SUFFIX, KVLayout, KVStore, PageKey
from sluice.model.generate import generate
from test_engine import GREEDY, make_engine, prompts, tiny  # noqa: F401 - tiny: the fixture
from test_faults import run_to_completion

LAYOUT = KVLayout(model="crash-model", quantization="none", dtype="float32", kv_dtype="float32", page_size=4,
                  num_layers=2, num_kv_heads=2, head_dim=32)
KEYS = LAYOUT.page_keys(range(4 * 200))
DISK_PAGES = 24

WRITER = """
import hashlib, json, random, sys
import numpy as np
from sluice.batching.kv_store import HEADER_SIZE, KVLayout, KVStore
layout = KVLayout(**json.loads(sys.argv[1]))
keys = layout.page_keys(range(4 * 200))
store = KVStore(layout, sys.argv[2], ram_bytes=3 * layout.page_nbytes,
                disk_bytes=int(sys.argv[3]) * (HEADER_SIZE + layout.page_nbytes), queue_pages=8)
print("open", flush=True)
rng = random.Random(int(sys.argv[4]))
while True:
    key = rng.choice(keys)
    if rng.random() < 0.2:
        store.get(key)
    else:
        seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
        gen = np.random.default_rng(seed)
        store.put(key, tuple(gen.standard_normal(shape).astype(dtype) for shape, dtype in layout.payload_specs))
"""


def payload(key: PageKey) -> tuple[np.ndarray, ...]:
    """The page the writer puts under `key` (as WRITER makes it)."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(dtype) for shape, dtype in LAYOUT.payload_specs)


def is_whole(data: bytes, key: PageKey) -> bool:
    """Whether `data` is a whole file of `key`'s page: its size, its key in the header, its payload's bytes."""
    return (len(data) == HEADER_SIZE + LAYOUT.page_nbytes and bytes.fromhex(key) in data[:HEADER_SIZE]
            and data[HEADER_SIZE:] == b"".join(a.tobytes() for a in payload(key)))


def test_writers_killed_at_random_points_leave_only_whole_pages_which_a_new_store_serves(tmp_path):
    rng = random.Random(0)
    num_served = 0
    for round_ in range(5):
        # Two replicas of one model on the directory, each in a slot of its own, both killed mid-write (or while
        # opening over what the last kill left).
        writers = [subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(asdict(LAYOUT)), str(tmp_path),
                                     str(DISK_PAGES), str(rng.randrange(1 << 30))], stdout=subprocess.PIPE)
                   for _ in range(2)]
        if round_:
            for writer in writers:
                assert writer.stdout.readline() == b"open\n"
        time.sleep(rng.uniform(0.05, 0.4))
        for writer in writers:
            writer.send_signal(signal.SIGKILL)
            writer.wait()
            writer.stdout.close()

        for folder in tmp_path.iterdir():
            whole = {path.stem for path in folder.glob(f"*{SUFFIX}") if is_whole(path.read_bytes(), path.stem)}
            assert whole == {path.stem for path in folder.glob(f"*{SUFFIX}")}, "a torn file under a page's name"
        stores = [KVStore(LAYOUT, tmp_path, ram_bytes=LAYOUT.page_nbytes,
                          disk_bytes=200 * (HEADER_SIZE + LAYOUT.page_nbytes))
                  for _ in range(2)]
        try:
            for store in stores:
                on_disk = {path.stem for path in store.directory.glob(f"*{SUFFIX}")}
                served = {}
                for key in KEYS:
                    if (got := store.get(key)) is not None:
                        served[key] = got
                assert set(served) == on_disk
                num_served += len(served)
                for key, got in served.items():
                    for have, want in zip(got, payload(key), strict=True):
                        np.testing.assert_array_equal(have, want)
                assert store.counters().corrupt == 0
                assert not list(store.directory.glob("*.tmp"))  # unfinished writes removed
        finally:
            for store in stores:
                store.close()
    assert num_served > DISK_PAGES  # the kills left pages to check


def test_a_failed_step_with_the_store_on_leaks_nothing_and_the_prefix_answers_as_a_fresh_engine(
        tiny, monkeypatch, tmp_path):
    shared = prompts(1, seed=5)[0] * 3
    batch = [shared + tail for tail in prompts(4, seed=6)]
    want = [generate(tiny.model, p, GREEDY.max_tokens) for p in batch]
    monkeypatch.setenv("SLUICE_FAULT", "raise@6")
    engine = make_engine(tiny, max_num_seqs=2, prefix_cache_dir=str(tmp_path))
    first = run_to_completion(engine, batch)
    assert all(list(c.token_ids) == w for c, w in zip(first, want) if c.finish_reason != "error")
    assert engine.stats.num_step_failures == 1 and engine.stats.kv_pages_used == 0

    served = run_to_completion(engine, batch)
    assert [list(c.token_ids) for c in served] == want
    assert engine.stats.kv_pages_used == 0
    engine.close_store()

    monkeypatch.delenv("SLUICE_FAULT")
    again = make_engine(tiny, max_num_seqs=2, prefix_cache_dir=str(tmp_path))  # the failed engine's slot, freed
    assert [list(c.token_ids) for c in run_to_completion(again, batch)] == want
    assert again.stats.prefix_store.disk.hits > 0 and again.stats.prefix_store.corrupt == 0
    again.close_store()
