"""bench/lora.py's adapter writer: what it writes is a PEFT folder `load_adapter` serves, in the model's shapes."""

from __future__ import annotations

import numpy as np

from sluice.bench.lora import write_adapter
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
