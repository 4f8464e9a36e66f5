"""The converted-model folder: weights as an orbax checkpoint, beside the config and tokenizer.

Conversion (dequantizing a GGUF, reading safetensors) happens once; later loads restore from here, optionally
straight into target shardings and dtype, so no device ever holds a full replica it does not need.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from sluice.model.config import ModelConfig, RopeScaling

PARAMS_DIR = "params"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
SPECIAL_TOKENS_FILE = "special_tokens.json"
GENERATION_DEFAULTS_FILE = "generation_defaults.json"  # the model's own sampling defaults (`generation_config`)
SOURCE_FILE = "source.txt"  # what the conversion was made from (`made_from`), for `remove_stale`
HF_OVERRIDES_FILE = "hf_overrides.json"  # the --hf-overrides it was converted with (none: no such file)


LAYOUT_VERSION = 10
"""Bumped when the parameters' names or layouts change (2: fused q/k/v and gate/up; 3: GGUF
block formats packed in panels for the CPU kernels; 4: a GGUF's rope_freqs.weight kept in the config; 5: the
model's sampling defaults kept beside it; 6: an HF config's sliding window caps the context kept in the config;
7: transformers 5's `rope_parameters` read, whose RoPE theta a version-6 conversion took for 10000; 8: the stop ids
of generation_config.json and tokenizer_config.json kept in the config, and transformers' defaults per model type
for what a config.json leaves out; 9: the stop ids resolved once, as vLLM takes them, which the engine reads alone;
10: RoPE scalings of a kind (linear, YaRN) and Granite's scalars, whose stored fields a version-9 build cannot read,
and the context of a YaRN by a factor of 1, which version 9 kept unscaled), so no older conversion is restored into a
model that no longer reads it, nor a newer one into an older build sharing the folder."""


def canonical_overrides(hf_overrides: Mapping[str, Any]) -> str:
    """`hf_overrides` as one JSON text whatever the order of their keys."""
    return json.dumps(hf_overrides, sort_keys=True, separators=(",", ":"))


def checkpoint_dir(source: Path, cache_root: Path, quantization: str,
                   hf_overrides: Mapping[str, Any] | None = None) -> Path:
    """Where the conversion of `source` with `quantization` and `hf_overrides` lives: keyed by the name, size and
    modification time of the source file or of each file in the source folder but hidden ones (a file rewritten in
    place leaves its folder's own time as it was; a git checkout's `.git` is not the model), the layout version,
    the overrides (none or empty: no key of theirs, as conversions were keyed before them), and the quantization
    (which also names the folder)."""
    files = [source] if source.is_file() else sorted(
        p for p in source.iterdir() if p.is_file() and not p.name.startswith("."))
    identity = ";".join(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}" for p in files for st in [p.stat()])
    overridden = f":{canonical_overrides(hf_overrides)}" if hf_overrides else ""
    key = hashlib.sha256(f"{identity}:{LAYOUT_VERSION}{overridden}".encode()).hexdigest()[:12]
    name = Path(source.name).stem if source.is_file() else source_name(source)  # a folder's dots are no suffix
    return cache_root / "checkpoints" / f"{name}-{key}-{quantization}"


def _snapshots_at(parts: tuple[str, ...]) -> int | None:
    """The index of `snapshots` in a path's `parts` inside a Hugging Face cache's repository
    (`models--ORG--NAME/snapshots/COMMIT/...`, not resolved: a snapshot's files link into the cache's blobs/)."""
    at = len(parts) - 1 - parts[::-1].index("snapshots") if "snapshots" in parts else 0
    return at if 1 <= at < len(parts) - 1 and parts[at - 1].startswith("models--") else None


def made_from(source: Path) -> str:
    """What a conversion of `source` replaces the conversions of: its resolved path, or for a file or folder of a
    Hugging Face cache's snapshot that path at any commit, so that a branch that moves on leaves no conversion of
    its earlier commit behind."""
    parts = source.absolute().parts
    if (at := _snapshots_at(parts)) is not None:
        return str(Path(*parts[:at + 1], "*", *parts[at + 2:]))
    return str(source.resolve())


def source_name(source: Path) -> str:
    """`source`'s name for people: a Hub snapshot folder's is its repository's (`ORG--NAME`), not its commit."""
    parts = source.absolute().parts
    at = _snapshots_at(parts)
    return parts[at - 1].removeprefix("models--") if at is not None and at == len(parts) - 2 else source.name


def remove_stale(folder: Path, source: Path, quantization: str) -> None:
    """Removes the conversions of `source` with `quantization` that `folder` (just converted) replaces: those made
    before the source changed (`made_from`), which no load reads again, and those of other overrides where `folder`
    has some. The plain conversion and the latest overridden one are kept apart, so that serving a model with and
    without --hf-overrides by turns does not convert it at every start."""
    overridden = (folder / HF_OVERRIDES_FILE).is_file()
    for other in folder.parent.iterdir():
        recorded = other / SOURCE_FILE
        if (other != folder and other.name.endswith(f"-{quantization}") and recorded.is_file()
                and recorded.read_text() == made_from(source)
                and (other / HF_OVERRIDES_FILE).is_file() == overridden):
            shutil.rmtree(other, ignore_errors=True)


def save(folder: Path, config: ModelConfig, params: dict[str, np.ndarray], tokenizer_json: str, special: dict[str, Any],
         generation_defaults: dict[str, float | int], source: Path,
         hf_overrides: Mapping[str, Any] | None = None) -> None:
    """Writes the converted model of `source`, its config.json read with `hf_overrides`, atomically (to a temporary
    folder renamed into place).

    Processes converting the same source at once (the processes of a multi-process job on one filesystem)
    each write their own temporary folder; the first rename wins.
    """
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp.resolve() / PARAMS_DIR, params)
            checkpointer.wait_until_finished()
        (tmp / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(config), indent=1))
        (tmp / TOKENIZER_FILE).write_text(tokenizer_json)
        (tmp / SPECIAL_TOKENS_FILE).write_text(json.dumps(special, indent=1))
        (tmp / GENERATION_DEFAULTS_FILE).write_text(json.dumps(generation_defaults, indent=1))
        (tmp / SOURCE_FILE).write_text(made_from(source))
        if hf_overrides:
            (tmp / HF_OVERRIDES_FILE).write_text(canonical_overrides(hf_overrides))
        tmp.rename(folder)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written left behind: a disk filled midway, a ^C
        if not (isinstance(error, OSError) and folder.exists()):
            raise
        # else another process converted the same source first


def load_config(folder: Path) -> ModelConfig:
    raw = json.loads((folder / CONFIG_FILE).read_text())
    if raw.get("rope_scaling"):
        raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
    raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
    if raw.get("rope_freq_factors") is not None:
        raw["rope_freq_factors"] = tuple(raw["rope_freq_factors"])
    return ModelConfig(**raw)


def restore_params(folder: Path, target: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """Restores the weights onto `target` (shape, dtype and sharding per parameter name)."""
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(folder.resolve() / PARAMS_DIR, target)
