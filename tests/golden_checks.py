"""What the tests against HF transformers' golden folders share (tests/data/tiny_*, written by tests/reference):
a SLUICE_HOME per module, a golden folder copied with a tokenizer or written as a GGUF, and the checks that the
forward pass and the engine give a golden.json's greedy tokens and logprobs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.flax import load_file

from hf_folder import write_gguf, write_tokenizer_files
from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.outputs import Completion
from sluice.batching.sampling_params import SamplingParams
from sluice.model.generate import generate, sequence_logits
from sluice.model.llama import Llama
from sluice.model.config import ModelConfig
from sluice.model.loader import LoadedModel, load_model

# Float32 both, the same bfloat16 weights: HF's and Sluice's logprobs differ by float32 rounding alone (each test
# module gives its models' largest difference and smallest top-1/top-2 gap, both far from this).
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A SLUICE_HOME of the module's own, for its conversions."""
    with pytest.MonkeyPatch.context() as env:
        home = tmp_path_factory.mktemp("home")
        env.setenv("SLUICE_HOME", str(home))
        yield home


def copy_with_tokenizer(source: Path, parent: Path, vocab_size: int) -> Path:
    """The golden folder `source` copied into `parent` with a tokenizer of `vocab_size` added (the loader needs one;
    the golden prompts are token ids)."""
    folder = parent / source.name
    shutil.copytree(source, folder)
    write_tokenizer_files(folder, vocab_size)
    return folder


def load_as_gguf(folder: Path, config: ModelConfig, arch: str, parent: Path,
                 extra: dict[str, np.ndarray] | None = None) -> LoadedModel:
    """The golden folder `folder`'s weights, read as float32, written into `parent` as llama.cpp's converter writes
    `config` for `arch` (`write_gguf`, matrices in float32, `extra` tensors added) and loaded in float32."""
    tensors = {name: np.asarray(value, np.float32)
               for name, value in load_file(str(folder / "model.safetensors")).items()}
    path = parent / f"{folder.name}.gguf"
    write_gguf(path, config, tensors, arch=arch, qtype=gguf.GGMLQuantizationType.F32, extra=extra)
    return load_model(str(path), dtype="float32")


def log_softmax(logits: jax.Array) -> np.ndarray:
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))


def assert_top5_match(logprobs: np.ndarray, case: dict) -> None:
    """logprobs: [num_new_tokens, vocab], each greedy step's; HF's five best of each step must have these values."""
    for step, top5 in enumerate(case["top5"]):
        ids = [token for token, _ in top5]
        np.testing.assert_allclose(logprobs[step, ids], [lp for _, lp in top5], atol=LOGPROB_TOLERANCE,
                                   err_msg=f"{case['name']}, step {step}")


def assert_forward_pass_gives_golden(model: Llama, case: dict) -> None:
    """`case`'s greedy ids from `model`'s plain forward, and its logprobs within LOGPROB_TOLERANCE of HF's: each
    greedy step's top 5 and each prompt token's after the tokens before it."""
    # A tolerance near the smallest top-1/top-2 gap would let a wrong model pick HF's tokens by luck of rounding.
    assert case["min_top2_gap"] > 10 * LOGPROB_TOLERANCE, (case["name"], case["min_top2_gap"])
    prompt, expected = case["prompt_ids"], case["greedy_ids"]
    assert generate(model, prompt, len(expected)) == expected
    logprobs = log_softmax(sequence_logits(model, prompt + expected[:-1]))
    assert_top5_match(logprobs[len(prompt) - 1:], case)
    np.testing.assert_allclose(logprobs[np.arange(len(prompt) - 1), prompt[1:]], case["prompt_logprobs"],
                               atol=LOGPROB_TOLERANCE)


def golden_engine(loaded: LoadedModel, **options: Any) -> Engine:
    """An engine for golden cases, in one batch of up to 128 positions: prompts prefilled in chunks of 16, K/V in
    pages of 4 tokens (64 pages), given `options` too (`EngineConfig`'s fields)."""
    c = loaded.config
    return Engine(loaded, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, page_size=4,
                                       kv_cache_memory=64 * 2 * c.num_layers * c.num_kv_heads * 4 * c.head_dim * 4,
                                       warmup=False, **options), progress=False)


def golden_params(golden: dict, **fields: Any) -> SamplingParams:
    """Greedy for the golden's tokens, no stop at EOS, with the top 5 logprobs of each step; `fields` on top."""
    return SamplingParams(temperature=0.0, max_tokens=golden["num_new_tokens"], ignore_eos=True, logprobs=True,
                          top_logprobs=5, **fields)


def assert_completion_gives_case(output: Completion, case: dict) -> None:
    """The greedy ids and each step's top-5 token ids must be HF's, their logprobs within LOGPROB_TOLERANCE."""
    assert list(output.token_ids) == case["greedy_ids"], case["name"]
    assert len(output.logprobs) == len(case["top5"]), case["name"]  # zip below would stop at the shorter
    for step, (entry, top5) in enumerate(zip(output.logprobs, case["top5"])):
        assert [token for token, _ in entry.top] == [token for token, _ in top5], (case["name"], step)
        np.testing.assert_allclose([lp for _, lp in entry.top], [lp for _, lp in top5], atol=LOGPROB_TOLERANCE,
                                   err_msg=f"{case['name']}, step {step}")


def assert_engine_gives_golden(loaded: LoadedModel, golden: dict, **options: Any) -> None:
    """`golden`'s cases in one batch of a `golden_engine` given `options`, each as `assert_completion_gives_case`."""
    outputs = golden_engine(loaded, **options).generate([case["prompt_ids"] for case in golden["cases"]],
                                                        golden_params(golden))
    assert len(outputs) == len(golden["cases"])
    for case, [output] in zip(golden["cases"], outputs):
        assert_completion_gives_case(output, case)
