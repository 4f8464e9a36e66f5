"""Write a tiny random Qwen3 and what HF transformers computes with it: tests/data/tiny_qwen3/.

The model is HF's own `Qwen3ForCausalLM`, built from a `Qwen3Config` whose head_dim (32) is not hidden / heads
(64 / 4), with random q/k norm weights that are far from ones, tied embeddings, rope_theta 1e6. It is saved as HF
saves it (config.json, model.safetensors in bfloat16, generation_config.json) and read back in float32 before
anything is computed, so the reference is exactly the saved weights (`golden_common.py` draws, saves and records
it). No tokenizer: the prompts are token ids.

Run in a separate venv holding torch (CPU), transformers, safetensors and numpy, none of them a Sluice runtime
dependency:

    /tmp/qwen3ref/bin/python tests/reference/make_qwen3_golden.py [--out tests/data/tiny_qwen3]
"""

import argparse
from pathlib import Path

from golden_common import VOCAB, prompts, write_tiny_golden
from transformers import Qwen3Config, Qwen3ForCausalLM

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data" / "tiny_qwen3"
PROMPTS = prompts("forty_tokens", 40)


def tiny_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    write_tiny_golden(Qwen3ForCausalLM(tiny_config()), args.out, "tests/reference/make_qwen3_golden.py", PROMPTS)


if __name__ == "__main__":
    main()
