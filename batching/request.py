"""A request as the engine holds it: its sequences (one per choice), its consumer, and the checks that need the
model (context length, pool size), done once when it is built."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sluice.batching.ngram import NgramConfig, NgramProposer
from sluice.batching.outputs import OutputSink, Usage
from sluice.batching.sampling_params import MAX_LOGIT_BIAS, ContextLengthExceeded, RequestRejected, SamplingParams
from sluice.batching.sequence import Sequence
from sluice.batching.stop_checker import StopChecker, stop_token_ids
from sluice.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from sluice.batching.structured import Grammar

# Stop ids (stop_token_ids and EOS) a sequence may have: the sampler bans them before min_tokens and the
# device checks them to end a sequence inside a multi-step call.
MAX_STOP_IDS = 32
_SEED_STRIDE = 0x9E3779B9  # spreads the choices of one seeded request over distinct sampler seeds


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit: the model's context (within the KV pool), its vocabulary, and its stop ids."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


@dataclass(eq=False)
class Request:
    """`seqs[choice]` for each of the request's `len(prompts) * n` choices; the first sequence of each prompt
    (its `parent` is None) prefills it for the others."""

    request_id: str
    seqs: list[Sequence]
    sink: OutputSink
    finished_choices: set[int] = field(default_factory=set)

    @property
    def finished(self) -> bool:
        return len(self.finished_choices) == len(self.seqs)

    def usage(self) -> Usage:
        firsts = [s for s in self.seqs if s.parent is None]
        return Usage(prompt_tokens=sum(s.num_prompt_tokens for s in firsts),
                     completion_tokens=sum(s.num_output_tokens for s in self.seqs),
                     cached_prompt_tokens=sum(s.num_cached_tokens or 0 for s in firsts))


def check_fits(prompts: list[list[int]], params: SamplingParams, limits: RequestLimits) -> None:
    """Raises RequestRejected unless every prompt holds ids of the model's vocabulary and, with max_tokens more, fits
    the context, and min_tokens is within max_tokens (the limit a request without one gets too) and
    leaves a token to sample."""
    if params.min_tokens > params.max_tokens:
        raise RequestRejected(f"min_tokens ({params.min_tokens}) must not exceed the maximum number of tokens "
                              f"({params.max_tokens})", "min_tokens")
    for prompt in prompts:
        if not prompt:
            raise RequestRejected("the prompt is empty", "prompt")
        if (largest := max(prompt)) >= limits.vocab_size:
            # A text prompt's, where the tokenizer holds tokens the model has no embedding for (the embedding lookup
            # would clamp it silently to another token's).
            raise RequestRejected(f"token id {largest} is outside the model's vocabulary of {limits.vocab_size} "
                                  f"tokens", "prompt")
        total = len(prompt) + params.max_tokens
        if total > limits.max_model_len:
            # A prompt that fills the context alone left its request's default max_tokens nothing to count. Its
            # words are Anthropic's too: clients tell an overflow from other 400s by them (LangChain's ChatOpenAI,
            # as the openai client's exception text no longer holds the code).
            told = (f"the prompt is too long: {len(prompt)} tokens" if len(prompt) >= limits.max_model_len
                    else f"the prompt has {len(prompt)} tokens and {params.max_tokens} more were requested")
            raise ContextLengthExceeded(f"This model's maximum context length is {limits.max_model_len} tokens; "
                                        f"{told}")
    stop_ids = stop_token_ids(params, limits.eos_token_ids)
    if len(stop_ids) > MAX_STOP_IDS:
        raise RequestRejected(f"at most {MAX_STOP_IDS} stop token ids (EOS included) are supported", "stop_token_ids")
    if params.min_tokens and params.allowed_token_ids and stop_ids.issuperset(params.allowed_token_ids):
        raise RequestRejected("min_tokens needs an allowed token id that is not a stop id: the stop ids are "
                              "banned until min_tokens, and allowed_token_ids allows nothing else", "min_tokens")
    if len(params.biased_ids) > MAX_LOGIT_BIAS:
        raise RequestRejected(f"at most {MAX_LOGIT_BIAS} logit_bias entries or allowed token ids are supported",
                              "allowed_token_ids" if params.allowed_token_ids else "logit_bias")


def build_request(request_id: str, prompts: list[list[int]], params: SamplingParams, sink: OutputSink,
                  tokenizer: Tokenizer, limits: RequestLimits,
                  ngram: NgramConfig | None = None, grammar: Grammar | None = None) -> Request:
    """Checks the request against `limits` and builds its sequences, each with its seed and stop
    checker (so a conversion error is this request's rejection, never a step's failure), with a draft
    proposer indexing its prompt when speculating, and with its own copy of `grammar` (the request's compiled
    structured output) if there is one."""
    check_fits(prompts, params, limits)
    seed = params.seed if params.seed is not None else random.getrandbits(64)
    seqs: list[Sequence] = []
    for prompt in prompts:
        parent = None
        for sample in range(params.n):
            choice = len(seqs)
            # Seeded, a prompt's samples draw as they would in a request of their own, wherever the prompt is in
            # the list (vLLM runs each prompt of a list as a request); unseeded, every choice draws apart.
            draw = sample if params.seed is not None else choice
            seq = Sequence(
                request_id=request_id, choice=choice, prompt_ids=tuple(prompt), params=params,
                seed=(seed + draw * _SEED_STRIDE) % 2**32,
                stop=StopChecker(params, limits.eos_token_ids,
                                 tokenizer.decode_stream(prompt, skip_special_tokens=params.skip_special_tokens,
                                                         kept_special_ids=params.kept_special_ids)),
                parent=parent,
                max_num_tokens=len(prompt) + max(params.max_tokens, 1),  # an embedding's last chunk samples once
                grammar=grammar.fork() if grammar is not None else None,
                proposer=NgramProposer(ngram) if ngram and params.pooling is None else None,
                prompt_logprobs=[None] * len(prompt) if params.prompt_logprobs is not None else None,
            )
            if seq.proposer is not None:
                seq.proposer.extend(prompt)
            parent = parent or seq
            seqs.append(seq)
    return Request(request_id, seqs, sink)
