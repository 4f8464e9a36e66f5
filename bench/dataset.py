"""Benchmark workloads: a seeded synthetic ShareGPT-like one (no download) or a JSONL file.

Synthetic lengths follow log-normal distributions, the right-skewed shape of ShareGPT conversations
(many short turns, a long tail of long ones), clipped to [min, max]. `mean` is the mean of the
unclipped distribution and `sigma` the standard deviation of log(length); clipping moves the
realised mean a little, so reports quote the realised mean. Prompts are uniform random token ids
above the special-token range: the server does the same work whatever the ids are, and sending ids
makes prompt lengths exact and identical for every system measured.

JSONL format, one request per line: `{"prompt": "text" or [token ids], "output_tokens": 128}`.
This module imports only NumPy so the baseline's separate environment can read the same workload.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# SmolLM2/Llama tokenizers keep their special tokens below this id.
FIRST_ORDINARY_TOKEN = 100


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | tuple[int, ...]
    output_tokens: int

    @property
    def prompt_tokens(self) -> int | None:
        """Exact for token-id prompts; None for text, which only a tokenizer can count."""
        return None if isinstance(self.prompt, str) else len(self.prompt)


@dataclass(frozen=True)
class LengthDistribution:
    mean: float
    sigma: float
    min: int
    max: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mu = np.log(self.mean) - self.sigma**2 / 2  # so the unclipped mean is `mean`
        return np.clip(np.rint(rng.lognormal(mu, self.sigma, n)), self.min, self.max).astype(np.int64)


# Sized for the 2-core CPU comparison: ShareGPT's shape with shorter prompts and outputs.
DEFAULT_PROMPT = LengthDistribution(mean=192, sigma=0.8, min=16, max=512)
DEFAULT_OUTPUT = LengthDistribution(mean=96, sigma=0.6, min=8, max=192)


@dataclass(frozen=True)
class SyntheticSpec:
    num_requests: int
    seed: int = 0
    prompt: LengthDistribution = DEFAULT_PROMPT
    output: LengthDistribution = DEFAULT_OUTPUT
    vocab_size: int = 49152

    def describe(self) -> str:
        p, o = self.prompt, self.output
        return (
            f"synthetic seed={self.seed} n={self.num_requests}: prompt lognormal(mean {p.mean:g}, sigma {p.sigma:g}) "
            f"in [{p.min}, {p.max}], output lognormal(mean {o.mean:g}, sigma {o.sigma:g}) in [{o.min}, {o.max}]"
        )


def synthetic(spec: SyntheticSpec) -> list[BenchRequest]:
    rng = np.random.default_rng(spec.seed)
    prompt_lens = spec.prompt.sample(rng, spec.num_requests)
    output_lens = spec.output.sample(rng, spec.num_requests)
    return [
        BenchRequest(tuple(int(t) for t in rng.integers(FIRST_ORDINARY_TOKEN, spec.vocab_size, p)), int(o))
        for p, o in zip(prompt_lens, output_lens)
    ]


def fresh_prompts(requests: list[BenchRequest], salt: int, vocab_size: int = 49152) -> list[BenchRequest]:
    """The same lengths with new random token ids (seeded by `salt`), so a run that replays a workload
    against one server is not served from the prefix cache the previous run filled. Text prompts stay."""
    rng = np.random.default_rng([salt, len(requests)])
    return [
        r if isinstance(r.prompt, str)
        else BenchRequest(tuple(int(t) for t in rng.integers(FIRST_ORDINARY_TOKEN, vocab_size, len(r.prompt))), r.output_tokens)
        for r in requests
    ]


def load_jsonl(path: Path, num_requests: int | None = None) -> list[BenchRequest]:
    """The first `num_requests` lines of `path` (all when None)."""
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        prompt = row["prompt"]
        if not isinstance(prompt, str):
            prompt = tuple(int(t) for t in prompt)
        if not prompt or int(row["output_tokens"]) < 1:
            raise ValueError(f"{path}:{number}: a request needs a non-empty prompt and output_tokens >= 1")
        requests.append(BenchRequest(prompt, int(row["output_tokens"])))
        if num_requests is not None and len(requests) == num_requests:
            break
    return requests


def save_jsonl(requests: list[BenchRequest], path: Path) -> None:
    lines = [
        json.dumps({"prompt": r.prompt if isinstance(r.prompt, str) else list(r.prompt), "output_tokens": r.output_tokens})
        for r in requests
    ]
    path.write_text("\n".join(lines) + "\n")
