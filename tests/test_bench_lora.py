"""bench/lora.py's adapter writer (a PEFT folder `load_adapter` serves, in the model's shapes) and its engines'
settings (`--max-loras`, `--max-cpu-loras`)."""

from __future__ import annotations

import argparse

import numpy as np

from sluice.batching.config import EngineConfig
from sluice.bench.lora import add_arguments, engine_configs, write_adapter
from sluice.model.config import ModelConfig
from sluice.model.lora import MODULES, load_adapter
from sluice.model.weights import expected_shape

TINY = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16)


def test_a_written_adapter_reads_back_on_every_projection_in_the_models_shapes(tmp_path):
    adapter = load_adapter("bench", write_adapter(tmp_path / "bench", TINY, rank=4, seed=0), TINY)
    assert (adapter.rank, adapter.scaling) == (4, 2.0)
    assert adapter.a.keys() == adapter.b.keys() == MODULES.keys()
    for module, weight in MODULES.items():
        out_features, in_features = expected_shape(weight, TINY)
        assert adapter.a[module].shape == (TINY.num_layers, in_features, 4), module
        assert adapter.b[module].shape == (TINY.num_layers, 4, out_features), module
        assert np.all(np.isfinite(adapter.b[module])) and np.any(adapter.b[module]), module


def settings(*argv: str) -> dict[str, EngineConfig]:
    """bench/lora.py's engine settings for 8 adapters and `argv`."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    modules = tuple((f"bench-{i}", f"/adapters/bench-{i}") for i in range(8))
    return engine_configs(parser.parse_args(["--adapters", "8", *argv]), modules)


def test_max_loras_gives_the_lora_engines_that_many_slots_and_the_base_engine_none():
    configs = settings("--max-loras", "2")
    assert (configs["LoRA, base requests"].max_loras, configs["LoRA, mixed"].max_loras) == (2, 2)
    assert not configs["no LoRA"].enable_lora and configs["no LoRA"].max_loras is None


def test_without_max_loras_the_lora_engines_leave_it_unset_a_slot_per_adapter():
    assert all(config.max_loras is None for config in settings().values())


def test_max_cpu_loras_bounds_the_lora_engines_host_copies_and_is_unset_by_default():
    configs = settings("--max-loras", "2", "--max-cpu-loras", "3")
    assert [config.max_cpu_loras for config in configs.values()] == [None, 3, 3]
    assert all(config.max_cpu_loras is None for config in settings().values())
