"""The LoRA adapters an engine serves, by name, and the host side of their slots: reading an adapter's files,
serving it in place of another, binding a request to the adapter served under the name it asked for, writing the
adapters the scheduler swapped in into their slots, reading again those whose weights host memory dropped (on the
slots' reader thread: `LoraSlots.find`), and the stats' LoRA fields.

`adapters` is replaced whole, never changed, as other threads read it (`Engine.submit`, the app); everything else is
the engine thread's, bar `read`, which any thread calls before handing the engine what it read, and `_read_again`,
which the reader thread runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial

import numpy as np
from jax.sharding import Mesh

from sluice.batching import step_broadcast
from sluice.batching.config import EngineConfig, InvalidEngineConfig
from sluice.batching.lora_slots import LoraSlots
from sluice.batching.sampling_params import LoraRequest, SamplingParams
from sluice.batching.sequence import Sequence
from sluice.model import hub
from sluice.model.config import ModelConfig
from sluice.model.fetch import from_hub
from sluice.model.loader import LoadedModel
from sluice.model.lora import LoraAdapter, LoraError, attach_adapters, load_adapter, slot_projections, slot_weights
from sluice.sharding.rules import param_sharding

LayOut = Callable[[LoraAdapter], dict[str, np.ndarray]]
"""An adapter read -> its weights laid out for a slot (`slot_weights` of the slots' rank and projections)."""


class LoraRegistry:
    """`adapters`: each served adapter's name -> what a request that runs with it carries; `slots`: the model's LoRA
    slots (None: it has none, and serves no adapter)."""

    def __init__(self, adapters: dict[str, LoraRequest], num_slots: int, lay_out: LayOut, model_config: ModelConfig,
                 config: EngineConfig):
        """`adapters`: the first `num_slots` already in the slots, in order."""
        self.adapters = adapters
        self._lay_out = lay_out
        self._model_config = model_config
        self._config = config
        served = list(adapters.values())
        self.slots = (LoraSlots(num_slots, served[:num_slots], config.max_cpu_loras, self._read_again) if num_slots
                      else None)
        if self.slots is not None:
            self.slots.hold(served)

    @classmethod
    def attach(cls, loaded: LoadedModel, config: EngineConfig, mesh: Mesh | None) -> LoraRegistry:
        """Reads `config.lora_modules`' adapters and gives `loaded.model` LoRA slots (`EngineConfig.max_loras`, with
        runtime updating `runtime_lora_slots`), the first adapters in them, in place of any an earlier engine gave it;
        host memory holds the weights of the last `max_cpu_loras`. InvalidEngineConfig for an adapter Sluice cannot
        serve, or for swapping adapters over several processes."""
        if any(name == loaded.name for name, _ in config.lora_modules):
            raise InvalidEngineConfig("lora_modules", f"names an adapter {loaded.name!r}, the model's own name: a "
                                                      f"request for it could not be told from one for the model")
        try:
            adapters = [read_adapter(name, path, loaded.config, config) for name, path in config.lora_modules]
            if config.allow_runtime_lora_updating:
                num_slots, rank = config.runtime_lora_slots
            else:
                # Adapters cannot be added later: padding past the largest adapter's rank, or a slot past one per
                # adapter (every token multiplies every slot's weights), would only cost.
                num_slots = min(config.max_loras or len(adapters), len(adapters))
                rank = max((a.rank for a in adapters), default=1)
            if num_slots < len(adapters) and step_broadcast.is_multiprocess():
                raise InvalidEngineConfig("max_loras", f"is {num_slots}, fewer slots than the {len(adapters)} "
                                                       f"adapters: adapters are swapped into slots in one engine "
                                                       f"process only")
            weights = attach_adapters(loaded.model, adapters, num_slots, rank,
                                      partial(param_sharding, mesh) if mesh is not None else None,
                                      every_projection=config.allow_runtime_lora_updating)
        except (LoraError, hub.HubError) as error:
            raise InvalidEngineConfig("lora_modules", str(error)) from None
        served = {adapter.name: _served(adapter, w) for adapter, w in zip(adapters, weights)}
        lay_out = partial(slot_weights, config=loaded.config, max_rank=rank, dtype=loaded.model.dtype,
                          projections=slot_projections(adapters, config.allow_runtime_lora_updating))
        return cls(served, num_slots, lay_out, loaded.config, config)

    def read(self, name: str, path: str) -> LoraRequest:
        """Any thread: the PEFT adapter at `path` (a folder, or a Hub id) read and laid out for a slot as `name`, for
        `serve`. LoraError (AdapterNotFound where nothing is at `path`, or a rank above the slots' before the weights
        are read) or HubError; LoraError at once without slots (no adapter given, no runtime updating)."""
        if self.slots is None:
            raise LoraError(f"LoRA adapter {name!r} cannot be served: this engine has no LoRA slots (it was started "
                            f"with neither adapters nor runtime LoRA updating)")
        adapter = read_adapter(name, path, self._model_config, self._config)
        return _served(adapter, self._lay_out(adapter))

    def serve(self, lora: LoraRequest) -> None:
        """Serves `lora` (`read`'s), its weights the most recently used of those host memory holds, in place of any
        adapter of its name (`LoraSlots.forget`)."""
        if (replaced := self.adapters.get(lora.name)) is not None:
            self.slots.forget(replaced)
        self.adapters = {**self.adapters, lora.name: lora}
        self.slots.hold([lora])

    def unload(self, name: str) -> None:
        """Stops serving adapter `name` (`LoraSlots.forget`; a slot holding it is another's to take once no running
        sequence uses it); an unknown name is ignored."""
        if (unloaded := self.adapters.get(name)) is not None:
            self.slots.forget(unloaded)
        self.adapters = {served: lora for served, lora in self.adapters.items() if served != name}

    def bind(self, params: SamplingParams) -> SamplingParams:
        """`params` with the adapter now served under the name they ask for (one loaded in place since they were
        submitted, say; an equal one built by hand may lack the weights): a copy, as parameters are shared (with the
        caller, with other requests). The caller has checked the name is served."""
        served = self.adapters[params.lora.name] if params.lora is not None else None
        return params if served is params.lora else replace(params, lora=served)

    def write_slots(self, write_rows: Callable[[dict[str, np.ndarray], int], None]) -> list[tuple[int, Exception]]:
        """Writes each adapter the scheduler swapped in into its slot through `write_rows(weights, slot)`: host
        memory holds its weights (`LoraSlots.find` admits none it dropped until they are read again). Returns the
        slots whose write failed, each with its error: the slot is left empty, and the sequences just admitted into
        it (they alone use it) cannot run."""
        failed = []
        for slot, lora in list(self.slots.writes.items()):
            try:
                write_rows(lora.weights, slot)
                del self.slots.writes[slot]
            except Exception as error:  # noqa: BLE001 - the other requests run on; retrying may fail every step
                self.slots.empty(slot)
                failed.append((slot, error))
        return failed

    def _read_again(self, lora: LoraRequest) -> dict[str, np.ndarray]:
        """`lora`'s weights read again from its folder and laid out for a slot, host memory having dropped them
        (`LoraSlots.hold`), as vLLM's worker loads an adapter its CPU cache lacks, but on the slots' reader thread
        (`LoraSlots.find`): the sequences that need them wait, the others run on. About 5 ms per MiB of files on a
        2-core CPU host from the page cache (90 ms for a rank-16 adapter of SmolLM2-135M's seven projections,
        19 MiB), plus the disk's time where they are not cached. LoraError (AdapterNotFound: its folder is gone) or
        OSError where they can no longer be read or served, LoraError where they are no longer the files served
        (another fingerprint); for an adapter replaced or unloaded since its request was taken in, a LoraError that
        says so."""
        try:
            adapter = read_adapter(lora.name, lora.folder, self._model_config, self._config)
            if adapter.fingerprint != lora.fingerprint:
                raise LoraError(f"LoRA adapter {lora.name!r} ({lora.folder}): its files changed since it was loaded; "
                                f"load it again to serve them")
        except (LoraError, OSError) as error:
            if self.adapters.get(lora.name) is lora:
                raise
            update = "replaced" if lora.name in self.adapters else "unloaded"
            raise LoraError(f"LoRA adapter {lora.name!r} was {update} after this request was taken in, and its files "
                            f"({lora.folder}) no longer give the weights it was loaded with") from error
        return self._lay_out(adapter)

    def stats(self, running: Iterable[Sequence], waiting: Iterable[Sequence]) -> dict[str, int | tuple[str, ...]]:
        """`EngineStats`' LoRA fields: max_loras, and the adapters of the `running` and the `waiting` sequences;
        none without slots."""
        if self.slots is None:
            return {}

        def names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
            return tuple(sorted({seq.params.lora.name for seq in seqs if seq.params.lora is not None}))

        return dict(max_loras=self._config.max_loras or self.slots.num_slots,
                    lora_running=names(running), lora_waiting=names(waiting))


def _served(adapter: LoraAdapter, weights: dict[str, np.ndarray]) -> LoraRequest:
    """What a request run with `adapter` carries: its `weights` for a slot, and the folder they are read again from
    (absolute: a relative one could read as a Hub id)."""
    return LoraRequest(adapter.name, adapter.fingerprint, str(adapter.path.absolute()), weights)


def read_adapter(name: str, path: str, model_config: ModelConfig, config: EngineConfig) -> LoraAdapter:
    """The PEFT adapter at `path` (a local folder, or a Hub id's snapshot of its adapter files) read as `name`:
    LoraError (AdapterNotFound where nothing is at `path`) or HubError where it cannot be served, a rank above the
    slots' said before its weights are read."""
    folder = str(hub.download_adapter(path, config.download_dir)) if from_hub(path) else path
    max_rank = config.runtime_lora_slots[1] if config.allow_runtime_lora_updating else config.max_lora_rank
    return load_adapter(name, folder, model_config, max_rank)
