"""What the make_*_golden.py scripts beside this file share: a tiny random HF model drawn, saved as HF saves it and
read back, and what HF computes with it recorded as the golden.json the tests read.

Imported by those scripts, so it runs in their venv (torch, transformers, safetensors, numpy; see README.md).
"""

import datetime
import json
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import PreTrainedModel

GOLDEN_FILE = "golden.json"
SEED = 0
VOCAB = 320
NUM_NEW_TOKENS = 12
TOP_K = 5
LOGPROB_DECIMALS = 6
BIAS_STD = 1.0


def prompts(long_name: str, long_length: int) -> dict[str, list[int]]:
    """The cases' prompts, token ids: BOS alone, 7 ids, and `long_name`'s `long_length` ids drawn in [3, VOCAB)."""
    return {
        "one_token": [1],
        "short": [1, 17, 42, 99, 7, 250, 3],
        long_name: torch.randint(3, VOCAB, (long_length,), generator=torch.Generator().manual_seed(1)).tolist(),
    }


def random_parameter(name: str, shape: torch.Size, generator: torch.Generator, bias_std: float) -> torch.Tensor:
    """A draw for parameter `name` whose logits are spread (HF's initializer_range of 0.02 makes them nearly
    uniform): every RMSNorm weight uniform in [0.5, 2), the embedding N(0, 0.5^2), a bias N(0, bias_std^2), any
    other (a linear's [out, in] weight) N(0, 1/in)."""
    if name.endswith("norm.weight"):
        return 0.5 + 1.5 * torch.rand(shape, generator=generator)
    if name == "model.embed_tokens.weight":
        return 0.5 * torch.randn(shape, generator=generator)
    if name.endswith(".bias"):
        return bias_std * torch.randn(shape, generator=generator)
    return torch.randn(shape, generator=generator) / shape[1] ** 0.5


@torch.no_grad()
def randomize(model: PreTrainedModel, bias_std: float) -> None:
    """Every parameter `random_parameter`'s, drawn in `named_parameters` order from one generator seeded SEED."""
    generator = torch.Generator().manual_seed(SEED)
    for name, param in model.named_parameters():
        param.copy_(random_parameter(name, param.shape, generator, bias_std))


def save_random_model(model: PreTrainedModel, folder: Path, bias_std: float = BIAS_STD) -> PreTrainedModel:
    """Randomizes `model` (biases of `bias_std`), saves it into `folder` as HF saves it (config.json,
    model.safetensors in bfloat16, generation_config.json) and returns it read back in float32, so the reference is
    exactly the saved weights."""
    randomize(model, bias_std)
    model.to(torch.bfloat16).save_pretrained(folder)
    model = type(model).from_pretrained(folder, dtype=torch.float32)
    model.eval()
    return model


@torch.no_grad()
def greedy(model: PreTrainedModel, prompt_ids: list[int]) -> list[int]:
    """NUM_NEW_TOKENS argmax tokens, each from a full pass over the sequence so far (no KV cache: the reference
    should not depend on HF's cache API), no stop at EOS."""
    ids = list(prompt_ids)
    for _ in range(NUM_NEW_TOKENS):
        ids.append(int(torch.argmax(model(input_ids=torch.tensor([ids])).logits[0, -1])))
    return ids[len(prompt_ids):]


@torch.no_grad()
def record(model: PreTrainedModel, name: str, prompt_ids: list[int]) -> dict:
    """One case: the greedy ids, the TOP_K [token_id, logprob] of log_softmax of the float32 logits at each greedy
    step, each prompt token's logprob after the tokens before it, and the smallest top-1/top-2 logprob gap of the
    greedy path (how far a reimplementation's logits may stray before its argmax would differ)."""
    greedy_ids = greedy(model, prompt_ids)
    sequence = prompt_ids + greedy_ids[:-1]
    logprobs = torch.log_softmax(model(input_ids=torch.tensor([sequence])).logits[0].float(), dim=-1)
    steps = logprobs[len(prompt_ids) - 1:]
    values, indices = torch.topk(steps, TOP_K)
    assert indices[:, 0].tolist() == greedy_ids
    rounded = lambda v: round(float(v), LOGPROB_DECIMALS)
    return {
        "name": name,
        "prompt_ids": prompt_ids,
        "greedy_ids": greedy_ids,
        "top5": [[[int(i), rounded(v)] for i, v in zip(row_ids, row)] for row_ids, row in zip(indices, values)],
        "prompt_logprobs": [rounded(logprobs[p - 1, prompt_ids[p]]) for p in range(1, len(prompt_ids))],
        "min_top2_gap": rounded((values[:, 0] - values[:, 1]).min()),
    }


def record_cases(model: PreTrainedModel, folder: Path, prompts: dict[str, list[int]],
                 record_case: Callable[[PreTrainedModel, str, list[int]], dict] = record) -> list[dict]:
    """`record_case` of each prompt, each printed with its greedy ids and smallest top-2 gap."""
    cases = [record_case(model, name, ids) for name, ids in prompts.items()]
    for case in cases:
        print(f"{folder.name} {case['name']}: {case['greedy_ids']} (smallest top-2 gap {case['min_top2_gap']})")
    return cases


def build_golden(model: PreTrainedModel, generated_by: str, cases: list[dict], **fields) -> dict:
    """The golden.json of `cases` from `model` (read back by `save_random_model`): its provenance, then `fields`,
    then how the cases were computed."""
    return {
        "generated_by": generated_by,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "transformers_version": version("transformers"),
        "torch_version": version("torch"),
        **fields,
        "weights_dtype": "bfloat16",
        "dtype": "float32",
        "attn_implementation": model.config._attn_implementation,
        "num_new_tokens": NUM_NEW_TOKENS,
        "top_k": TOP_K,
        "decoding": "greedy argmax over float32 logits, recomputed without a KV cache, no stop at EOS",
        "cases": cases,
    }


def write_golden(folder: Path, golden: dict) -> None:
    (folder / GOLDEN_FILE).write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {folder}")


def write_tiny_golden(model: PreTrainedModel, folder: Path, generated_by: str, prompts: dict[str, list[int]],
                      bias_std: float = BIAS_STD,
                      record_case: Callable[[PreTrainedModel, str, list[int]], dict] = record, **fields) -> None:
    """Randomizes `model` (biases of `bias_std`), saves it into `folder` in bfloat16, reads it back in float32 and
    writes beside it the golden.json of `record_case` on each of `prompts`, with `fields` after its provenance."""
    model = save_random_model(model, folder, bias_std)
    cases = record_cases(model, folder, prompts, record_case)
    write_golden(folder, build_golden(model, generated_by, cases, **fields))
