"""The engine's synchronous heart: requests in, one model step at a time, RequestOutputs out.

It owns the scheduler, the block manager and the model runner, and is driven either by the async `Engine`'s
worker thread or by offline `generate`. All bookkeeping runs under one lock, released while the device
computes, so `abort` from another thread frees pages at once.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass, field
from typing import Callable

from batching.block_manager import BlockManager
from batching.model_runner import ModelRunner, SamplingRow
from batching.request_output import FinishReason, RequestOutput, TokenLogprob, Usage
from batching.sampler import SamplerOutput
from batching.sampling_params import SamplingParams
from batching.scheduler import ScheduledChunk, Scheduler
from batching.sequence import Sequence, SequenceStatus
from batching.stop_checker import StopChecker
from model.tokenizer import IncrementalDetokenizer, Tokenizer

Sink = Callable[[RequestOutput], None]


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int


@dataclass(frozen=True)
class SampledToken:
    """A token appended to `seq` whose text (and stop-string check) waits for the next step's device time."""

    seq: Sequence
    token: int
    logprobs: tuple[TokenLogprob, ...]
    token_finish: FinishReason | None


@dataclass(eq=False)
class Request:
    request_id: str
    params: SamplingParams
    seqs: list[Sequence]
    checkers: list[StopChecker]
    sink: Sink
    num_prompt_tokens: int
    final_sent: set[int] = field(default_factory=set)  # indices whose last output went out

    @property
    def finished(self) -> bool:
        return len(self.final_sent) == len(self.seqs)


class EngineCore:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, tokenizer: Tokenizer,
                 eos_token_ids: tuple[int, ...]):
        self.runner = runner
        self.scheduler = scheduler
        self.block_manager: BlockManager = scheduler.block_manager
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.lock = threading.Lock()
        self.requests: dict[str, Request] = {}
        self._next_seq_id = 0
        self._arrivals = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._unemitted: list[SampledToken] = []

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._unemitted)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int, sink: Sink) -> None:
        """Queues a validated request; its `n` sequences get seeds derived from `seed`."""
        with self.lock:
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._arrivals += 1
            seqs: list[Sequence] = []
            for index in range(params.n):
                seqs.append(Sequence(
                    seq_id=self._next_seq_id, request_id=request_id, index=index, prompt_ids=tuple(prompt_ids),
                    params=params, seed=(seed + index * 0x9E3779B9) % 2**32, arrival=self._arrivals,
                    parent=seqs[0] if seqs else None,
                ))
                self._next_seq_id += 1
            checkers = [StopChecker(params, self.eos_token_ids, IncrementalDetokenizer(self.tokenizer, prompt_ids))
                        for _ in seqs]
            self.requests[request_id] = Request(request_id, params, seqs, checkers, sink, len(prompt_ids))
            self.prompt_tokens_total += len(prompt_ids)
            for seq in seqs:
                self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Finishes every sequence of the request with "abort" and frees its pages now; unknown ids are ignored."""
        with self.lock:
            request = self.requests.get(request_id)
            if request is not None:
                self._fail(request, "abort", None)

    def stats(self) -> EngineStats:
        with self.lock:
            pool = self.block_manager.counters()
            return EngineStats(
                num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                kv_pages_used=pool.pages_used, kv_pages_total=pool.pages_total,
                prefix_cache_hit_tokens=pool.prefix_cache_hit_tokens,
                prefix_cache_query_tokens=pool.prefix_cache_query_tokens,
                num_preemptions=self.scheduler.num_preemptions,
                prompt_tokens_total=self.prompt_tokens_total,
                generation_tokens_total=self.generation_tokens_total,
            )

    def step(self) -> None:
        """Schedules and dispatches one step, emits the previous step's text while the device runs, then
        appends this step's tokens. An error fails only that step's requests."""
        with self.lock:
            chunks = self.scheduler.schedule().chunks
            pending = None
            if chunks:
                rows = [self._sampling_row(c) for c in chunks]
                try:
                    pending = self.runner.dispatch(chunks, rows)
                except Exception as exc:  # noqa: BLE001 - the loop must keep serving other requests
                    self._fail_step(chunks, exc)
            self._emit_unemitted()
        if pending is None:
            return
        try:
            result = pending.fetch()
        except Exception as exc:  # noqa: BLE001
            with self.lock:
                self._fail_step(chunks, exc)
            return
        with self.lock:
            self.scheduler.update_after_step(chunks)
            for i, chunk in enumerate(chunks):
                if chunk.sample and chunk.seq.status is SequenceStatus.RUNNING:
                    self._append_token(chunk.seq, result, i)

    def _sampling_row(self, chunk: ScheduledChunk) -> SamplingRow:
        seq = chunk.seq
        checker = self.requests[seq.request_id].checkers[seq.index]
        return SamplingRow(seq.params, seq.seed, seq.num_output_tokens, seq.token_ids, seq.num_prompt_tokens,
                           checker.banned_token_ids(seq.num_output_tokens))

    def _append_token(self, seq: Sequence, result: SamplerOutput, row: int) -> None:
        """Appends the sampled token and stops the sequence now if its id or count says so."""
        token = int(result.tokens[row])
        seq.token_ids.append(token)
        self.generation_tokens_total += 1
        checker = self.requests[seq.request_id].checkers[seq.index]
        finish = checker.token_finish(token, seq.num_output_tokens, seq.num_tokens >= self.runner.max_model_len)
        logprobs: tuple[TokenLogprob, ...] = ()
        if seq.params.logprobs or seq.params.top_logprobs:
            k = seq.params.top_logprobs
            top = tuple((int(t), float(lp)) for t, lp in zip(result.top_ids[row, :k], result.top_logprobs[row, :k]))
            logprobs = (TokenLogprob(token, float(result.logprobs[row]), top),)
        if finish is not None:
            seq.finish_reason = finish
            self.scheduler.finish(seq)
        self._unemitted.append(SampledToken(seq, token, logprobs, finish))

    def _emit_unemitted(self) -> None:
        """Detokenizes and emits the sampled tokens; a stop string found here ends its sequence."""
        for sampled in self._unemitted:
            seq = sampled.seq
            request = self.requests.get(seq.request_id)
            if request is None:
                continue  # aborted meanwhile
            decision = request.checkers[seq.index].emit(sampled.token, sampled.token_finish)
            if decision.finish_reason is not None and not seq.finished:
                seq.finish_reason = decision.finish_reason
                self.scheduler.finish(seq)  # its token in the step now running is dropped
            request.sink(RequestOutput(
                request_id=seq.request_id, index=seq.index, text=decision.text, token_ids=(sampled.token,),
                logprobs=sampled.logprobs, finish_reason=decision.finish_reason,
                usage=self._usage(request) if decision.finish_reason is not None else None,
            ))
            if decision.finish_reason is not None:
                request.final_sent.add(seq.index)
            if request.finished:
                del self.requests[seq.request_id]
        self._unemitted.clear()

    def _usage(self, request: Request) -> Usage:
        return Usage(
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=sum(s.num_output_tokens for s in request.seqs),
            cached_prompt_tokens=request.seqs[0].num_cached_tokens,
        )

    def fail_all(self, exc: Exception) -> None:
        """Ends every request with an error (the step loop hit an unexpected failure)."""
        message = "".join(traceback.format_exception_only(exc)).strip()
        with self.lock:
            for request in list(self.requests.values()):
                self._fail(request, "error", message)

    def _fail_step(self, chunks: list[ScheduledChunk], exc: Exception) -> None:
        message = "".join(traceback.format_exception_only(exc)).strip()
        for request_id in dict.fromkeys(c.seq.request_id for c in chunks):
            request = self.requests.get(request_id)
            if request is not None:
                self._fail(request, "error", message)
        if self.runner.pool_lost():
            # The failed step consumed the donated pool: nothing cached in it survives.
            for request in list(self.requests.values()):
                self._fail(request, "error", message)
            self.runner.reset_pool()
            self.block_manager.reset()

    def _fail(self, request: Request, reason: FinishReason, error: str | None) -> None:
        for seq in request.seqs:
            if seq.index in request.final_sent:
                continue
            if not seq.finished:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
            request.sink(RequestOutput(
                request_id=request.request_id, index=seq.index, text="", token_ids=(), finish_reason=reason,
                usage=self._usage(request), error=error,
            ))
        self.requests.pop(request.request_id, None)
