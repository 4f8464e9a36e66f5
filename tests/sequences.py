"""Sequences built outside an engine, for scheduler and block-manager tests: real stop
checkers over a small trained byte-level tokenizer."""

from __future__ import annotations

from sluice.batching.sampling_params import SamplingParams
from sluice.batching.sequence import Sequence
from sluice.batching.stop_checker import StopChecker
from sluice.model.tokenizer import SpecialTokens, Tokenizer

from hf_folder import train_tokenizer

TOKENIZER = Tokenizer(train_tokenizer(300), SpecialTokens(bos_token_id=1, eos_token_ids=(2,), add_bos=False,
                                                          chat_template=None))


def make_sequence(seq_id: int, tokens: list[int] | tuple[int, ...], params: SamplingParams = SamplingParams(),
                  *, choice: int = 0, parent: Sequence | None = None, arrival: int | None = None) -> Sequence:
    """Sequence `seq_id` of request `r<seq_id>` (or of its parent's request), arriving `seq_id`-th by default."""
    return Sequence(
        request_id=parent.request_id if parent else f"r{seq_id}", choice=choice,
        prompt_ids=tuple(tokens), params=params, seed=seq_id,
        stop=StopChecker(params, TOKENIZER.eos_token_ids, TOKENIZER.decode_stream(tokens)),
        max_num_tokens=len(tokens) + params.max_tokens, arrival=seq_id if arrival is None else arrival, parent=parent,
    )
