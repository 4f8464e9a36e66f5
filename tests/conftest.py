"""Shared fixtures: the real default model (loaded once per session) and small random models."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache() -> None:
    """Every test process, and every process a test starts, compiles through the persistent cache the engine
    uses from its first jit on, not only once an Engine exists: a test's compile time then does not depend on
    which tests ran before it in its process, and what a server compiles to convert a model is not compiled
    again at each start."""
    import jax

    from sluice.batching.model_runner import enable_compilation_cache

    enable_compilation_cache()
    for option in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                   "jax_persistent_cache_min_entry_size_bytes"):
        os.environ.setdefault(option.upper(), str(getattr(jax.config, option)))


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (float32), fetched and converted on first use."""
    from sluice.model.loader import load_model

    return load_model(dtype="float32")
