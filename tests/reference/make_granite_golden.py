"""Write a tiny random Granite and what HF transformers computes with it: tests/data/tiny_granite/.

The model is HF's own `GraniteForCausalLM` as Granite 3.x is made (a Llama with four scalars), built from a
`GraniteConfig` whose scalars are all far from 1: the token embeddings multiplied by 12, each attention and MLP output
by 0.22 before its residual add, the logits divided by 8 (Granite 3's own values), and the softmax scale 1/16 where
head_dim**-0.5 is 1/4 (GraniteConfig has no head_dim: it is hidden / heads). GQA, tied embeddings, rope_theta 1e7, as
granite-3.3-2b-instruct is made. It is saved as HF saves it (config.json, model.safetensors in bfloat16,
generation_config.json) and read back in float32 before anything is computed, as `make_qwen3_golden.py` does, whose
prompts it shares (`golden_common.py` draws, saves and records them). No tokenizer: the prompts are token ids.

Run in a separate venv holding torch (CPU), transformers, safetensors and numpy, none of them a Sluice runtime
dependency:

    /tmp/refvenv-granite/bin/python tests/reference/make_granite_golden.py [--out tests/data/tiny_granite]
"""

import argparse
from pathlib import Path

from golden_common import VOCAB, prompts, write_tiny_golden
from transformers import GraniteConfig, GraniteForCausalLM

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data" / "tiny_granite"
PROMPTS = prompts("forty_tokens", 40)


def tiny_config() -> GraniteConfig:
    return GraniteConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7}, tie_word_embeddings=True,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1 / 16, logits_scaling=8.0,
        bos_token_id=1, eos_token_id=2,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    write_tiny_golden(GraniteForCausalLM(tiny_config()), args.out, "tests/reference/make_granite_golden.py", PROMPTS)


if __name__ == "__main__":
    main()
