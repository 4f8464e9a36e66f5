"""What every route shares: settings, metrics, the engine once it is ready, admission, the stored responses, the
background ones running, and the conversations.

Admission decides whether a generation request may enter (503 while loading or draining, 429 when the
waiting queue is full) and counts what is in flight, so a SIGTERM drain knows when it is done.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal

from sluice.batching.engine import Engine
from sluice.batching.sampling_params import LoraRequest
from sluice.batching.stats import EngineStats
from sluice.model.roofline import Peaks

from sluice.app.errors import model_not_found, not_ready, queue_full, shutting_down
from sluice.app.conversations_store import ConversationStore
from sluice.app.metrics import ServerMetrics
from sluice.app.responses_api_background import BackgroundRuns
from sluice.app.responses_api_store import ResponseStore


@dataclass(frozen=True)
class ServerSettings:
    """HTTP-side settings: `max_waiting` sequences may queue beyond the engine's running batch;
    `sse_keepalive_s` spaces the keep-alive comments of a stream with nothing to send; a stream (the API's or the
    dashboard's) whose reader accepts nothing for `stream_stall_timeout_s` (0: never) is ended
    (`app/streaming.py`); `ui` serves the dashboard and playground, whose latency charts draw the `slo_*_ms` lines
    when set; `tool_call_parser` names the format of tool calls (`app/tool_calls.py`);
    `exclude_tools_when_tool_choice_none` leaves a request's tools out of its prompt when its tool_choice is "none"
    (vLLM's flag; by default the template is shown them, and the reply is not read for calls); `/v1/responses` keeps at
    most `responses_store_size` responses and `responses_store_bytes` bytes of them (`app/responses_api_store.py`),
    and `/v1/conversations` `conversations_store_size` conversations and `conversations_store_bytes` bytes of theirs
    (`app/conversations_store.py`);
    `embedding_pooling` is how `/v1/embeddings` pools an input's hidden states (`app/embeddings.py`);
    `reasoning_parser` names how a reasoning model's thinking is told from its answer (`app/reasoning.py`; None:
    not at all); `allowed_origins`, `allowed_methods`, `allowed_headers` and `allow_credentials` are the CORS
    policy for browsers calling the API from other origins (vLLM's flags and defaults: any origin, no
    credentials); `generation_config` "auto" gives the fields a request leaves out the model's own sampling
    defaults (`model/generation_config.py`), "vllm" the API's (vLLM's flag)."""

    served_model_name: str | None = None
    api_key: str | None = None
    max_waiting: int = 1024
    max_body_bytes: int = 4 * 1024 * 1024
    retry_after_s: int = 1
    sse_keepalive_s: float = 10.0
    stream_stall_timeout_s: float = 60.0
    ui: bool = True
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    tool_call_parser: str = "auto"
    exclude_tools_when_tool_choice_none: bool = False
    responses_store_size: int = 1024
    responses_store_bytes: int = 64 * 1024 * 1024
    conversations_store_size: int = 4096
    conversations_store_bytes: int = 128 * 1024 * 1024
    embedding_pooling: Literal["last", "mean"] = "last"
    reasoning_parser: str | None = None
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    generation_config: Literal["auto", "vllm"] = "auto"

    def cors_options(self) -> dict[str, Any]:
        """Starlette's CORSMiddleware's arguments for this CORS policy (the single process's and the ingress's)."""
        return dict(allow_origins=self.allowed_origins, allow_methods=self.allowed_methods,
                    allow_headers=self.allowed_headers, allow_credentials=self.allow_credentials)


def unready_reason(draining: bool, loaded: bool, healthy: bool = True) -> str | None:
    """Why a server does not serve, in the words its /health answers (the single process's and the replicas'
    ingress's alike: probes and operators match on them); None while it serves. `loaded`: an engine runs (behind the
    ingress, a replica); `healthy`: it steps."""
    if draining:
        return "shutting down"
    if not loaded:
        return "loading"
    if not healthy:
        return "the engine failed a step and is starting over, or hung"
    return None


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """True once `event` is set; False if `timeout_s` passed first."""
    if event.is_set():  # asyncio.wait_for with a timeout of 0 times out even on an event already set
        return True
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True


class ServerState:
    def __init__(self, settings: ServerSettings, replica: str = "") -> None:
        self.settings = settings
        self.replica = replica  # this replica's name under `--replicas` (its responses' ids carry it); "": none
        self.engine: Engine | None = None
        self.peaks: Peaks | None = None
        self.draining = False
        self.metrics = ServerMetrics(self._engine_stats, lambda: self.model_name)
        self.responses = ResponseStore(settings.responses_store_size, settings.responses_store_bytes)
        # The Conversations API's, bounded apart by the same numbers.
        self.conversations = ConversationStore(settings.conversations_store_size, settings.conversations_store_bytes)
        self.background = BackgroundRuns()  # the background responses running (each holds its admission)
        self.lora_updates = asyncio.Lock()  # app/lora_admin.py's: one LoRA load or unload at a time
        self._in_flight_seqs = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def unready(self) -> str | None:
        """Why /health is 503 now (`unready_reason`); None while the server serves."""
        return unready_reason(self.draining, self.engine is not None, self.engine is not None and self.engine.healthy)

    @property
    def model_name(self) -> str:
        if self.settings.served_model_name:
            return self.settings.served_model_name
        return self.engine.model_name if self.engine is not None else ""

    def set_engine(self, engine: Engine, peaks: Peaks | None = None) -> None:
        """`peaks`: of all the devices the engine's model runs on (the dashboard's roofline), if known."""
        self.engine = engine
        self.peaks = peaks

    def begin_drain(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is in flight; False if `timeout_s` passed first."""
        return await wait_set(self._idle, timeout_s)

    async def drain(self, timeout_s: float) -> bool:
        """Drains (new requests get 503) and waits up to `timeout_s` for what is in flight, background responses
        included; past it, aborts the rest (each then ends with its abort: a background response stored failed) and
        returns False."""
        self.begin_drain()
        if await self.wait_idle(timeout_s):
            return True
        if self.engine is not None:
            self.engine.abort_all()
        return False

    def require_engine(self) -> Engine:
        if self.draining:
            raise shutting_down()
        if self.engine is None:
            raise not_ready("The model is still loading")
        return self.engine

    def check_model(self, requested: str | None) -> None:
        """404 unless a request's `model` is None, the served model's name or one of its LoRA adapters'."""
        self.lora(requested)

    def lora(self, requested: str | None) -> LoraRequest | None:
        """The LoRA adapter a request's `model` names, None for the served model (or no `model`), 404 for any other
        name: also one whose adapter was unloaded since the request's `model` was first checked."""
        adapter = self.engine.adapters.get(requested) if self.engine is not None and requested is not None else None
        if adapter is None and requested not in (None, self.model_name):
            raise model_not_found(requested)
        return adapter

    def served_name(self, requested: str | None) -> str:
        """The `model` a response carries: the adapter's name for a request that named one, else the model's."""
        return requested if self.lora(requested) is not None else self.model_name

    def admit(self, num_seqs: int) -> Admission:
        """Let `num_seqs` sequences in, or raise 503 / 429. Call `release()` on the result when they are done."""
        engine = self.require_engine()
        # What is in flight beyond the running batch's capacity waits (the engine's own count lags a step).
        waiting = self._in_flight_seqs + num_seqs - engine.config.max_num_seqs
        # A request larger than the whole queue (2048 embedding inputs, say) gets in when nothing else is in flight:
        # refused then, it could never get in.
        if waiting > self.settings.max_waiting and self._in_flight_seqs:
            raise queue_full(self.settings.retry_after_s)
        self._in_flight_seqs += num_seqs
        self._idle.clear()
        return Admission(self, num_seqs)

    def _release(self, num_seqs: int) -> None:
        self._in_flight_seqs -= num_seqs
        if self._in_flight_seqs == 0:
            self._idle.set()

    def _engine_stats(self) -> EngineStats | None:
        return self.engine.stats if self.engine is not None else None


class Admission:
    def __init__(self, state: ServerState, num_seqs: int) -> None:
        self._state = state
        self._num_seqs = num_seqs
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._state._release(self._num_seqs)
