"""The persistent compilation cache that every Sluice process shares (xdist workers, servers, replicas): an entry is
whole or absent, whatever happens to the process that writes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from jax._src.lru_cache import LRUCache

from sluice.batching.compilation_cache import PARTIAL, _remove_stale_parts, _write_cache_entries_whole

# One process writes an entry with a file-size limit that cuts the write short, as a full disk or a SIGKILL would,
# then compiles the same program twice more with the limit lifted (jax.clear_caches leaves only the disk cache).
_CUT_WRITE_THEN_COMPILE_AGAIN = r"""
import collections, json, resource, signal, sys, warnings
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from sluice.batching.compilation_cache import enable_compilation_cache

enable_compilation_cache(Path(sys.argv[1]))
events = collections.Counter()
jax.monitoring.register_event_listener(lambda name, **kwargs: events.update([name.rsplit("/", 1)[-1]]))
x = np.linspace(-1, 1, 64, dtype=np.float32)

def run():
    events.clear()
    jax.clear_caches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = bool(np.allclose(jax.jit(lambda v: jnp.sin(v) * 2)(x), np.sin(x) * 2, atol=1e-6))
    return {"ok": ok, "hits": events["cache_hits"], "misses": events["cache_misses"],
            "warnings": [str(w.message) for w in caught if "persistent compilation cache" in str(w.message)]}

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
cut = run()
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
print(json.dumps([cut, run(), run()]))
"""


def test_an_entry_whose_write_was_cut_short_is_compiled_again_and_then_read(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")} | {"JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _CUT_WRITE_THEN_COMPILE_AGAIN, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    cut, again, then = json.loads(out.splitlines()[-1])
    assert cut["ok"] and cut["misses"] == 1 and cut["warnings"][0].startswith("Error writing")
    assert again == {"ok": True, "hits": 0, "misses": 1, "warnings": []}
    assert then == {"ok": True, "hits": 1, "misses": 0, "warnings": []}


def test_parts_that_killed_writers_left_are_removed_once_an_hour_old(tmp_path):
    stale, fresh, entry = (tmp_path / f"{name}-cache" for name in ("k1.0a.partial", "k2.0b.partial", "k3"))
    for path in (stale, fresh, entry):
        path.write_bytes(b"x")
    os.utime(stale, (time.time() - 7200,) * 2)
    os.utime(entry, (time.time() - 7200,) * 2)
    _remove_stale_parts(tmp_path)  # another process's write in flight is young: it stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k2.0b.partial-cache", "k3-cache"]


def test_with_eviction_on_a_part_a_killed_writer_left_is_removed_by_the_next_write_instead_of_failing_it(tmp_path):
    """Every writer holds jax's lock where it evicts, so a part seen under it is a dead writer's; left, jax's eviction
    pass would read it as an entry and fail on its missing -atime, at every later write."""
    _write_cache_entries_whole()
    (tmp_path / f"k1.0a{PARTIAL}-cache").write_bytes(b"cut")  # killed before its -atime was written
    cache = LRUCache(str(tmp_path), max_size=1 << 20)
    cache.put("k2", b"whole")
    assert cache.get("k2") == b"whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lockfile", "k2-atime", "k2-cache"]
