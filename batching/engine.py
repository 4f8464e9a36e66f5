"""The engine: continuous batching over one model, stepped by one thread that alone owns its state.

A request's path: `submit` (any thread: builds and checks the request) -> the inbox -> `step` on the engine
thread: drain the inbox -> schedule -> dispatch -> collect the step before (append its tokens) -> emit text.
The host works one step ahead of what it knows (overlapped scheduling): a dispatched step's sampled tokens are
placeholders on their sequences (`Sequence.num_pending`) until the next step has been dispatched with them fed
on the device; the host then takes them in and detokenizes them while that step runs.
Requests, sequences, the scheduler, the block manager and the runner are touched by the engine thread only;
the outside sees them through the inbox (adds, aborts, LoRA loads and unloads), one delivery of increments per step,
and a stats snapshot published after each step. No lock is held anywhere.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import queue
import threading
import time
import traceback
import uuid
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import cached_property, partial
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from sluice.batching import step_broadcast
from sluice.batching.block_manager import BlockManager
from sluice.batching.kv_store import KVLayout, KVStore, PageKey
from sluice.batching.kv_pool import num_pool_pages, resolve_max_model_len
from sluice.batching.kv_transfer import PageCopy
from sluice.batching.lora_registry import LoraRegistry
from sluice.batching.config import EngineConfig, device_memory_bytes
from sluice.batching.compilation_cache import enable_compilation_cache
from sluice.batching.model_runner import ModelRunner
from sluice.batching.device_step import PromptScores
from sluice.batching.step_output import PendingStep, SequenceOutput, StepOutput
from sluice.batching.ngram import NgramConfig
from sluice.batching.outputs import Collector, Completion, Deliveries, FinishReason, Increment, ListCollector, \
    OutputSink, TokenLogprob, deliver
from sluice.batching.request import Request, RequestLimits, build_request
from sluice.batching.sampler import SamplerOutput, SamplerPlan
from sluice.batching.sampling_params import LoraRequest, RequestRejected, SamplingParams
from sluice.batching.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput, scored_rows
from sluice.batching.sequence import Sequence, SequenceStatus
from sluice.batching.speculation import Speculator
from sluice.batching.stats import EngineStats, StepStats, StepTotals
from sluice.batching.structured import GrammarCompiler, unmasked_prefixes
from sluice.model.loader import LoadedModel, load_model
from sluice.model.roofline import StepCost
from sluice.pallas_kernels.kv_cache import kv_cache_dtype
from sluice.sharding.mesh import InvalidTensorParallelism, make_mesh
from sluice.sharding.rules import param_sharding

logger = logging.getLogger(__name__)

EXIT_STEP_HUNG = 75  # sysexits' EX_TEMPFAIL: a supervisor should restart the server
HUNG_EXIT_GRACE_S = 1.0
# A decode step of hundreds of sequences allocates thousands of short-lived tuples and lists, nearly none in a
# cycle. At Python's default (700 allocations) the young generation is collected several times a step, and
# every tenth time the next one with it: about a tenth of the host's step (RESULTS.md, 2026-11-26).
GC_YOUNG_THRESHOLD = 10_000
NO_ALLOWED_TOKEN = "the grammar allows no token in allowed_token_ids here"


@dataclass(frozen=True)
class _Add:
    request: Request


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _AbortAll:
    """Aborts every request the engine holds."""


class _Stop:
    """Ends the step loop; what is left is aborted."""


@dataclass(frozen=True)
class _LoadLora:
    """Serves `lora` under its name, in place of any adapter of that name; `done` gives it."""

    lora: LoraRequest
    done: Future[LoraRequest]


@dataclass(frozen=True)
class _UnloadLora:
    """Stops serving LoRA adapter `name`; `done` once it is."""

    name: str
    done: Future[None]


_Command = _Add | _Abort | _AbortAll | _Stop | _LoadLora | _UnloadLora
"""What reaches the engine thread through its inbox."""


@dataclass(frozen=True)
class _Launched:
    """A dispatched step the host has not collected yet (`pending`: what ran), where each chunk's first sampled
    token goes in its sequence and how many placeholders it got there (0 for a chunk that drafts: how many it
    keeps is known only from its result), when its step began (`time.perf_counter()`) and the host time it took
    to schedule and dispatch."""

    first_indices: list[int]
    counts: list[int]
    pending: PendingStep
    stats: StepStats
    started: float
    host_s: float


def _describe(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(error)).strip()


class Engine:
    """Continuous-batching generation over one model: `submit`/`add_request` and `abort` from anywhere,
    `start` for a background step loop serving an event loop, or `generate` offline."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, *, progress: bool = True, mesh: Mesh | None = None,
                 warm_for: list[SamplingParams] | None = None):
        """`mesh`: the tensor-parallel mesh `loaded` was sharded onto (None: one device). `warm_for`: where the host
        decides the sampler's plans, warm-up compiles those of these parameters (default: greedy, plain sampling,
        and sampling with the model's own defaults); others compile off the engine thread when first met."""
        page_size_given = config.page_size is not None
        device = jax.local_devices()[0]  # what its allocator may hold is unknown on the CPU
        bytes_limit = (device.memory_stats() or {}).get("bytes_limit")
        self.config = config = config.with_device_defaults(
            device.platform, device_memory_bytes(device.platform, bytes_limit, os.environ), device.device_kind)
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.generation_defaults = loaded.generation_defaults  # the model's sampling defaults, for the API to apply
        self.loras = LoraRegistry.attach(loaded, config, mesh)  # before the pool is sized: adapters take memory too
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, loaded.model.dtype)
        num_pages = num_pool_pages(config, loaded.config, kv_dtype, mesh, page_size_given)
        self.max_model_len = resolve_max_model_len(config, loaded.config, num_pages)
        self.limits = RequestLimits(
            max_model_len=self.max_model_len, vocab_size=loaded.config.vocab_size,
            eos_token_ids=loaded.config.eos_token_ids)
        self.ngram = (NgramConfig(config.num_speculative_tokens, config.spec_ngram_min, config.spec_ngram_max,
                                  config.spec_max_batch_size) if config.speculative == "ngram" else None)
        enable_compilation_cache()
        self.runner = ModelRunner(
            loaded.model, num_pages=num_pages, page_size=config.page_size, max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            num_decode_steps=config.num_decode_steps,
            ngram=self.ngram,
            attention_backend=config.attention_backend, kv_dtype=kv_dtype, mesh=mesh, layer_loop=config.layer_loop,
            sampler_branches=config.sampler_branches,
        )
        self.prefix_store = (KVStore(KVLayout.of(loaded.config, model=f"{loaded.name}|{loaded.weights}",
                                                 quantization=config.quantization, dtype=loaded.model.dtype,
                                                 kv_dtype=kv_dtype, page_size=config.page_size),
                                     config.prefix_cache_dir, ram_bytes=config.prefix_cache_ram,
                                     disk_bytes=config.prefix_cache_size)
                             if config.prefix_cache_dir else None)
        self._saving: tuple[list[PageKey], PageCopy] | None = None  # pages on their way to the store, by key
        self.block_manager = BlockManager(num_pages, config.page_size, config.enable_prefix_caching,
                                          self.prefix_store)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens),
                                   self.block_manager, self.loras.slots)
        self.speculator = Speculator(self.ngram) if self.ngram else None
        self.step_cost = StepCost.of(loaded.config, loaded.model, kv_dtype)
        if config.warmup:
            if warm_for is None and self.generation_defaults:  # as most requests that leave their fields out sample
                sampled = {name: value for name, value in self.generation_defaults.items() if name != "max_tokens"}
                warm_for = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(**sampled)]
            plans = (None if warm_for is None else
                     list(dict.fromkeys(SamplerPlan.for_params(p, self.limits.vocab_size) for p in warm_for)))
            self.runner.warmup(progress, plans)
        # What exists now (model, compiled steps, tokenizer) lives as long as the engine: kept out of the cyclic
        # collector's full passes, which otherwise walk all of it and stall a step for milliseconds.
        gc.collect()
        gc.freeze()
        gc.set_threshold(max(gc.get_threshold()[0], GC_YOUNG_THRESHOLD), *gc.get_threshold()[1:])
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._arrivals = itertools.count()
        self._requests: dict[str, Request] = {}
        self._num_pooling = 0  # embedding requests in `_requests`: their steps fetch pooled rows
        self._num_scoring = 0  # requests in `_requests` that want prompt logprobs: their steps may score
        self._unemitted: dict[Sequence, None] = {}  # sequences with tokens not yet emitted, in append order
        self._in_flight: _Launched | None = None
        self._last_step: StepStats | None = None
        self._last_collected = 0.0  # `time.perf_counter()` when the last step was collected
        self._deliveries: Deliveries = []
        self._deliver: Callable[[Deliveries], None] = deliver
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._stopping = False
        self._aborting_all = False  # from `abort_all` to the step loop's end: each request is aborted as it arrives
        self._num_steps = 0
        self._num_step_failures = 0
        self.healthy = True  # False while the engine starts over after a failed step, and for good once one hangs
        self._step_began: float | None = None  # time.monotonic() of the step running now, for the watchdog
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._totals = StepTotals(config.max_num_seqs)
        self._stats = self._snapshot()

    @classmethod
    def create(cls, config: EngineConfig, *, progress: bool = True) -> Engine:
        """Loads the model, sizes the KV pool and compiles every step bucket."""
        if jax.process_count() > 1 and config.tp != jax.device_count():
            raise InvalidTensorParallelism(
                f"a {jax.process_count()}-process job serves one model over all its devices: "
                f"--tp must be {jax.device_count()}, got {config.tp}"
            )
        mesh = make_mesh(config.tp) if config.tp > 1 else None
        loaded = load_model(config.model, dtype=config.dtype, quantization=config.quantization,
                            chat_template=config.chat_template, hf_overrides=config.hf_overrides,
                            revision=config.revision, download_dir=config.download_dir,
                            sharding_rule=partial(param_sharding, mesh) if mesh is not None else None)
        return cls(loaded, config, progress=progress, mesh=mesh)

    # --- the outside: any thread --------------------------------------------------------------------

    def submit(self, prompts: list[list[int]], params: SamplingParams, sink: OutputSink, request_id: str) -> None:
        """Queues a request of `len(prompts) * n` choices whose increments go to `sink`.

        Raises RequestRejected now if it could never be served (context length, pool size, a structured output
        that does not compile, a LoRA adapter of a name not served). It runs with the adapter served under
        `params.lora`'s name when the engine thread takes it in (`LoraRegistry.bind`).
        """
        if params.lora is not None and params.lora.name not in self.loras.adapters:
            raise RequestRejected(f"the LoRA adapter {params.lora.name!r} is not served here", "lora")
        grammar = self.grammars.compile(params.structured) if params.structured is not None else None
        request = build_request(request_id, prompts, params, sink, self.tokenizer, self.limits, self.ngram,
                                grammar)
        self._inbox.put(_Add(request))

    @cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured output's compiler for this model's vocabulary, built on the first request that needs it
        (RequestRejected if llguidance cannot take the tokenizer)."""
        return GrammarCompiler(self.tokenizer, self.limits.vocab_size, self.limits.eos_token_ids)

    def add_request(self, prompts: list[list[int]], params: SamplingParams, request_id: str | None = None
                    ) -> Collector:
        """`submit` for the event loop the step loop was `start`ed from: iterate the collector for increments."""
        collector = Collector(request_id or uuid.uuid4().hex, len(prompts) * params.n)
        self.submit(prompts, params, collector, collector.request_id)
        return collector

    def abort(self, request_id: str) -> None:
        """Ends the request with "abort" at the next step and frees its pages; unknown ids are ignored."""
        self._inbox.put(_Abort(request_id))

    def abort_all(self) -> None:
        """`abort` for every request submitted so far, and for each submitted later until the step loop ends (a
        drain that ran out of time: a request still being built then, its grammar compiling, would run on until
        the server was stopped)."""
        self._inbox.put(_AbortAll())

    def load_lora(self, name: str, path: str) -> Future[LoraRequest]:
        """With runtime updating (`EngineConfig.allow_runtime_lora_updating`), serves the PEFT adapter at `path` (a
        folder, or a Hub id as `--lora-modules` takes one) as `name`, in place of any adapter of that name. Reads and
        lays out its files in this thread (CPU work: keep it off the event loop; `LoraRegistry.read` raises); the
        engine thread then serves it between two steps, and the future gives what its requests carry (a slot takes
        its weights when a sequence needs them: `batching.lora_slots`). Cancelled before the engine thread takes it,
        it is not served."""
        lora = self.loras.read(name, path)
        done: Future[LoraRequest] = Future()
        self._inbox.put(_LoadLora(lora, done))
        return done

    def unload_lora(self, name: str) -> Future[None]:
        """Stops serving LoRA adapter `name` (unknown names are ignored) when the engine thread takes it in, between
        two steps: the future is done then, and requests for it are rejected from then on. Those that run or wait
        finish with it (with --max-cpu-loras, one that waits only while its files stay in their folder: host memory
        drops its weights, read again off the engine thread should a slot need them: `LoraSlots.find`); its slot is
        another's to take once no running sequence uses it. Cancelled before the engine thread takes it, it serves
        on."""
        done: Future[None] = Future()
        self._inbox.put(_UnloadLora(name, done))
        return done

    @property
    def adapters(self) -> dict[str, LoraRequest]:
        """Each LoRA adapter served, by name -> what a request that runs with it carries (any thread)."""
        return self.loras.adapters

    # --- driving the loop -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the step loop in a worker thread; increments reach the collectors on this event loop."""
        if self._thread is not None:
            return
        loop = asyncio.get_running_loop()
        self._deliver = lambda deliveries: loop.call_soon_threadsafe(deliver, deliveries)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._thread.start()
        if self.config.step_timeout_s is not None:
            self._watchdog = threading.Thread(target=self._watch, args=(self._thread, self.config.step_timeout_s),
                                              name="sluice-watchdog", daemon=True)
            self._watchdog.start()

    async def shutdown(self) -> None:
        """Stops the step loop; what is left is aborted (by the engine thread, which owns it)."""
        if self._thread is not None:
            self._inbox.put(_Stop())
            await asyncio.to_thread(self._thread.join)
            if self._watchdog is not None:
                # It returns as the loop ends, and must be gone before this does: its target holds the engine, and
                # a daemon thread that drops an engine's last reference while the interpreter exits frees jax
                # arrays there, which aborts the process ("FATAL: exception not rethrown").
                await asyncio.to_thread(self._watchdog.join)
                self._watchdog = None
            self._thread = None
            self._deliver = deliver
        self.runner.stop_followers()
        self.close_store()

    def close_store(self) -> None:
        """Writes what the persistent prefix store holds in flight and stops its writer (no-op without one)."""
        if self.prefix_store is not None:
            self._store_pending_pages()
            self.prefix_store.close()

    def _store_pending_pages(self) -> None:
        """Hands the persistent prefix store the pages copied out at the last step and those still listed to
        save, which a next step would otherwise hand it: at shutdown, and when the loop goes idle."""
        while self.prefix_store is not None and (self._saving is not None or self.block_manager.saves):
            self._save_pages()

    def follow(self) -> None:
        """Processes other than 0 of a multi-process job: replays process 0's steps until its `shutdown`."""
        self.runner.follow()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[list[Completion]]:
        """Offline: runs all prompts to completion in this thread; result[i][j] is prompt i's sample j.

        Not to be mixed with a started step loop on the same engine.
        """
        if self._thread is not None:
            raise RuntimeError("generate() cannot run while the step loop is started")
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        if len(all_params) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        collectors = [ListCollector(p.n) for p in all_params]
        for prompt, p, collector in zip(prompts, all_params, collectors):
            self.submit([list(prompt)], p, collector, f"offline-{uuid.uuid4().hex}")
        while self.has_work:
            self.step()
        return [collector.completions() for collector in collectors]

    @property
    def stats(self) -> EngineStats:
        """The engine's counters as of its last step, and the persistent prefix store's as of now: its writer
        goes on writing pages while the loop is idle."""
        if self.prefix_store is None:
            return self._stats
        return replace(self._stats, prefix_store=self.prefix_store.counters())

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None or not self._inbox.empty()

    def _run(self) -> None:
        while not self._stopping:
            idle = not self.has_work
            self._step_began = None if idle else time.monotonic()
            try:
                if idle:
                    self._apply(self._inbox.get())  # sleeps until there is something to do
                    self._flush()  # a request it ended (one added after `abort_all`) hears so now
                else:
                    self.step()
                    if not self.has_work:  # no next step will hand the store the pages this one copied out
                        self._store_pending_pages()
            except Exception as error:  # noqa: BLE001 - a bug must not leave clients waiting forever
                logger.exception("engine step failed")
                self._start_over(error)
            self._step_began = None
        self._in_flight = None
        self._abort_all()
        self._flush()
        self._aborting_all = False  # `abort_all` was this loop's: a loop started again, or `generate`, serves

    def _watch(self, engine_thread: threading.Thread, timeout_s: float) -> None:
        """The watchdog: a step that runs past `timeout_s` (a hung kernel) cannot be interrupted, so every request
        in flight ends with an error, /health turns 503, and the process exits with EXIT_STEP_HUNG for its
        supervisor to restart it. It reads the engine's requests from this thread: their owner is stuck."""
        while engine_thread.is_alive():
            began = self._step_began
            if began is not None and time.monotonic() - began > timeout_s:
                break
            engine_thread.join(min(1.0, timeout_s / 10))  # returns at once when the loop ends
        else:
            return
        self.healthy = False
        launched = self._in_flight  # read once: the step may end meanwhile
        shape = launched.pending.bucket if launched is not None else "none (hung while dispatching)"
        message = f"the engine's step ran past --step-timeout ({timeout_s:g} s); the server restarts"
        logger.critical("a step ran past --step-timeout (%g s); step in flight: %s; ending every request and "
                        "exiting with %d", timeout_s, shape, EXIT_STEP_HUNG)
        self._deliver([(request.sink, Increment(seq.choice, "", (), finish_reason="error", error=message))
                       for request in list(self._requests.values()) for seq in request.seqs
                       if seq.choice not in request.finished_choices])
        time.sleep(HUNG_EXIT_GRACE_S)  # for the event loop to send the errors
        os._exit(EXIT_STEP_HUNG)

    # --- one step (engine thread) ---------------------------------------------------------------------

    def step(self) -> None:
        """Schedule and dispatch a step -> collect the step before: append its tokens, emit their text.

        Overlapped (the default), the step before is still on the device when this one is dispatched: its
        sampled tokens feed this one there, and the host takes them in while this one runs. Grammar masks, which
        need those tokens, are filled then and this step's sampling dispatched after its model. When the host
        needs them to build this step (drafts, penalty histories) or overlap is off, the step before is collected
        first, and this one's tokens right after it ran. A failure in a device step ends that step's requests; a
        failure in one request's host work ends that request only.
        """
        start = time.perf_counter()
        while not self._inbox.empty():
            self._apply(self._inbox.get_nowait())
        overlap = self._overlaps()
        if not overlap:
            self._collect()
        launched = self._launch(start, masks_later=overlap)
        if overlap:
            if not self._collect():
                launched = None  # fed from the failed step, on a pool that is gone
            elif launched is not None:
                launched = self._sample(launched)
        self._in_flight = launched
        if not overlap:
            self._collect()  # and its stop strings searched: a sequence they end is not scheduled again
        self._flush()
        self._num_steps += 1
        self._stats = self._snapshot()

    def _overlaps(self) -> bool:
        """Whether this step may be dispatched before the host has the previous step's tokens: only if nothing
        it builds needs them (a draft, a penalty's token history; the other processes of a multi-process job
        replay steps from host inputs alone). A grammar's mask needs them only for the sampling, which then
        waits for them, but the tokens a grammar forces are sampled a step each instead of appended at once
        (`_append_forced`): a batch mostly under grammars that force tokens is collected first, and so is one whose
        grammar rows could then join a multi-step call (`_draws_unmasked`), and the call they join."""
        if not self.config.async_scheduling or self.speculator is not None or step_broadcast.is_multiprocess():
            return False
        launched = self._in_flight
        if launched is not None and launched.pending.limits is not None and any(
                chunk.seq.grammar is not None for chunk in launched.pending.chunks):
            return False  # a multi-step call whose grammar rows' tokens the host checks first (`_draws_unmasked`)
        running = self.scheduler.running
        if any(seq.params.reads_history for seq in running):
            return False
        forcing = sum(seq.grammar is not None and not seq.params.structured.mostly_free for seq in running)
        if 2 * forcing > len(running):
            return False
        # Collected first, grammar rows may join a multi-step call.
        return not (any(seq.grammar is not None for seq in running) and self._may_run_multi_step(running, True))

    def _launch(self, start: float, masks_later: bool) -> _Launched | None:
        """Schedules and dispatches a step; None if there is nothing to run (or it failed at once). `masks_later`:
        its grammar masks wait for `PendingStep.sample` (`ModelRunner.dispatch`)."""
        if self.speculator is not None:
            running = self.scheduler.running
            if self._may_run_multi_step(running):
                self.speculator.clear(running)  # drafts ride inside the multi-step call (`_multi_step_call`)
            else:
                prefills = (any(seq.num_uncomputed_tokens > 1 for seq in running)
                            or bool(self.scheduler.waiting) and len(running) < self.config.max_num_seqs)
                self.speculator.propose(running, self.max_model_len, prefills)
        if self.loras.slots is not None:  # before scheduling: a read taken in then could drop weights a write needs
            for lora, error in self.loras.slots.take_in():  # a failed read ends the requests waiting for it
                self._fail_requests([seq for seq in self.scheduler.waiting if seq.params.lora is lora], error)
        scheduled = self.scheduler.schedule()
        self._note_queue_waits(scheduled)
        chunks = scheduled.chunks
        if self.loras.slots is not None and self.loras.slots.writes:  # adapters this step swaps in
            chunks = self._write_lora_slots(chunks)
        if self.block_manager.loads:  # the store's pages, into the pool before the step reads them
            pages, payloads = zip(*self.block_manager.loads)
            self.block_manager.loads.clear()
            self.runner.load_pages(list(pages), list(payloads))
        if not chunks:
            return None
        try:
            pending = self.runner.dispatch(chunks, *self._multi_step_call(chunks), self._num_pooling > 0,
                                           self._num_scoring > 0, masks_later)
        except Exception as error:  # noqa: BLE001 - the loop must keep serving other requests
            self._start_over(error)
            return None
        # What ran (`pending.limits`): a multi-step call may run as one step meanwhile.
        stats = StepStats.of(chunks, pending.limits, self.step_cost)  # before the chunks' sequences move on
        return _Launched(*self._mark_dispatched(pending), pending, stats, start, time.perf_counter() - start)

    def _sample(self, launched: _Launched) -> _Launched | None:
        """Dispatches the launched step's sampling if it waited for its grammar masks (`PendingStep.sample`);
        None if that failed."""
        try:
            launched.pending.sample()
        except Exception as error:  # noqa: BLE001 - as a failed dispatch
            self._start_over(error)
            return None
        return launched

    @staticmethod
    def _mark_dispatched(pending: PendingStep) -> tuple[list[int], list[int]]:
        """Moves each chunk's sequence past what the step computes, its sampled tokens as placeholders, so the
        next step can be scheduled before they arrive. Returns where each chunk's first sampled token goes, and
        how many placeholders it got. How many tokens a verification keeps is known only from its result, and so
        is how many a multi-step call's grammar rows keep (`_draws_unmasked`): those sequences move on then."""
        first_indices, counts = [], []
        verifying = pending.drafting is not None
        multi_step = pending.limits is not None
        for chunk, limit in zip(pending.chunks, pending.limits or itertools.repeat(1)):
            seq = chunk.seq
            if chunk.num_drafts or verifying or multi_step and seq.grammar is not None:
                first_indices.append(len(seq.token_ids))
                counts.append(0)
                continue
            count = limit if chunk.sample else 0
            seq.num_computed_tokens = chunk.start + chunk.num_tokens + max(count - 1, 0)
            first_indices.append(seq.add_pending(count))
            counts.append(count)
        return first_indices, counts

    def _collect(self) -> bool:
        """Takes in the step in flight: appends each sequence's tokens (until it ends), emits their text and
        caches its pages. False if the step failed (the engine started over)."""
        launched = self._in_flight  # kept there while it is fetched, for the watchdog to name
        if launched is None:
            return True
        try:
            result = launched.pending.fetch()
        except Exception as error:  # noqa: BLE001
            self._start_over(error)
            return False
        self._in_flight = None
        arrived = time.perf_counter()
        chunks = launched.pending.chunks
        if result.pooled is not None:
            self._pool(chunks, result.pooled)
        if result.scores is not None:
            self._score_prompts(chunks, result.scores)
        verified = launched.pending.drafting is not None
        checked = self._check_unmasked(launched.pending, result)
        left: Iterable[int] = range(len(chunks))
        if self.speculator is None and result.sampled.top_ids is None:  # no chunk drafts or wants logprobs
            left = self._append_decoded(launched, *result.runs())
        for i in left:
            chunk, output, index = chunks[i], checked.get(i) or result.share(i), launched.first_indices[i]
            seq = chunk.seq
            drafted = chunk.num_drafts or verified or i in checked
            if drafted and seq.status is SequenceStatus.RUNNING:  # the K/V of rejected drafts is not the sequence's
                kept = len(output.tokens) if output is not None else 0
                # Its last kept token is computed by the next step; none kept (a grammar row's first token did not
                # stand), the token before them is again.
                seq.num_computed_tokens = (chunk.start + chunk.num_tokens - chunk.num_drafts
                                           + (kept - 1 if i in checked else max(kept - 1, 0)))
            if output is not None and seq.status is not SequenceStatus.FINISHED:
                try:
                    if output.finite:
                        self._append_output(seq, output, index, result.sampled)
                    elif self._no_token_allowed(seq):
                        self._end_choice(self._requests[seq.request_id], seq, "error", NO_ALLOWED_TOKEN)
                    else:
                        self._not_finite(seq, "logits")
                except Exception as error:  # noqa: BLE001 - one request's failure is its own
                    self._fail_request(seq.request_id, error)
                if self.speculator is not None:
                    self._count_drafts(seq, output)
            elif output is not None and not output.finite:  # ended (an abort) while its step ran: suspect all the same
                self._forget_pages(seq)
            if seq.status is SequenceStatus.RUNNING:
                if drafted:
                    self.block_manager.shrink(seq, seq.num_tokens)  # pages reserved for rejected drafts
                self.block_manager.commit(seq)
        self._emit_text()  # before any next collect: `_append_decoded` sends a run only after all before it
        self._flush()
        if self.prefix_store is not None:
            self._save_pages()
        end = time.perf_counter()
        # Overlapped, this step was dispatched before the last one was collected: that time is the last one's.
        self._last_step = replace(launched.stats, duration_s=end - max(launched.started, self._last_collected),
                                  host_s=launched.host_s + end - arrived)
        self._last_collected = end
        self._totals.add_step(self._last_step)
        return True

    def _append_decoded(self, launched: _Launched, runs: list[list[int]], nonfinite: list[bool]) -> list[int]:
        """Appends and emits, in one pass, the tokens of each sequence that just goes on decoding (a decode step's
        common case, at hundreds of sequences): over its placeholders, its newly full pages committed, its text
        sent (or, with stop strings to search it for, left to `_emit_text`). `runs`, `nonfinite`:
        `StepOutput.runs` of a step in which no chunk drafts or wants logprobs. Returns the indices of the chunks
        left to `_append_output`: those with a token that may end their sequence (a stop id, the last allowed,
        logits not finite), a sequence's first output token, a chunk that samples nothing, and sequences that no
        longer run or have a grammar."""
        chunks = launched.pending.chunks
        left = []
        num_appended = 0
        max_model_len = self.max_model_len
        commit = self.block_manager.commit
        unemitted, requests, deliveries = self._unemitted, self._requests, self._deliveries
        for i, (chunk, index, count, run, failed) in enumerate(zip(chunks, launched.first_indices, launched.counts,
                                                                   runs, nonfinite)):
            seq = chunk.seq
            end = index + count
            tokens = run if count == len(run) else run[:count]
            if (failed or not count or seq.status is not SequenceStatus.RUNNING or seq.grammar is not None
                    or end >= seq.max_num_tokens or end >= max_model_len or index == len(seq.prompt_ids)
                    or not seq.stop.stop_ids.isdisjoint(tokens)):
                left.append(i)
                continue
            seq.token_ids[index:end] = tokens  # over its placeholders: a running sequence keeps them
            seq.num_pending -= count
            num_appended += count
            commit(seq)
            if seq.stop.params.stop:  # its text is searched for stop strings, and held back: `_emit_text`
                unemitted[seq] = None
                continue
            try:  # all its tokens are emitted at each step: these are the ones since
                text = seq.stop.emit_run(tokens, None)[0]
            except Exception as error:  # noqa: BLE001 - one request's failure is its own
                self._fail_request(seq.request_id, error)
                continue
            deliveries.append((requests[seq.request_id].sink, Increment(seq.choice, text, tuple(tokens))))
        self._generation_tokens_total += num_appended
        return left

    def _save_pages(self) -> None:
        """Hands the store the pages copied out at the step before (their copy is done by now), and starts copying
        out the pages newly full at this one (`BlockManager.saves`)."""
        if self._saving is not None:
            keys, copy = self._saving
            for key, payload in zip(keys, copy.payloads()):
                self.prefix_store.put(key, payload)
            self._saving = None
        if self.block_manager.saves:
            pages, keys = zip(*self.block_manager.saves)
            self.block_manager.saves.clear()
            self._saving = list(keys), self.runner.copy_out(list(pages))

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _Add):
            request = command.request
            lora = request.seqs[0].params.lora
            if request.request_id in self._requests:
                self._reject(request, f"request id {request.request_id!r} is already in use")
                return
            if lora is not None and lora.name not in self.loras.adapters:
                self._reject(request, f"the LoRA adapter {lora.name!r} was unloaded before the request started")
                return
            # Before any page is allocated or looked up: the prefix cache's namespace is that of the weights run with.
            bound = self.loras.bind(request.seqs[0].params)
            for seq in request.seqs:
                seq.params = bound
            self._requests[request.request_id] = request
            self._num_pooling += request.seqs[0].params.pooling is not None
            self._num_scoring += request.seqs[0].params.prompt_logprobs is not None
            arrival = next(self._arrivals)
            now = time.perf_counter()
            for seq in request.seqs:
                seq.arrive(arrival, now)
                self.scheduler.add(seq)
            if self._aborting_all:
                self._finish(request, "abort", None)
        elif isinstance(command, _Abort):
            request = self._requests.get(command.request_id)
            if request is not None:
                self._finish(request, "abort", None)
        elif isinstance(command, _AbortAll):
            self._aborting_all = True
            self._abort_all()
        elif isinstance(command, _LoadLora):
            if command.done.set_running_or_notify_cancel():  # not if its caller cancelled it first
                self.loras.serve(command.lora)
                command.done.set_result(command.lora)
        elif isinstance(command, _UnloadLora):
            if command.done.set_running_or_notify_cancel():
                self.loras.unload(command.name)
                command.done.set_result(None)
        else:
            self._stopping = True

    def _abort_all(self) -> None:
        for request in list(self._requests.values()):
            self._finish(request, "abort", None)

    def _note_queue_waits(self, scheduled: SchedulerOutput) -> None:
        now = time.perf_counter()
        self._totals.add_admitted(scheduled.admitted, now)
        for seq in scheduled.preempted:
            seq.queued_at = now

    def _reject(self, request: Request, message: str) -> None:
        """Ends each choice of `request`, which never ran, with the error `message`."""
        for seq in request.seqs:
            self._deliveries.append((request.sink, Increment(seq.choice, "", (), finish_reason="error", error=message)))

    def _write_lora_slots(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """Writes the adapters swapped in into their slots (`LoraRegistry.write_slots`), ordered before the step
        dispatched next (the steps in flight read the old ones); returns the `chunks` left to run. A slot whose
        write failed ends the requests of the sequences just admitted into it (they alone use it) with the error,
        and no other."""
        for slot, error in self.loras.write_slots(self.runner.write_layer_rows):
            self._fail_requests([seq for seq in self.scheduler.running if seq.lora_slot == slot], error)
        return [chunk for chunk in chunks if not chunk.seq.finished]

    def _may_run_multi_step(self, seqs: list[Sequence], ahead: bool = False) -> bool:
        """Whether `seqs` may share a multi-step call: nothing waits (a waiting request would wait the whole call
        for its first step) and each has one token left to compute and no grammar, or one whose tokens the call may
        draw without its mask (its mask for the next token needs the token before, which only the host's matcher
        can take in). `ahead`: as far as the host can tell before it has taken in the step in flight."""
        return (self.config.num_decode_steps > 1 and not self.scheduler.waiting and self._inbox.empty()
                and all(seq.num_uncomputed_tokens == 1 for seq in seqs)
                and all(self._draws_unmasked(seq, ahead) for seq in seqs if seq.grammar is not None))

    def _draws_unmasked(self, seq: Sequence, ahead: bool = False) -> bool:
        """Whether a multi-step call may draw `seq`'s tokens without its grammar's mask: its grammar, one that
        leaves most of the text free or a reasoning model's thought before it, leaves the text free for now
        (`Grammar.allows_free_text`), and the host, which has taken in all its tokens (not so `ahead`), then keeps
        those drawn while it did (`_check_unmasked`). Not with drafts, or for logprobs (the mask's). Nor for a seeded
        sampling row: a token drawn from the whole distribution, and one drawn under the mask from its share, are
        the same in distribution (a refused one falls, and the next is drawn under the mask), but not for the same
        seed, and a seeded request's tokens must not depend on whether the load let it into a multi-step call."""
        params, structured = seq.params, seq.params.structured
        return (self.speculator is None and (structured.mostly_free or structured.preamble is not None)
                and (params.seed is None or params.temperature == 0)
                and not params.wants_logprobs and (ahead or not seq.num_pending) and not seq.grammar.masked_next
                and seq.grammar.allows_free_text())

    def _check_unmasked(self, pending: PendingStep, result: StepOutput) -> dict[int, SequenceOutput]:
        """The shares of a multi-step call's grammar rows, drawn without their masks, cut to the tokens that stand
        (`unmasked_prefixes`), by chunk index. If the check raises, the rows' requests end with the error, and no
        other: the step itself went well."""
        if pending.limits is None:
            return {}
        rows = {i: (chunk.seq.grammar, output) for i, chunk in enumerate(pending.chunks)
                if chunk.seq.grammar is not None and chunk.seq.status is SequenceStatus.RUNNING
                and (output := result.share(i)) is not None and output.finite}
        try:
            standing = unmasked_prefixes([(grammar, output.tokens) for grammar, output in rows.values()])
        except Exception as error:  # noqa: BLE001 - the grammars' failure is their requests' own
            self._fail_requests([pending.chunks[i].seq for i in rows], error)
            return {}
        return {i: output._replace(tokens=output.tokens[:count])
                for (i, (_, output)), count in zip(rows.items(), standing)}

    def _multi_step_call(self, chunks: list[ScheduledChunk]) -> tuple[list[int] | None, list[int] | None]:
        """(tokens each sequence may emit, the most drafts each checks at a step) for a multi-step call, or
        (None, None) for a single step; drafting None when no sequence drafts. A call needs sequences that may
        share one (`_may_run_multi_step`), each decoding one token, and the pool's pages for all they may emit."""
        steps = self.config.num_decode_steps
        seqs = [c.seq for c in chunks]
        if not self._may_run_multi_step(seqs) or any(c.num_tokens != 1 or not c.sample for c in chunks):
            return None, None
        drafting = None if self.speculator is None else self.speculator.propose_for_call(seqs)
        # A request's max_tokens fits the context (`check_fits`), so it bounds each sequence's tokens alone.
        limits = [min(steps * (1 + num_drafts), seq.params.max_tokens - seq.num_output_tokens)
                  for seq, num_drafts in zip(seqs, drafting or itertools.repeat(0))]
        if 0 in limits or not self.scheduler.reserve_lookahead(chunks, limits):  # 0: an embedding's (max_tokens 0)
            return None, None
        return limits, drafting

    def _pool(self, chunks: list[ScheduledChunk], pooled: np.ndarray) -> None:
        """Adds each embedding's chunk's pooled row (`StepOutput.pooled`) to its sum, restarted by a chunk from its
        first token (a preempted sequence recomputes); at its prompt's end, sends the sum and ends the sequence."""
        for chunk, row in zip(chunks, pooled):
            seq = chunk.seq
            if seq.params.pooling is None or seq.finished:
                continue
            if not np.isfinite(row).all():
                self._not_finite(seq, "hidden states")
                continue
            seq.pooled = row if seq.pooled is None or not chunk.start else seq.pooled + row
            if chunk.sample:
                self.block_manager.commit(seq)
                seq.finish_reason = "stop"
                self.scheduler.finish(seq)
                self._prompt_tokens_total += seq.num_prompt_tokens
                self._send(self._requests[seq.request_id],
                           Increment(seq.choice, "", (), finish_reason="stop", embedding=seq.pooled))

    def _score_prompts(self, chunks: list[ScheduledChunk], scores: PromptScores) -> None:
        """Each scored prompt token's logprob, with the best alternatives its sequence asks for, into the
        sequence's `prompt_logprobs` (`ScheduledChunk.num_scored`; a recomputed prefill scores them again)."""
        for chunk, rows in scored_rows(chunks):
            seq, k = chunk.seq, chunk.seq.params.prompt_logprobs
            if seq.finished:
                continue
            if not np.isfinite(scores.logprobs[rows]).all():
                self._not_finite(seq, "prompt logprobs")
                continue
            logprobs, ranks = scores.logprobs[rows].tolist(), scores.ranks[rows].tolist()
            top_ids, top_logprobs = scores.top_ids[rows, :k].tolist(), scores.top_logprobs[rows, :k].tolist()
            for j in range(chunk.num_scored):
                position = chunk.start + 1 + j
                seq.prompt_logprobs[position] = TokenLogprob(seq.prompt_ids[position], logprobs[j],
                                                             tuple(zip(top_ids[j], top_logprobs[j])), ranks[j])

    def _append_output(self, seq: Sequence, output: SequenceOutput, index: int, sampled: SamplerOutput) -> None:
        """Appends a step's tokens for `seq` from `index` on (over its placeholders) up to where it ends; then, for
        a sequence with a grammar, the tokens the grammar forces."""
        logprobs = ([self._logprob(seq, token, sampled, step, row)
                     for token, (step, row) in zip(output.tokens, output.positions)]
                    if output.positions and seq.params.wants_logprobs else [])
        self._append(seq, index, output.tokens, logprobs)
        if seq.grammar is not None and not seq.params.wants_logprobs and not seq.num_pending:
            self._append_forced(seq)

    @staticmethod
    def _logprob(seq: Sequence, token: int, sampled: SamplerOutput, step: int, row: int) -> TokenLogprob:
        """The token's logprobs. Top alternatives a grammar ruled out (logprob -inf) are not reported."""
        k = seq.params.top_logprobs
        ids, values = sampled.top_ids[step, row, :k], sampled.top_logprobs[step, row, :k]
        top = tuple((int(t), float(lp)) for t, lp in zip(ids, values) if lp > float("-inf"))
        return TokenLogprob(token, float(sampled.logprobs[step, row]), top)

    def _count_drafts(self, seq: Sequence, output: SequenceOutput) -> None:
        """The speculator's counters and the sequence's acceptance, from what its drafts did (or, when it drafted
        none, whether its first token matched the draft it would have checked)."""
        for checked, accepted in output.verifications:
            self.speculator.record(seq, checked, accepted)
        if not output.verifications and output.tokens:
            self.speculator.check_shadow(seq, output.tokens[0])

    def _append_forced(self, seq: Sequence) -> None:
        """Appends the tokens the sequence's grammar forces, one allowed token at a time (`Grammar.forced_token`):
        the next step computes them in one chunk instead of a step each. Left to the sampler, as every forced token
        is for a sequence with a token in flight (overlapped: its next row's mask allows that token alone): a stop
        id (its min_tokens rule), and a token allowed_token_ids excludes (the row samples none:
        `_no_token_allowed`). A request that wants logprobs never gets here (they come from the model)."""
        while seq.status is SequenceStatus.RUNNING:
            token = seq.grammar.forced_token()
            if token is None or token in seq.stop.stop_ids or not seq.params.allows(token):
                return
            self._append(seq, seq.num_tokens, [token], [])

    def _append(self, seq: Sequence, index: int, tokens: list[int], logprobs: list[TokenLogprob]) -> None:
        """Places tokens from `index` on (advancing the sequence's grammar) up to the first whose id or count ends
        the sequence, and ends it there (dropping the placeholders after it)."""
        if not tokens:
            return
        num_prompt_tokens = len(seq.prompt_ids)
        count, finish = seq.stop.run_finish(tokens, index - num_prompt_tokens, self.max_model_len - index)
        if seq.grammar is not None:
            count, finish = self._advance_grammar(seq, tokens[:count], finish)
        kept = tokens if count == len(tokens) else tokens[:count]
        seq.place(index, kept)
        self._generation_tokens_total += count
        if index == num_prompt_tokens and seq.parent is None:
            self._prompt_tokens_total += num_prompt_tokens
        if seq.proposer is not None:
            seq.proposer.extend(kept)
        if logprobs:
            seq.logprobs += logprobs[:count]
        if finish is not None:
            seq.finish_reason = finish
            seq.truncate(index + count)
            # No page caches its last token's K/V unless a step was dispatched that feeds it: overlapped, the next
            # step feeds the call's last token, but a multi-step call stops a row without feeding its stop id.
            fed = count == len(tokens) and seq.num_computed_tokens >= index + count
            seq.num_computed_tokens = min(seq.num_computed_tokens, index + count if fed else index + count - 1)
            self.block_manager.commit(seq)  # pages its last step filled, before they are freed
            self.scheduler.finish(seq)
        self._unemitted[seq] = None

    @staticmethod
    def _no_token_allowed(seq: Sequence) -> bool:
        """Whether `seq`'s grammar and its allowed_token_ids have no token in common next: the request's own
        contradiction, for which its row samples none, as a row does whose logits are not finite."""
        allowed = seq.params.allowed_token_ids
        return seq.grammar is not None and bool(allowed) and not seq.grammar.allows_any(allowed)

    def _advance_grammar(self, seq: Sequence, tokens: list[int], finish: FinishReason | None
                         ) -> tuple[int, FinishReason | None]:
        """Advances `seq`'s grammar over `tokens` (those it keeps, ending with `finish`) up to an EOS that ends the
        sequence ("stop"): one that is a stop id of the sequence (where its stop checker ends it, or before
        min_tokens, whose ban of stop ids the sampler lifts only where the row may take nothing else), or one where
        the grammar is finished (it allows nothing else, with ignore_eos too). Any other EOS (with ignore_eos, where
        the grammar could go on: the free answer after a thinking budget) is a token like any other, which the
        grammar does not take (`Grammar`). Returns how many tokens it keeps, and its finish."""
        for j, token in enumerate(tokens):
            if token not in self.limits.eos_token_ids:
                seq.grammar.advance(token)
            elif token in seq.stop.stop_ids or seq.grammar.finished():
                return j + 1, "stop"
        return len(tokens), finish

    def _emit_text(self) -> None:
        """Detokenizes the tokens appended since the last call and checks stop strings: one increment per
        sequence with all its new tokens. A stop string ends its sequence (its tokens after that one, on the host
        or still on the device, are dropped)."""
        unemitted, self._unemitted = self._unemitted, {}
        for seq in unemitted:
            request = self._requests.get(seq.request_id)
            if request is not None and seq.choice not in request.finished_choices:
                try:
                    self._emit(request, seq)
                except Exception as error:  # noqa: BLE001
                    self._fail_request(request.request_id, error)

    def _emit(self, request: Request, seq: Sequence) -> None:
        """Sends the sequence's known tokens past those its stop checker has seen, with the finish its last one
        forces by id or count (`_append`), or a stop string's."""
        start = len(seq.prompt_ids) + seq.stop.num_output_tokens
        tokens = seq.token_ids[start:seq.num_known_tokens]
        finished = seq.finished
        text, count, finish_reason = seq.stop.emit_run(tokens, seq.finish_reason if finished else None)
        if count < len(tokens) or finish_reason is not None and not finished:
            # A stop string: tokens sampled after its token (a multi-step call's, or the next step's) are dropped,
            # never emitted.
            end = start + count
            self._generation_tokens_total -= seq.num_known_tokens - end
            seq.truncate(end)
            seq.finish_reason = finish_reason
            if not finished:
                self.scheduler.finish(seq)
            del tokens[count:]
        logprobs = ()
        if seq.logprobs:
            logprobs, seq.logprobs = tuple(seq.logprobs[:count]), []
        prompt_logprobs = None
        if seq.prompt_logprobs is not None:  # its first increment
            prompt_logprobs, seq.prompt_logprobs = tuple(seq.prompt_logprobs), None
        self._send(request, Increment(seq.choice, text, tuple(tokens), logprobs, finish_reason,
                                      stop_reason=seq.stop.stop_reason, prompt_logprobs=prompt_logprobs))

    def _send(self, request: Request, increment: Increment) -> None:
        if increment.finish_reason is not None:
            request.finished_choices.add(increment.choice)
            if request.finished:
                increment = increment._replace(usage=request.usage())
                del self._requests[request.request_id]
                self._num_pooling -= request.seqs[0].params.pooling is not None
                self._num_scoring -= request.seqs[0].params.prompt_logprobs is not None
        self._deliveries.append((request.sink, increment))

    def _flush(self) -> None:
        if self._deliveries:
            deliveries, self._deliveries = self._deliveries, []
            self._deliver(deliveries)

    # --- failures -----------------------------------------------------------------------------------

    def _forget_pages(self, seq: Sequence) -> None:
        """Takes `seq`'s pages out of the prefix cache and the persistent store: its logits were not finite, so the
        K/V it wrote may not be either, and no later request may read it (across restarts neither)."""
        self.block_manager.uncache(seq)
        if self.prefix_store is not None and seq.num_stored_pages:
            self._store_pending_pages()  # so that none of its pages reaches the store after it is forgotten
            self.prefix_store.forget(seq.store_keys[:seq.num_stored_pages])
            for waiting in self.scheduler.waiting:  # pages read for them before are read again (or missed)
                waiting.stored_prefix = None

    def _not_finite(self, seq: Sequence, what: str) -> None:
        """`seq`'s step computed `what` not finite (NaN or inf): its pages are forgotten, and its request alone ends
        with the error."""
        self._forget_pages(seq)
        self._fail_request(seq.request_id, FloatingPointError(f"the model's {what} for this sequence were not finite"))

    def _fail_request(self, request_id: str, error: Exception) -> None:
        """One request's host work raised: that request alone ends with the error."""
        logger.exception("request %s failed", request_id, exc_info=error)
        request = self._requests.get(request_id)
        if request is not None:
            self._finish(request, "error", _describe(error))

    def _fail_requests(self, seqs: list[Sequence], error: Exception) -> None:
        """The requests `seqs` belong to end with the error, each once."""
        for request_id in dict.fromkeys(seq.request_id for seq in seqs):
            self._fail_request(request_id, error)

    def _start_over(self, error: Exception) -> None:
        """A step failed (on the device, or a bug in the engine): what it wrote to the pool and fed to the steps
        after it is suspect, so every request that has run ends with the error (those still waiting for their first
        step wait on), and the engine starts over in-process with an empty pool (the prefix cache too). Unhealthy
        meanwhile."""
        self.healthy = False
        logger.error("step failed; ending every request in flight and starting over: %s", _describe(error))
        self._num_step_failures += 1
        self._in_flight = None
        self._saving = None
        for request in list(self._requests.values()):
            # A request none of whose sequences has run yet read nothing the failed step wrote: it waits on.
            if any(seq.status is not SequenceStatus.WAITING or seq.num_output_tokens for seq in request.seqs):
                self._finish(request, "error", _describe(error))
        self._unemitted.clear()
        self._flush()
        self.runner.reset()
        self.block_manager.reset()
        self.healthy = True

    def _finish(self, request: Request, reason: FinishReason, error: str | None) -> None:
        """Ends every unfinished choice of `request` with `reason` and frees their pages now."""
        for seq in request.seqs:
            if seq.choice not in request.finished_choices:
                self._end_choice(request, seq, reason, error)

    def _end_choice(self, request: Request, seq: Sequence, reason: FinishReason, error: str | None) -> None:
        """Ends `seq`, an unfinished choice of `request`, with `reason` and frees its pages now."""
        if not seq.finished:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
        self._send(request, Increment(seq.choice, "", (), finish_reason=reason, error=error))

    # --- statistics ---------------------------------------------------------------------------------

    def _snapshot(self) -> EngineStats:
        pool = self.block_manager.counters()
        num_requests_running, num_requests_waiting = self.scheduler.num_requests()
        return EngineStats(
            num_requests_running=num_requests_running,
            num_requests_waiting=num_requests_waiting,
            num_seqs_running=len(self.scheduler.running),
            num_seqs_waiting=len(self.scheduler.waiting),
            kv_pages_used=pool.pages_used,
            kv_pages_total=pool.pages_total,
            prefix_cache_hit_tokens=pool.prefix_cache_hit_tokens,
            prefix_cache_query_tokens=pool.prefix_cache_query_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_steps=self._num_steps,
            num_step_failures=self._num_step_failures,
            last_step=self._last_step,
            spec=self.speculator.counters() if self.speculator is not None else None,
            busy_s=self._totals.busy_s,
            flops=self._totals.flops,
            bytes=self._totals.bytes,
            decode_batch_steps=tuple(self._totals.decode_batch_steps),
            queue_wait_s=self._totals.queue_wait_s,
            num_admitted=self._totals.num_admitted,
            **self.loras.stats(self.scheduler.running, self.scheduler.waiting),
        )
