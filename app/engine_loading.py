"""Loading the engine for serving: the single process (`app/serve.py`) and each Ray replica (`app/replicas.py`)."""

from __future__ import annotations

import logging
import sys
from dataclasses import replace

from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.model.linear import arithmetic_dtype
from sluice.model.loader import default_dtype
from sluice.model.quantize import resolve
from sluice.model.roofline import Peaks, measure_peaks

logger = logging.getLogger(__name__)


def load_engine(engine_config: EngineConfig, ui: bool, declared: Peaks | None,
                progress: bool = True) -> tuple[Engine, Peaks | None]:
    """The engine, and for the dashboard the peaks of all its devices: `declared`, or measured on the first
    (before serving, so that nothing else runs on the device meanwhile)."""
    engine = Engine.create(engine_config, progress=progress)
    if (problem := engine.tokenizer.chat_template_error) is not None:
        # Served as vLLM serves it: completions and embeddings work, and --chat-template mends the chats.
        logger.warning("%s: each chat request gets a 400 until --chat-template gives one that does (completions are "
                       "served)", problem)
    if not ui:
        return engine, None
    if declared is not None:
        peaks = declared
    else:
        print("Measuring the device's peaks for the dashboard's roofline (declare them with --peak-gflops and "
              "--peak-bandwidth-gbs to skip this) ...", file=sys.stderr, flush=True)
        dtype = engine_config.dtype or default_dtype()
        peaks = measure_peaks(dtype=arithmetic_dtype(resolve(engine_config.quantization), dtype))
    return engine, replace(peaks, bandwidth_gbs=peaks.bandwidth_gbs * engine_config.tp,
                           matmul_gflops=peaks.matmul_gflops * engine_config.tp)
