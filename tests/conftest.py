"""Shared fixtures: the real default model (loaded once per session) and small random models."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (float32), fetched and converted on first use."""
    from sluice.model.loader import load_model

    return load_model(dtype="float32")
