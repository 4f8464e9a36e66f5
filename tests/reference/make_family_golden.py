"""Write a tiny random Qwen2 and Llama 3 and what HF transformers computes with them: tests/data/tiny_qwen2/ and
tests/data/tiny_llama3/.

Each model is HF's own class, built from its config and saved as HF saves it (config.json, model.safetensors in
bfloat16, generation_config.json), then read back in float32 before anything is computed, as
`make_qwen3_golden.py` does, whose prompts this script shares (`golden_common.py` draws, saves and records them):
- `Qwen2ForCausalLM` as Qwen2.5-0.5B/1.5B-Instruct are made: q/k/v biases (drawn far from zero), tied embeddings,
  GQA, rope_theta 1e6.
- `LlamaForCausalLM` as Llama 3.1/3.2 are made: `llama3` RoPE scaling with an `original_max_position_embeddings` of
  16, which the 40-token prompt runs well past (HF scales the frequencies at every position, so all prompts see
  it); GQA, untied embeddings, two EOS ids. Its `golden.json` also holds `rope_freq_factors`, each frequency's
  divisor as HF scales it (what llama.cpp's converter writes as `rope_freqs.weight`).

Run in a separate venv holding torch (CPU), transformers, safetensors and numpy, none of them a Sluice runtime
dependency:

    /tmp/refvenv-family/bin/python tests/reference/make_family_golden.py [--out tests/data]
"""

import argparse
from pathlib import Path

from golden_common import LOGPROB_DECIMALS, VOCAB, prompts, write_tiny_golden
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data"
PROMPTS = prompts("forty_tokens", 40)


def tiny_qwen2() -> Qwen2ForCausalLM:
    """Qwen2Config has no head_dim: it is hidden / heads (16)."""
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True,
        use_sliding_window=False, bos_token_id=1, eos_token_id=2,
    ))


def tiny_llama3() -> LlamaForCausalLM:
    """head_dim 32 gives 16 rotary frequencies; with theta 5e5 and wavelengths of 8 and 16 tokens as the scaling's
    bounds (16 / high_freq_factor, 16 / low_freq_factor), the first is kept, the second smoothed and the other 14
    divided by the factor of 8 (Llama 3.1's high_freq_factor of 4 would smooth the first too)."""
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=128, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 2.0, "original_max_position_embeddings": 16},
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=[2, 3],
    ))


def rope_freq_factors(model: LlamaForCausalLM) -> list[float]:
    """[head_dim // 2]: each rotary frequency without scaling over the one HF's model uses."""
    default, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(model.config)
    return [round(float(f), LOGPROB_DECIMALS) for f in default / model.model.rotary_emb.inv_freq]


def write_family(model: PreTrainedModel, out: Path) -> None:
    """Randomizes `model` (biases N(0, 1): far from zero), saves it into `out` in bfloat16, reads it back in float32
    and writes its golden.json beside it, naming its class (and a Llama's `rope_freq_factors`)."""
    fields = {"model_class": type(model).__name__}
    if isinstance(model, LlamaForCausalLM):
        fields["rope_freq_factors"] = rope_freq_factors(model)
    write_tiny_golden(model, out, "tests/reference/make_family_golden.py", PROMPTS, **fields)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the folder to write tiny_qwen2/ and "
                        "tiny_llama3/ into")
    args = parser.parse_args()
    for name, build in (("tiny_qwen2", tiny_qwen2), ("tiny_llama3", tiny_llama3)):
        write_family(build(), args.out / name)


if __name__ == "__main__":
    main()
