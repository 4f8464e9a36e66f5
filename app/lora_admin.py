"""vLLM's runtime LoRA updating (`--allow-runtime-lora-updating`, or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING):
`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, routes the app has only when it is on
(`server.create_app`'s `lora_admin`).

A load reads the adapter's files in a worker thread (`Engine.load_lora`: CPU work, kept off the event loop), and the
engine thread writes it into a free slot between two steps; an unload takes effect there too, before its answer.
One update at a time (the app's `lora_updates` lock), so what the checks here read of `Engine.adapters` holds until
the update is done. The answers are vLLM's: 200 with one line of plain text; 400 for an adapter already loaded
without `load_inplace`, one Sluice cannot serve (`LoraError`'s line) or no free slot; 404 for no folder at
`lora_path`, or an unload of an adapter not loaded.
"""

from __future__ import annotations

import asyncio
import logging
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from sluice.model.hub import HubError
from sluice.model.lora import AdapterNotFound, LoraError

from sluice.app.errors import APIError
from sluice.app.routes import parse_body

logger = logging.getLogger(__name__)


class _AdapterUpdate(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: ClassVar[None] = None  # what `parse_body` checks: these requests name no model


class LoadLoraAdapterRequest(_AdapterUpdate):
    lora_name: str = Field(description="the name requests give as their `model` to run with the adapter")
    lora_path: str = Field(description="its PEFT folder on the server, or a Hub id (ORG/NAME)")
    load_inplace: bool = Field(False, description="replace the adapter loaded under lora_name, if any (requests "
                                                  "already running or waiting finish with the one they started with)")


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
    async with request.app.state.lora_updates:
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
    logger.info("Loaded LoRA adapter %r from %s", name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    _, engine, body = await parse_body(request, UnloadLoraAdapterRequest)
    name = body.lora_name
    if not name:
        raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
    async with request.app.state.lora_updates:
        if name not in engine.adapters:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", type="NotFoundError", param="lora_name")
        await asyncio.wrap_future(engine.unload_lora(name))
    logger.info("Unloaded LoRA adapter %r", name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _invalid(message: str) -> APIError:
    return APIError(400, message, type="InvalidUserInput")
