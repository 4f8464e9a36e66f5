"""`Engine`: the asyncio front of the engine core, and the offline `generate` helper.

The step loop runs in a worker thread so device steps never block the event loop; each request's outputs
travel back to its async iterator through the loop's thread-safe callback queue.
"""

from __future__ import annotations

import asyncio
import random
import threading
import uuid
from dataclasses import replace
from functools import partial
from typing import AsyncIterator

import jax
from jax.sharding import Mesh

from batching.block_manager import BlockManager
from batching.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from batching.core import EngineCore, EngineStats
from batching.model_runner import MAX_BANNED_IDS, ModelRunner, enable_compilation_cache
from batching.request_output import RequestOutput
from batching.sampling_params import SamplingParams
from batching.scheduler import Scheduler, SchedulerConfig
from model.loader import LoadedModel, load_model
from sharding.mesh import InvalidTensorParallelism, make_mesh
from sharding.rules import param_sharding

CPU_KV_CACHE_BYTES = 1 << 30
ACCELERATOR_KV_FRACTION = 0.8


class RequestRejected(ValueError):
    """The request can never run here (too long for the model or the KV pool, unknown token ids, ...)."""


def kv_page_bytes(loaded: LoadedModel, page_size: int) -> int:
    c = loaded.config
    itemsize = loaded.model.embed[...].dtype.itemsize
    return 2 * c.num_layers * c.num_kv_heads * page_size * c.head_dim * itemsize


def default_kv_cache_bytes() -> int:
    """A fraction of the free memory of the first device; a fixed budget on the CPU."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if jax.default_backend() == "cpu" or "bytes_limit" not in stats:
        return CPU_KV_CACHE_BYTES
    return int(ACCELERATOR_KV_FRACTION * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Joins one sequence's increments into a single RequestOutput."""
    last = outputs[-1]
    return replace(
        last, text="".join(o.text for o in outputs), token_ids=tuple(t for o in outputs for t in o.token_ids),
        logprobs=tuple(lp for o in outputs for lp in o.logprobs),
    )


class Engine:
    """Continuous-batching generation over one model; see `add_request` and `generate`."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, *, progress: bool = True, mesh: Mesh | None = None):
        """`mesh`: the tensor-parallel mesh `loaded` was sharded onto (None: one device)."""
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.max_model_len = min(
            config.max_model_len or DEFAULT_MAX_MODEL_LEN, loaded.config.max_position_embeddings
        )
        self.vocab_size = loaded.config.vocab_size
        kv_bytes = config.kv_cache_memory or default_kv_cache_bytes()
        num_pages = max(1, kv_bytes // kv_page_bytes(loaded, config.page_size))
        enable_compilation_cache()
        self.runner = ModelRunner(
            loaded.model, num_pages=num_pages, page_size=config.page_size, max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            attention_backend=config.attention_backend, mesh=mesh,
        )
        block_manager = BlockManager(num_pages, config.page_size, config.enable_prefix_caching)
        scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), block_manager)
        eos = loaded.config.eos_token_ids or self.tokenizer.eos_token_ids
        self.core = EngineCore(self.runner, scheduler, self.tokenizer, tuple(eos))
        if config.warmup:
            self.runner.warmup(progress)
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    @classmethod
    def create(cls, config: EngineConfig, *, progress: bool = True) -> Engine:
        """Loads the model, sizes the KV pool and compiles every step bucket."""
        if jax.process_count() > 1 and config.tp != jax.device_count():
            raise InvalidTensorParallelism(
                f"a {jax.process_count()}-process job serves one model over all its devices: "
                f"--tp must be {jax.device_count()}, got {config.tp}"
            )
        if config.tp == 1:
            return cls(load_model(config.model, dtype=config.dtype), config, progress=progress)
        mesh = make_mesh(config.tp)
        loaded = load_model(config.model, dtype=config.dtype, sharding_rule=partial(param_sharding, mesh))
        return cls(loaded, config, progress=progress, mesh=mesh)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises RequestRejected if the request could never be served."""
        if not prompt_ids:
            raise RequestRejected("the prompt is empty")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len {self.max_model_len}"
            )
        pages = -(-total // self.config.page_size)
        if pages > self.core.block_manager.num_pages:
            raise RequestRejected(
                f"the request needs {pages} KV pages but the whole pool has {self.core.block_manager.num_pages}"
            )
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.core.eos_token_ids))
        if params.min_tokens and len(banned) > MAX_BANNED_IDS:
            raise RequestRejected(f"at most {MAX_BANNED_IDS} stop token ids are supported with min_tokens")

    def _seed(self, params: SamplingParams) -> int:
        return params.seed % 2**32 if params.seed is not None else random.getrandbits(32)

    async def start(self) -> None:
        """Starts the step loop (in a worker thread) serving requests added from this event loop."""
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stopping or self.core.has_work)
                if self._stopping:
                    return
            try:
                self.core.step()
            except Exception as exc:  # noqa: BLE001 - a bug must not leave clients waiting forever
                self.core.fail_all(exc)

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
                    ) -> AsyncIterator[RequestOutput]:
        """Queues a request; iterate the result for its increments (indices 0..n-1, each ending finished).

        Validation happens now (RequestRejected). Closing the iterator before the end aborts the request.
        """
        self.validate(prompt_ids, params)
        loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.core.add(request_id, list(prompt_ids), params, self._seed(params),
                      lambda out: loop.call_soon_threadsafe(queue.put_nowait, out))
        self._notify()
        return self._stream(request_id, queue, params.n)

    async def _stream(self, request_id: str, queue: asyncio.Queue[RequestOutput], n: int
                      ) -> AsyncIterator[RequestOutput]:
        remaining = n
        try:
            while remaining:
                out = await queue.get()
                if out.finished:
                    remaining -= 1
                yield out
        finally:
            if remaining:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    def follow(self) -> None:
        """Processes other than 0 of a multi-process job: replays process 0's steps until its `shutdown`."""
        self.runner.follow()

    def stats(self) -> EngineStats:
        return self.core.stats()

    async def shutdown(self) -> None:
        """Stops the step loop and aborts whatever is left."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        for request_id in list(self.core.requests):
            self.core.abort(request_id)
        self.runner.stop_followers()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[list[RequestOutput]]:
        """Offline: runs all prompts to completion in this thread; result[i][j] is prompt i's sequence j, merged.

        Not to be mixed with a started async loop on the same engine.
        """
        if self._thread is not None:
            raise RuntimeError("generate() cannot run while the async step loop is started")
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        if len(all_params) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        for prompt, p in zip(prompts, all_params):
            self.validate(prompt, p)
        collected: list[list[list[RequestOutput]]] = [[[] for _ in range(p.n)] for p in all_params]
        for i, (prompt, p) in enumerate(zip(prompts, all_params)):
            self.core.add(f"offline-{uuid.uuid4().hex}-{i}", list(prompt), p, self._seed(p),
                          lambda out, i=i: collected[i][out.index].append(out))
        while self.core.has_work:
            self.core.step()
        return [[merge_outputs(seq_outputs) for seq_outputs in per_prompt] for per_prompt in collected]
