"""`load_model`: from a model name or path to a ready Flax model and tokenizer (converting once, then restoring)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sluice.model import checkpoint
from sluice.model.config import ModelConfig, read_json_object
from sluice.model.fetch import InvalidModel, ModelNotFound, from_hub, resolve_model, sluice_home
from sluice.model import generation_config
from sluice.model.llama import Llama
from sluice.model.quantize import default_layout, quantize_model, quantize_params, resolve
from sluice.model.tokenizer import SpecialTokens, Tokenizer
from sluice.model.weights import read_gguf, read_safetensors_folder

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

ShardingRule = Callable[[ModelConfig, Mapping[str, tuple[int, ...]]], Mapping[str, jax.sharding.Sharding]]
"""(model config, each parameter's shape as stored by name) -> where each lives; it raises for a model it cannot
split (`sharding.rules.param_sharding`)."""


@dataclass
class LoadedModel:
    config: ModelConfig
    model: Llama
    tokenizer: Tokenizer
    name: str
    weights: str = ""  # the converted checkpoint's folder name (it names the source file's identity); "": none
    generation_defaults: Mapping[str, float | int] = field(default_factory=dict)  # `model/generation_config.py`


def default_dtype() -> str:
    """bfloat16 on accelerators, float32 on the CPU."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


_MALFORMED = (ValueError, KeyError, TypeError, OSError)
"""What reading a malformed model file raises."""


@dataclass(frozen=True)
class Source:
    """A GGUF file or HF folder as its metadata reads (its weights not read yet)."""

    path: Path
    config: ModelConfig  # with the tokenizer's BOS, and the ids the model stops at: the engine's, resolved here alone
    tokenizer: Tokenizer
    generation_defaults: dict[str, float | int]
    read_params: Callable[[], dict[str, np.ndarray]]  # the float32 weights by `Llama`'s names
    hf_overrides: Mapping[str, Any] | None = None  # what replaced config.json's keys (`with_overrides`)


def read_source(path: Path, hf_overrides: Mapping[str, Any] | None = None) -> Source:
    """Reads all that a GGUF file or HF folder's metadata tells (config, tokenizer, sampling defaults, the tensors'
    names and shapes), an HF folder's config.json with `hf_overrides` (`with_overrides`); InvalidModel if it does
    not read as a Llama-family model."""
    try:
        if path.is_dir():
            hf_config = with_overrides(read_json_object(path / "config.json", missing_ok=False), hf_overrides or {})
            config, read_params = read_safetensors_folder(path, hf_config)
            tokenizer = Tokenizer.from_hf_folder(path, hf_config)
            defaults = generation_config.from_hf_folder(path)
            stop_ids = generation_config.hf_stop_token_ids(path, hf_config, tokenizer)
        else:
            config, fields, read_params = read_gguf(path)
            tokenizer = Tokenizer.from_gguf_fields(fields)
            defaults = generation_config.from_gguf_fields(fields)
            stop_ids = tokenizer.eos_token_ids  # the file's EOS and end of turn
    except _MALFORMED as error:
        raise _unreadable(path, error, hf_overrides) from error
    config = dataclasses.replace(config, bos_token_id=tokenizer.bos_token_id, eos_token_ids=stop_ids)
    return Source(path, config, tokenizer, defaults, read_params, hf_overrides)


def with_overrides(hf_config: dict[str, Any], hf_overrides: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's `hf_config` with its top-level keys replaced by `hf_overrides`', as vLLM's --hf-overrides
    replaces them. Where the file has transformers 5's `rope_parameters`, which transformers 5 reads `rope_scaling`
    and `rope_theta` from, an overridden `rope_scaling` is the scaling in it, keeping its `rope_theta` (which
    transformers' setter drops), and an overridden `rope_theta` replaces its theta: at the top level either would be
    left unread, and a model card's override would serve the model unchanged."""
    merged = {**hf_config, **hf_overrides}
    parameters = hf_config.get("rope_parameters")
    if "rope_parameters" in hf_overrides or not isinstance(parameters, dict) or not parameters:
        return merged
    if "rope_scaling" in hf_overrides:
        scaling = merged.pop("rope_scaling") or {}
        if not isinstance(scaling, dict):
            return {**merged, "rope_parameters": scaling}  # refused, as no object, where the config is read
        parameters = {**({"rope_theta": parameters["rope_theta"]} if "rope_theta" in parameters else {}), **scaling}
    if "rope_theta" in hf_overrides:
        parameters = {**parameters, "rope_theta": merged.pop("rope_theta")}
    return {**merged, "rope_parameters": parameters}


def check_writable(folder: Path) -> None:
    """ModelNotFound if the converted model cannot be kept in `folder`: its parent cannot be made or written."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _cannot_keep(folder, error) from None
    if not os.access(folder.parent, os.W_OK | os.X_OK):
        raise _cannot_keep(folder, PermissionError(errno.EACCES, os.strerror(errno.EACCES)))


def convert(source: Source, folder: Path, quantization: str) -> None:
    """Reads `source`'s weights and writes Sluice's converted folder (float32 weights, or quantized), where
    `check_writable` found it may: InvalidModel if the weights do not read, ModelNotFound if the folder cannot be
    written after all."""
    try:
        params = source.read_params()
    except _MALFORMED as error:
        raise _unreadable(source.path, error) from error
    params = {name: np.asarray(value) for name, value in quantize_params(params, quantization).items()}
    special = dataclasses.asdict(source.tokenizer.special)
    try:
        checkpoint.save(folder, source.config, params, source.tokenizer.to_json(), special, source.generation_defaults,
                        source.path, source.hf_overrides)
    except OSError as error:
        raise _cannot_keep(folder, error) from None


def _unreadable(path: Path, error: Exception, hf_overrides: Mapping[str, Any] | None = None) -> InvalidModel:
    given = f" with --hf-overrides {checkpoint.canonical_overrides(hf_overrides)}" if hf_overrides else ""
    return InvalidModel(f"{path} does not read as a model{given}: {type(error).__name__}: {error}")


def _cannot_keep(folder: Path, error: OSError) -> ModelNotFound:
    return ModelNotFound(f"cannot keep the converted model in {folder.parent} ({error.strerror or error}): set "
                         f"SLUICE_HOME to a folder Sluice may write")


# The exit status of `python -m sluice.model.loader` for each error `convert` raises with a message for the user; the
# child writes that message, and nothing else, on its stdout.
_CHILD_EXIT_STATUS: dict[type[Exception], int] = {InvalidModel: 3, ModelNotFound: 4}


def _convert_in_child(source: Source, folder: Path, quantization: str) -> None:
    """`convert` in a single-process Python of its own: in a multi-process job orbax saves collectively, and each
    process's conversion is its own business. The child's InvalidModel or ModelNotFound is raised here as `convert`
    raised it; its progress and any other failure's traceback reach stderr as they come."""
    overrides = checkpoint.canonical_overrides(source.hf_overrides or {})
    child = subprocess.run([sys.executable, "-m", "sluice.model.loader", str(source.path), str(folder), quantization,
                            overrides], stdout=subprocess.PIPE, text=True)
    for error_type, status in _CHILD_EXIT_STATUS.items():
        if child.returncode == status:
            raise error_type(child.stdout)
    child.check_returncode()


def _convert_first_use(source: Source, folder: Path, quantization: str, stored: str) -> None:
    """Converts `source` into `folder` (in a child process in a multi-process job), saying so on stderr, and
    removes the conversions it replaces."""
    start = time.perf_counter()
    print(f"Converting {checkpoint.source_name(source.path)} (first use) ...", file=sys.stderr)
    if jax.process_count() > 1:
        _convert_in_child(source, folder, quantization)
    else:
        convert(source, folder, quantization)
    print(f"Converted in {time.perf_counter() - start:.1f} s -> {folder}", file=sys.stderr)
    checkpoint.remove_stale(folder, source.path, stored)


def _restore_target(path: Path, config: ModelConfig, dtype: str, quantization: str,
                    sharding_rule: ShardingRule | None) -> tuple[nnx.GraphDef, dict[str, jax.ShapeDtypeStruct]]:
    """The model's graph and each parameter's shape, dtype and sharding, from `config` alone: InvalidModel if
    `quantization`'s layouts cannot pack its weights, and what `sharding_rule` raises for a model it cannot split."""
    try:
        abstract = nnx.eval_shape(
            lambda: quantize_model(Llama(config, dtype=DTYPES[dtype], rngs=nnx.Rngs(0)), quantization))
    except ValueError as error:  # the quantizers' refusal, found from the shapes alone
        raise InvalidModel(f"{path} cannot be stored as {quantization} ({error}): serve it with --quantization "
                           f"none") from None
    graphdef, abstract_state = nnx.split(abstract)
    flat = {key[0]: var for key, var in nnx.to_flat_state(abstract_state)}
    if sharding_rule is None:
        shardings = dict.fromkeys(flat, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    else:
        shardings = sharding_rule(config, {name: var.shape for name, var in flat.items()})
    return graphdef, {name: jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=shardings[name])
                      for name, var in flat.items()}


def load_model(
    model: str | None = None,
    *,
    dtype: str | None = None,
    quantization: str = "none",
    sharding_rule: ShardingRule | None = None,
    chat_template: str | None = None,
    hf_overrides: Mapping[str, Any] | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
) -> LoadedModel:
    """Loads `model` (a .gguf, an HF folder, a Hugging Face Hub id, or None for the default SmolLM2), converting on
    first use.

    `dtype` is the activation dtype (and the weights' with quantization "none"); `quantization` one of
    `model.quantize.CHOICES` ("auto" picks by backend), kept quantized in memory and in the converted folder.
    `sharding_rule` places each parameter as it is restored (tensor parallelism); default: the first device.
    `chat_template`: rendered instead of the model's own (None: the model's).
    `hf_overrides`: keys that replace an HF folder's config.json's (`with_overrides`; None or empty: none),
    converted apart from the plain model; InvalidModel for a GGUF file.
    `revision`, `download_dir`: a Hub model's revision (None: its default branch) and HF cache folder (None:
    huggingface_hub's), as vLLM's --revision and --download-dir (`fetch.resolve_model`).
    """
    dtype = dtype or default_dtype()
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    quantization = resolve(quantization)
    path = resolve_model(model, revision, download_dir)
    if hf_overrides and not path.is_dir():
        raise InvalidModel(f"--hf-overrides replaces config.json's keys, and {path} is a GGUF file, whose config is "
                           f"its metadata")
    # Per-channel int8 (`model.quantize`, where the CPU kernels do not run) is a conversion of its own.
    stored = f"{quantization}-channel" if default_layout(quantization) == "channel" else quantization
    folder = checkpoint.checkpoint_dir(path, sluice_home(), stored, hf_overrides)
    source = None
    if not folder.exists():
        check_writable(folder)
        source = read_source(path, hf_overrides)
    config = checkpoint.load_config(folder) if source is None else source.config
    # Before a conversion, which may take minutes: what the sharding rule refuses (a --tp the model cannot be split
    # by) is found from the config.
    graphdef, target = _restore_target(path, config, dtype, quantization, sharding_rule)
    if source is not None:
        _convert_first_use(source, folder, quantization, stored)
    special = json.loads((folder / checkpoint.SPECIAL_TOKENS_FILE).read_text())
    special["eos_token_ids"] = tuple(special["eos_token_ids"])
    tokenizer = Tokenizer.from_json((folder / checkpoint.TOKENIZER_FILE).read_text(), SpecialTokens(**special))
    _warn_of_tokens_past_the_embeddings(tokenizer, config)
    defaults = json.loads((folder / checkpoint.GENERATION_DEFAULTS_FILE).read_text())
    if chat_template is not None:
        tokenizer = tokenizer.with_chat_template(chat_template)
    params = checkpoint.restore_params(folder, target)
    state = nnx.State({name: nnx.Param(value) for name, value in params.items()})
    return LoadedModel(config=config, model=nnx.merge(graphdef, state), tokenizer=tokenizer,
                       name=model_name(model, path), weights=folder.name, generation_defaults=defaults)


def _warn_of_tokens_past_the_embeddings(tokenizer: Tokenizer, config: ModelConfig) -> None:
    """Warns of a tokenizer with more tokens than the model has embedding rows: a tokenizer paired with another
    model's weights, or tokens added without resizing the embeddings. Served, as transformers and vLLM load it
    (vLLM's multimodal models have placeholder tokens past the language model's vocabulary), a prompt holding one
    of those ids refused (`batching.request`). Embeddings padded past the tokenizer are as models are made."""
    if tokenizer.vocab_size > config.vocab_size:
        logger.warning("the tokenizer's %d tokens outnumber the model's %d embedding rows: prompts holding token ids "
                       "from %d on are refused", tokenizer.vocab_size, config.vocab_size, config.vocab_size)


def model_name(model: str | None, source: Path) -> str:
    """The name `model`, found at `source`, is served by, as vLLM names it: a Hub model's id as given (its files'
    folder is named by a commit); else its folder's name, or its file's less `.gguf` (a folder's name has no suffix:
    Qwen2.5-0.5B-Instruct's is not ".5B-Instruct")."""
    if from_hub(model):
        return model
    return source.name if source.is_dir() else source.stem


# python -m sluice.model.loader SOURCE FOLDER QUANTIZATION HF_OVERRIDES: one conversion, single-process JAX
if __name__ == "__main__":
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the error's message alone
            convert(read_source(Path(sys.argv[1]), json.loads(sys.argv[4])), Path(sys.argv[2]), sys.argv[3])
    except tuple(_CHILD_EXIT_STATUS) as error:
        print(error, end="")
        sys.exit(_CHILD_EXIT_STATUS[type(error)])
