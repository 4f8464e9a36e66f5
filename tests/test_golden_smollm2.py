"""Sluice on the real SmolLM2 weights against HF transformers (float32, same GGUF): tests/data/golden_smollm2.json."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from sluice.model.generate import generate, sequence_logits

GOLDEN = json.loads((Path(__file__).parent / "data" / "golden_smollm2.json").read_text())
CASES = GOLDEN["cases"]
LOGPROB_TOLERANCE = 2e-3


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_prompt_text_and_ids_match_hf(smollm2, case):
    tokenizer = smollm2.tokenizer
    if case["kind"] == "chat":
        assert tokenizer.apply_chat_template(case["messages"]) == case["prompt_text"]
    assert tokenizer.encode(case["prompt_text"]) == case["prompt_ids"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_greedy_tokens_and_top5_logprobs_match_hf(smollm2, case):
    prompt, expected = case["prompt_ids"], case["greedy_ids"]
    assert generate(smollm2.model, prompt, len(expected)) == expected

    logits = sequence_logits(smollm2.model, prompt + expected[:-1])
    logprobs = np.asarray(jax.nn.log_softmax(logits[len(prompt) - 1 :], axis=-1))
    for step, top5 in enumerate(case["top5"]):
        ids = [token for token, _ in top5]
        hf = np.array([lp for _, lp in top5])
        np.testing.assert_allclose(logprobs[step, ids], hf, atol=LOGPROB_TOLERANCE, err_msg=f"step {step}")
