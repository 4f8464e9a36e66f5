"""vLLM's runtime LoRA updating (`--allow-runtime-lora-updating`, or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING):
`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, routes the app has only when it is on
(`server.create_app`'s `lora_admin`).

A load reads the adapter's files in a worker thread (`Engine.load_lora`: CPU work, kept off the event loop) into host
memory, and the engine thread serves it from between two steps (a device slot takes it when a request needs it:
`batching.lora_slots`); an unload takes effect there too, before its answer. One update at a time
(`ServerState.lora_updates`), so what the checks here read of `Engine.adapters` holds until the update is done; an
update once begun is seen through to its end even if its request is cancelled (a client gone, a server shutting
down), so the next one finds the adapters decided. The answers are vLLM's: 200 with one line of plain text; 400 for
an adapter already loaded without `load_inplace`, or one Sluice cannot serve (`LoraError`'s line: a `lora_path` that
names a file is one); 404 for nothing at `lora_path`, or an unload of an adapter not loaded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from sluice.model.hub import HubError
from sluice.model.lora import AdapterNotFound, LoraError

from sluice.batching.engine import Engine

from sluice.app.errors import APIError
from sluice.app.routes import parse_body
from sluice.app.state import ServerState

logger = logging.getLogger(__name__)
T = TypeVar("T")

ERROR_STATUSES = (
    ("400", "Invalid request: no name or path, the model's name, a name already loaded (without load_inplace), a "
            "file for lora_path, or an adapter Sluice cannot serve"),
    ("401", "Missing or wrong API key"),
    ("404", "Nothing at lora_path, or no adapter loaded of that name to unload"),
    ("413", "Body too large"),
    ("503", "Loading, or shutting down"),
)
"""The statuses of the errors these routes answer with (their OpenAPI operations')."""


class _AdapterUpdate(BaseModel):
    model_config = ConfigDict(extra="ignore")


class LoadLoraAdapterRequest(_AdapterUpdate):
    lora_name: str = Field(description="the name requests give as their `model` to run with the adapter")
    lora_path: str = Field(description="its PEFT folder on the server, or a Hub id (ORG/NAME)")
    load_inplace: bool = Field(False, description="replace the adapter loaded under lora_name, if any (requests "
                                                  "already running or waiting finish with the one they started with; "
                                                  "with --max-cpu-loras, a waiting one only while the old adapter's "
                                                  "files stay in their folder)")


class UnloadLoraAdapterRequest(_AdapterUpdate):
    lora_name: str = Field(description="the adapter's name")
    lora_int_id: int | None = Field(None, description="vLLM's id of the adapter: taken and unused (the name says it)")


async def load_lora_adapter(request: Request) -> Response:
    state, engine, body = await parse_body(request, LoadLoraAdapterRequest)
    name = body.lora_name
    if not name or not body.lora_path:
        raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
    if name in (state.model_name, engine.model_name):
        raise _invalid(f"The lora adapter '{name}' has the served model's name: a request for it could not be told "
                       f"from one for the model.")
    await _to_its_end(_load(state, engine, body))
    logger.info("Loaded LoRA adapter %r from %s", name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def _load(state: ServerState, engine: Engine, body: LoadLoraAdapterRequest) -> None:
    """Loads the adapter `body` asks for, one update at a time; APIError if it cannot."""
    name = body.lora_name
    async with state.lora_updates:
        if name in engine.adapters and not body.load_inplace:
            raise _invalid(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                           f"place, set 'load_inplace' to True.")
        try:
            written = await asyncio.to_thread(engine.load_lora, name, body.lora_path)
            await asyncio.wrap_future(written)
        except AdapterNotFound as error:
            raise APIError(404, str(error), type="NotFoundError", param="lora_path") from None
        except (LoraError, HubError) as error:
            raise APIError(400, str(error), type="BadRequestError") from None


async def unload_lora_adapter(request: Request) -> Response:
    state, engine, body = await parse_body(request, UnloadLoraAdapterRequest)
    name = body.lora_name
    if not name:
        raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
    await _to_its_end(_unload(state, engine, name))
    logger.info("Unloaded LoRA adapter %r", name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _unload(state: ServerState, engine: Engine, name: str) -> None:
    """Unloads adapter `name`, one update at a time; APIError if none of that name is loaded."""
    async with state.lora_updates:
        if name not in engine.adapters:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", type="NotFoundError", param="lora_name")
        await asyncio.wrap_future(engine.unload_lora(name))


async def _to_its_end(update: Coroutine[Any, Any, T]) -> T:
    """`update`'s result, the update run to its end even if the caller is cancelled meanwhile: cancelling the wait
    could neither stop a read in its worker thread nor take back what the engine thread has written, and would let
    the next update in before this one was decided."""
    running = asyncio.ensure_future(update)
    running.add_done_callback(lambda done: done.cancelled() or done.exception())  # heard, even with no one waiting
    return await asyncio.shield(running)


def _invalid(message: str) -> APIError:
    return APIError(400, message, type="InvalidUserInput")
