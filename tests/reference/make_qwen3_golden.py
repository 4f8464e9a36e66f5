"""Write a tiny random Qwen3 and what HF transformers computes with it: tests/data/tiny_qwen3/.

The model is HF's own `Qwen3ForCausalLM`, built from a `Qwen3Config` whose head_dim (32) is not hidden / heads
(64 / 4), with random q/k norm weights that are far from ones, tied embeddings, rope_theta 1e6. It is saved as HF
saves it (config.json, model.safetensors in bfloat16, generation_config.json) and read back in float32 before
anything is computed, so the reference is exactly the saved weights. No tokenizer: the prompts are token ids.

Run in a separate venv holding torch (CPU), transformers, safetensors and numpy, none of them a Sluice runtime
dependency:

    /tmp/qwen3ref/bin/python tests/reference/make_qwen3_golden.py [--out tests/data/tiny_qwen3]
"""

import argparse
import datetime
import json
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data" / "tiny_qwen3"
GOLDEN_FILE = "golden.json"
SEED = 0
VOCAB = 320
NUM_NEW_TOKENS = 12
TOP_K = 5
LOGPROB_DECIMALS = 6
PROMPTS = {
    "one_token": [1],
    "short": [1, 17, 42, 99, 7, 250, 3],
    "forty_tokens": torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist(),
}


def tiny_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )


@torch.no_grad()
def randomize(model: Qwen3ForCausalLM) -> None:
    """Weights whose logits are spread (HF's initializer_range of 0.02 makes them nearly uniform): linears
    N(0, 1/fan_in), the embedding N(0, 0.5^2), every RMSNorm weight (q/k norms included) uniform in [0.5, 2)."""
    generator = torch.Generator().manual_seed(SEED)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(0.5 + 1.5 * torch.rand(param.shape, generator=generator))
        elif name == "model.embed_tokens.weight":
            param.copy_(0.5 * torch.randn(param.shape, generator=generator))
        else:
            param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)


@torch.no_grad()
def greedy(model: Qwen3ForCausalLM, prompt_ids: list[int]) -> list[int]:
    """NUM_NEW_TOKENS argmax tokens, each from a full pass over the sequence so far (no KV cache: the reference
    should not depend on HF's cache API), no stop at EOS."""
    ids = list(prompt_ids)
    for _ in range(NUM_NEW_TOKENS):
        ids.append(int(torch.argmax(model(input_ids=torch.tensor([ids])).logits[0, -1])))
    return ids[len(prompt_ids):]


@torch.no_grad()
def record(model: Qwen3ForCausalLM, name: str, prompt_ids: list[int]) -> dict:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    model = Qwen3ForCausalLM(tiny_config())
    randomize(model)
    model.to(torch.bfloat16).save_pretrained(args.out)
    model = Qwen3ForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    model.eval()
    cases = [record(model, name, ids) for name, ids in PROMPTS.items()]
    for case in cases:
        print(f"{case['name']}: {case['greedy_ids']} (smallest top-2 gap {case['min_top2_gap']})")
    golden = {
        "generated_by": "tests/reference/make_qwen3_golden.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "transformers_version": version("transformers"),
        "torch_version": version("torch"),
        "weights_dtype": "bfloat16",
        "dtype": "float32",
        "attn_implementation": model.config._attn_implementation,
        "num_new_tokens": NUM_NEW_TOKENS,
        "top_k": TOP_K,
        "decoding": "greedy argmax over float32 logits, recomputed without a KV cache, no stop at EOS",
        "cases": cases,
    }
    (args.out / GOLDEN_FILE).write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
