"""An engine dropped without shutdown (a test's, a fuzz's: ~85 engines in one process) leaves nothing behind: it is
freed by reference counting alone, with its persistent prefix store's threads and slot and its grammar compiler.

Reference counting alone: each Engine freezes what lives when it is built (`gc.freeze()`), so whatever of an engine
alive then (a differential fuzz holds two) is left to the cyclic collector is never freed."""

import gc
import threading
import weakref
from dataclasses import replace

import pytest
from flax import nnx

from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.sampling_params import SamplingParams, StructuredOutput
from sluice.model.config import ModelConfig
from sluice.model.llama import Llama
from sluice.model.loader import LoadedModel

CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, page_size=4,
                      kv_cache_memory=1 << 20, num_decode_steps=1, warmup=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def tiny(smollm2) -> LoadedModel:
    """A tiny random model over SmolLM2's whole vocabulary, so llguidance takes its tokenizer."""
    tokenizer = smollm2.tokenizer
    config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size)
    return LoadedModel(config, Llama(config, rngs=nnx.Rngs(0)), tokenizer, "tiny")


def serve(tiny: LoadedModel, config: EngineConfig, structured: bool) -> dict[str, weakref.ref]:
    """Builds an engine, serves a request (a schema checked first, with `structured`) and drops the engine without
    shutdown; weak references to it and to what it built."""
    engine = Engine(tiny, config, progress=False)
    if structured:
        engine.grammars.check(StructuredOutput("regex", "[a-c]{3}"))
    engine.generate([PROMPT], GREEDY)
    parts = {"engine": engine, "runner": engine.runner, "store": engine.prefix_store,
             "grammars": engine.__dict__.get("grammars")}
    return {name: weakref.ref(part) for name, part in parts.items() if part is not None}


def store_writers_end() -> bool:
    """Whether every persistent prefix store's writer thread ends (a store's page being written holds it until
    written)."""
    writers = [t for t in threading.enumerate() if t.name == "kv-store-writer"]
    for writer in writers:
        writer.join(timeout=10)
    return not any(writer.is_alive() for writer in writers)


@pytest.mark.parametrize("kind", ["plain", "store", "structured"])
def test_a_dropped_engine_is_freed_by_reference_counting_alone(tiny, tmp_path, kind):
    config = replace(CONFIG, prefix_cache_dir=str(tmp_path)) if kind == "store" else CONFIG
    gc.collect()
    gc.disable()
    try:
        parts = serve(tiny, config, kind == "structured")
        store_writers_end()
        alive = [name for name, ref in parts.items() if ref() is not None]
    finally:
        gc.enable()
    assert alive == []


def test_an_engine_dropped_without_shutdown_leaves_its_store_slot_and_pages_to_the_next(tiny, tmp_path):
    config = replace(CONFIG, prefix_cache_dir=str(tmp_path))
    first = Engine(tiny, config, progress=False)
    first.generate([PROMPT], GREEDY)
    first.prefix_store.flush()
    directory = first.prefix_store.directory
    del first
    gc.collect()
    assert store_writers_end()
    second = Engine(tiny, config, progress=False)
    assert second.prefix_store.directory == directory
    second.generate([PROMPT], GREEDY)
    assert second.stats.prefix_store.disk.hits > 0
    second.close_store()
