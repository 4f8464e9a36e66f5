"""A shared-prefix workload (`sluice bench serve --prefix-groups G`): G system prompts, each shared by many requests.

Each group's prefix is `prefix_tokens` random token ids (a long system prompt or document); each request is one
group's prefix, chosen uniformly at random, followed by a suffix of its own (the user's turn) drawn like the
synthetic workload's prompts, and asks for an output length drawn like its outputs. Requests that share a group
can be served from a prefix cache, if they reach the replica that holds it: the workload that tells prefix-aware
routing from routing that ignores prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sluice.bench.dataset import FIRST_ORDINARY_TOKEN, BenchRequest, LengthDistribution


@dataclass(frozen=True)
class PrefixGroupsSpec:
    groups: int
    prefix_tokens: int
    num_requests: int
    suffix: LengthDistribution
    output: LengthDistribution
    seed: int = 0
    vocab_size: int = 49152

    def __post_init__(self) -> None:
        if self.groups < 1 or self.prefix_tokens < 1:
            raise ValueError(f"--prefix-groups and --prefix-len must be positive, got {self.groups}, {self.prefix_tokens}")

    def describe(self) -> str:
        s, o = self.suffix, self.output
        return (
            f"shared prefixes seed={self.seed} n={self.num_requests}: {self.groups} groups of {self.prefix_tokens} "
            f"prefix tokens, suffix lognormal(mean {s.mean:g}) in [{s.min}, {s.max}], output lognormal(mean {o.mean:g}) "
            f"in [{o.min}, {o.max}]"
        )


def shared_prefix(spec: PrefixGroupsSpec) -> list[BenchRequest]:
    rng = np.random.default_rng([spec.seed, spec.groups, spec.prefix_tokens])
    prefixes = rng.integers(FIRST_ORDINARY_TOKEN, spec.vocab_size, (spec.groups, spec.prefix_tokens))
    groups = rng.integers(0, spec.groups, spec.num_requests)
    suffix_lens = spec.suffix.sample(rng, spec.num_requests)
    output_lens = spec.output.sample(rng, spec.num_requests)
    return [
        BenchRequest(tuple(int(t) for t in prefixes[g]) + tuple(int(t) for t in rng.integers(
            FIRST_ORDINARY_TOKEN, spec.vocab_size, s)), int(o))
        for g, s, o in zip(groups, suffix_lens, output_lens)
    ]
