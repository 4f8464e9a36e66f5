"""OpenAI request fields -> the engine's `SamplingParams`."""

from __future__ import annotations

from batching.sampling_params import SamplingParams

from app.errors import invalid_request
from app.schemas import SamplingRequest


def sampling_params(body: SamplingRequest, *, max_tokens: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
    """`max_tokens` and the logprob settings are resolved by the caller: their defaults and shapes differ per API."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            temperature=body.temperature,
            top_k=body.top_k,
            top_p=body.top_p,
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            seed=body.seed,
            stop=body.stop_strings,
            stop_token_ids=tuple(body.stop_token_ids),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            n=body.n,
        )
    except ValueError as error:
        # Pydantic has already checked each field's range; what is left are rules across fields.
        raise invalid_request(str(error)) from None
