"""Write tiny random models with scaled RoPE and what HF transformers computes with them: tests/data/tiny_yarn/ and
tests/data/tiny_linear_rope/.

Each model is HF's own: a `Qwen2ForCausalLM` with YaRN (factor 4 over an original context of 32: transformers'
attention factor 0.1 ln 4 + 1 scales cos and sin) and a `LlamaForCausalLM` with linear scaling (factor 2 over a
context of 64). It is saved as HF saves it (config.json, model.safetensors in bfloat16, generation_config.json) and
read back in float32 before anything is computed, so the reference is exactly the saved weights (`golden_common.py`
draws, saves and records them, as for `make_qwen3_golden.py`). The prompts are
token ids (no tokenizer) and run past the original context: up to 111 positions of the 128 each scaling serves.

Beside the YaRN model, `rope_cases.json` holds, for a set of config.json RoPE settings (each YaRN key transformers
reads, the defaults it fills in, transformers 4's `rope_scaling` form, linear), the inverse frequencies and
attention factor of the model's own rotary embedding module.

Run in a separate venv holding torch (CPU), transformers, safetensors and numpy, none of them a Sluice runtime
dependency:

    /tmp/refvenv/bin/python tests/reference/make_rope_scaling_golden.py [--out tests/data]
"""

import argparse
import json
from importlib.metadata import version
from pathlib import Path

import torch
from golden_common import SEED, VOCAB, prompts, record, write_tiny_golden
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

GENERATED_BY = "tests/reference/make_rope_scaling_golden.py"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data"
ROPE_CASES_FILE = "rope_cases.json"
PROMPTS = prompts("hundred_tokens", 100)
BIAS_STD = 0.5
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
ROPE_CASE_BASE = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **SIZES, "hidden_size": 128,
                  "max_position_embeddings": 128}
"""A Qwen2 config.json of head_dim 32 (hidden 128 over 4 heads) and a context of 128."""
# config.json's RoPE keys for each case of rope_cases.json, over ROPE_CASE_BASE.
ROPE_CASES = {
    "yarn": {"rope_parameters": YARN},
    "yarn_betas": {"rope_parameters": {**YARN, "beta_fast": 4.0, "beta_slow": 2.0}},
    "yarn_attention_factor": {"rope_parameters": {**YARN, "attention_factor": 0.9}},
    "yarn_mscale_and_mscale_all_dim": {"rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5}},
    "yarn_mscale_alone": {"rope_parameters": {**YARN, "mscale": 0.5}},
    "yarn_untruncated": {"rope_parameters": {**YARN, "truncate": False}},
    "yarn_factor_1": {"rope_parameters": {**YARN, "factor": 1.0}},
    "yarn_without_original_context": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500.0}},
    "yarn_transformers_4": {"rope_theta": 500.0, "rope_scaling": {"type": "yarn", "factor": 8.0,
                                                                  "original_max_position_embeddings": 16}},
    "yarn_original_context_outside": {"original_max_position_embeddings": 16, "rope_parameters": YARN},
    "linear": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
}


def yarn_config() -> Qwen2Config:
    """Qwen2 (q/k/v biases) with YaRN: 4 times the original 32 positions."""
    return Qwen2Config(**SIZES, max_position_embeddings=128, rope_parameters=YARN, tie_word_embeddings=False)


def linear_config() -> LlamaConfig:
    """Llama with linear scaling: twice its 64 positions, untied embeddings."""
    return LlamaConfig(**SIZES, max_position_embeddings=64, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})


def record_case(model: PreTrainedModel, name: str, prompt_ids: list[int]) -> dict:
    """`golden_common.record`'s case, with the largest change of the last position's logprobs when it is
    decoded over HF's KV cache instead (the noise of the reference itself)."""
    case = record(model, name, prompt_ids)
    case["cached_last_step_change"] = cached_last_step_change(model, prompt_ids + case["greedy_ids"][:-1])
    return case


@torch.no_grad()
def cached_last_step_change(model: PreTrainedModel, sequence: list[int]) -> float:
    """The largest |difference| between the last position's logprobs [vocab] from one pass over `sequence` and
    from decoding it after a prefill of the others into HF's KV cache."""
    if len(sequence) < 2:
        return 0.0
    full = torch.log_softmax(model(input_ids=torch.tensor([sequence])).logits[0, -1].float(), dim=-1)
    prefill = model(input_ids=torch.tensor([sequence[:-1]]), use_cache=True)
    last = model(input_ids=torch.tensor([sequence[-1:]]), past_key_values=prefill.past_key_values, use_cache=True)
    return float((torch.log_softmax(last.logits[0, -1].float(), dim=-1) - full).abs().max())


def rope_case(keys: dict) -> dict:
    """The config.json of ROPE_CASE_BASE with RoPE `keys`, and the inverse frequencies [16] and attention factor
    HF's rotary embedding module computes for it."""
    config_json = {**ROPE_CASE_BASE, **keys}
    rotary = Qwen2RotaryEmbedding(Qwen2Config.from_dict(json.loads(json.dumps(config_json))))
    return {"config": config_json, "inv_freq": rotary.inv_freq.tolist(),
            "attention_factor": float(rotary.attention_scaling)}


def write_model(model: PreTrainedModel, folder: Path) -> None:
    """Randomizes `model` (biases N(0, BIAS_STD^2)), saves it into `folder` in bfloat16, reads it back in float32
    and writes HF's golden.json of `record_case` beside it."""
    write_tiny_golden(model, folder, GENERATED_BY, PROMPTS, BIAS_STD, record_case)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.manual_seed(SEED)
    write_model(Qwen2ForCausalLM(yarn_config()), args.out / "tiny_yarn")
    write_model(LlamaForCausalLM(linear_config()), args.out / "tiny_linear_rope")
    cases = {"generated_by": GENERATED_BY, "transformers_version": version("transformers"),
             "cases": {name: rope_case(keys) for name, keys in ROPE_CASES.items()}}
    (args.out / "tiny_yarn" / ROPE_CASES_FILE).write_text(json.dumps(cases, indent=1) + "\n")
    print(f"wrote {args.out / 'tiny_yarn' / ROPE_CASES_FILE}")


if __name__ == "__main__":
    main()
