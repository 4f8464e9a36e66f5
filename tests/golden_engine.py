"""The engine against a golden.json of HF transformers' (tests/reference): every case in one batch, prefilled in
chunks and decoded over pages, must give HF's greedy tokens and each step's top-5 logprobs."""

from __future__ import annotations

import numpy as np

from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.sampling_params import SamplingParams
from sluice.model.loader import LoadedModel


def assert_engine_gives_golden(loaded: LoadedModel, golden: dict, tolerance: float) -> None:
    """`golden`'s cases in one batch of up to 128 positions: prompts prefilled in chunks of 16, K/V in pages of 4
    tokens (64 pages); the greedy ids and each step's top-5 token ids must be HF's, their logprobs within
    `tolerance`."""
    c = loaded.config
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, page_size=4,
                          kv_cache_memory=64 * 2 * c.num_layers * c.num_kv_heads * 4 * c.head_dim * 4, warmup=False)
    params = SamplingParams(temperature=0.0, max_tokens=golden["num_new_tokens"], ignore_eos=True, logprobs=True,
                            top_logprobs=5)
    outputs = Engine(loaded, config, progress=False).generate([case["prompt_ids"] for case in golden["cases"]], params)
    for case, [output] in zip(golden["cases"], outputs):
        assert list(output.token_ids) == case["greedy_ids"], case["name"]
        for step, (entry, top5) in enumerate(zip(output.logprobs, case["top5"])):
            assert [token for token, _ in entry.top] == [token for token, _ in top5], (case["name"], step)
            np.testing.assert_allclose([lp for _, lp in entry.top], [lp for _, lp in top5], atol=tolerance,
                                       err_msg=f"{case['name']}, step {step}")
