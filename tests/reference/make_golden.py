"""Write the golden reference for SmolLM2: HF transformers, float32, on the same GGUF Sluice loads.

HF dequantizes the GGUF itself (its own q/k un-permutation, its own tokenizer built from
the GGUF metadata), so agreement with this file is independent evidence that Sluice's
loader, tokenizer, chat template and model are right.

Run in a separate venv holding torch (CPU), transformers, gguf and numpy — none of them
is a Sluice runtime dependency:

    /tmp/refvenv/bin/python tests/reference/make_golden.py \
        [--gguf PATH] [--out tests/data/golden_smollm2.json]
"""

import argparse
import datetime
import hashlib
import json
from importlib.metadata import version
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

DEFAULT_GGUF = Path("~/.cache/sluice/models/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser()
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data" / "golden_smollm2.json"
NUM_NEW_TOKENS = 24
TOP_K = 5
LOGPROB_DECIMALS = 6

LONG_PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
    "those used to make wine. Before his invention, books were copied by hand, a slow and "
    "expensive process that kept literacy within the reach of a small elite. Within a few "
    "decades, printing shops had spread to more than two hundred cities across Europe, and "
    "millions of volumes were in circulation. The most important consequence of this "
    "change was"
)


@dataclass(frozen=True)
class Case:
    """One prompt: raw text (`prompt`) or a chat conversation (`messages`)."""

    name: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None

    @property
    def kind(self) -> str:
        return "raw" if self.prompt is not None else "chat"


CASES = [
    Case("raw_capital_of_france", prompt="The capital of France is"),
    Case(
        "raw_python_code",
        prompt='def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n',
    ),
    Case(
        "raw_non_ascii_utf8",
        prompt="Café, naïve façade — 日本語のテキスト, emoji 🚀🎉 and «bonjour» mean:",
    ),
    Case("raw_long_paragraph", prompt=LONG_PARAGRAPH),
    Case(
        "chat_capital_of_france",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    ),
    Case(
        "chat_with_system_message",
        messages=[
            {"role": "system", "content": "You are a pirate. Answer every question like a pirate."},
            {"role": "user", "content": "How many legs does a spider have?"},
        ],
    ),
    Case(
        "chat_multi_turn",
        messages=[
            {"role": "user", "content": "Hi! My name is Ada and I love gardening."},
            {"role": "assistant", "content": "Hello Ada! Gardening is wonderful. How can I help you today?"},
            {"role": "user", "content": "What is my name, and what do I love?"},
        ],
    ),
    Case(
        "chat_non_ascii_utf8",
        messages=[{"role": "user", "content": "Écris une phrase en français sur le café ☕ et les crêpes."}],
    ),
]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def prompt_text_of(case: Case, tokenizer: PreTrainedTokenizerBase) -> str:
    if case.prompt is not None:
        return case.prompt
    return tokenizer.apply_chat_template(case.messages, tokenize=False, add_generation_prompt=True)


@torch.inference_mode()
def greedy_with_top_k(model: torch.nn.Module, prompt_ids: list[int]) -> tuple[list[int], list[list[list]]]:
    """Greedy-decode NUM_NEW_TOKENS tokens without stopping at EOS.

    Returns the new token ids and, for every step, the TOP_K [token_id, logprob] pairs
    of log_softmax over the float32 logits that chose that step's token.
    """
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    past = None
    new_ids: list[int] = []
    top_k: list[list[list]] = []
    for _ in range(NUM_NEW_TOKENS):
        out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].to(torch.float32)
        logprobs = torch.log_softmax(logits, dim=-1)
        values, indices = torch.topk(logprobs, TOP_K)
        top_k.append([[int(i), round(float(v), LOGPROB_DECIMALS)] for i, v in zip(indices, values)])
        next_id = int(torch.argmax(logits))
        new_ids.append(next_id)
        input_ids = torch.tensor([[next_id]], dtype=torch.long)
    return new_ids, top_k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    gguf_path = args.gguf.expanduser().resolve()

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    model.eval()
    assert next(model.parameters()).dtype == torch.float32

    # HF's default is add_special_tokens=True; whether that prepends BOS comes from the
    # GGUF's tokenizer.ggml.add_bos_token, so record what it actually did.
    probe = "The capital of France is"
    adds_bos = tokenizer(probe)["input_ids"] != tokenizer(probe, add_special_tokens=False)["input_ids"]

    cases = []
    for case in CASES:
        prompt_text = prompt_text_of(case, tokenizer)
        prompt_ids = tokenizer(prompt_text)["input_ids"]
        greedy_ids, top_k = greedy_with_top_k(model, prompt_ids)
        record = {"name": case.name, "kind": case.kind}
        if case.prompt is not None:
            record["prompt"] = case.prompt
        else:
            record["messages"] = case.messages
        record |= {
            "prompt_text": prompt_text,
            "prompt_ids": prompt_ids,
            "greedy_ids": greedy_ids,
            "greedy_text": tokenizer.decode(greedy_ids, skip_special_tokens=False),
            "top5": top_k,
        }
        cases.append(record)
        print(f"{case.name}: {len(prompt_ids)} prompt tokens -> {record['greedy_text']!r}")

    golden = {
        "model_file": gguf_path.name,
        "model_sha256": sha256_of(gguf_path),
        "generated_by": "tests/reference/make_golden.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "transformers_version": version("transformers"),
        "torch_version": version("torch"),
        "gguf_version": version("gguf"),
        "dtype": "float32",
        "attn_implementation": model.config._attn_implementation,
        "num_new_tokens": NUM_NEW_TOKENS,
        "top_k": TOP_K,
        "decoding": "greedy argmax over float32 logits, KV cache, no stop at EOS",
        "add_special_tokens": True,
        "adds_bos": adds_bos,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "chat_template": tokenizer.chat_template,
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
