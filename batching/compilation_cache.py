"""jax's persistent compilation cache for the engine's step programs: on for every engine, each entry written whole."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path

import jax

PARTIAL = ".partial"  # a compilation-cache entry's name while it is written (`_write_cache_entries_whole`)


def enable_compilation_cache(path: Path | None = None) -> None:
    """Persists compiled steps across starts (small entries too, or most would be skipped), each entry written
    whole or not at all (`_write_cache_entries_whole`)."""
    path = path or Path(os.environ.get("SLUICE_JAX_CACHE", Path.home() / ".cache" / "sluice" / "jax"))
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _write_cache_entries_whole()
    _remove_stale_parts(path)


def _remove_stale_parts(path: Path, min_age_s: float = 3600.0) -> None:
    """Removes the parts of entries that processes killed while writing them left (never read), once `min_age_s`
    old: a younger one may be another process's write in flight."""
    cutoff = time.time() - min_age_s
    for part in path.glob(f"*{PARTIAL}-*"):
        with contextlib.suppress(OSError):  # removed meanwhile by another process
            if part.stat().st_mtime < cutoff:
                part.unlink()


def _write_cache_entries_whole() -> None:
    """jax (0.10 to 0.12) writes a persistent-cache entry in place, so another process sharing the directory (an
    xdist worker, a replica) may read it half-written, and a writer killed or out of disk space leaves it cut short
    for good: jax never writes over an entry that exists, so every later process warns and compiles that program
    again. jax's write now goes to a name of its own, renamed over the entry once whole, which also replaces a
    broken entry that jax failed to read and compiled again. jax has no setting for it, hence its private class;
    a jax without it writes in place, as it does."""
    try:
        from jax._src.lru_cache import LRUCache
    except ImportError:
        return
    put = LRUCache.put
    if getattr(put, "writes_whole", False):
        return

    def put_whole(cache: LRUCache, key: str, value: bytes) -> None:
        directory, partial = Path(cache.path), f"{key}.{uuid.uuid4().hex}{PARTIAL}"
        # Under jax's lock (held only where it evicts), so that no eviction pass sees the partial name's file go.
        with cache.lock if cache.eviction_enabled else contextlib.nullcontext():
            if cache.eviction_enabled:
                # Every writer holds the lock, so a part seen now is a killed writer's, whatever its age: jax's
                # eviction pass in `put` would read it as an entry without its -atime file and fail the write.
                _remove_stale_parts(directory, min_age_s=0)
            try:
                put(cache, partial, value)
                for suffix in ("-cache", "-atime"):  # an -atime file only where jax evicts
                    with contextlib.suppress(FileNotFoundError):
                        (directory / f"{partial}{suffix}").replace(directory / f"{key}{suffix}")
            finally:  # a write that failed leaves its part
                for suffix in ("-cache", "-atime"):
                    (directory / f"{partial}{suffix}").unlink(missing_ok=True)

    put_whole.writes_whole = True
    LRUCache.put = put_whole
