"""Models from the Hugging Face Hub, named as vLLM names them: `ORG/NAME` (the files of an HF folder that Sluice
reads) or `ORG/NAME:QUANT` (the one GGUF file of that quant type in a GGUF repository). Both are kept in the HF cache
(`HF_HOME`, `HF_HUB_CACHE`, or a `--download-dir`), as vLLM keeps them: a branch or tag is asked of the Hub for its
commit, whose files are downloaded if the cache lacks them, and the cached copy is served if the Hub cannot be reached
or refuses; a commit found there, or any revision while HF_HUB_OFFLINE is set, is served with no network at all.
A PEFT adapter's repository (`--lora-modules NAME=ORG/NAME`, as vLLM takes one) is kept the same way at its default
branch (`download_adapter`): its two files that model/lora.py reads.

gguf and huggingface_hub are imported by the functions that use them, as model/weights.py imports gguf: an engine
that serves no Hub id (the GPU image has no gguf) tells one from a path with `is_hub_id` alone."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO_ID = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9._-]*/[a-zA-Z0-9][a-zA-Z0-9._-]*")  # vLLM's
GGUF_ID = re.compile(rf"({REPO_ID.pattern}):([A-Za-z0-9_+-]+)")
ID_AT_REVISION = re.compile(rf"({REPO_ID.pattern})@(.+)")  # what some tools take, and vLLM does not
COMMIT = re.compile(r"[0-9a-f]{40}")  # a revision that is a commit's full hash, as huggingface_hub tells one

# What reading an HF folder opens: model/weights.py, model/tokenizer.py, model/generation_config.py.
FOLDER_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "*.safetensors", "*.safetensors.index.json"]
# What FOLDER_FILES match that Sluice does not read: files in sub-folders (fnmatch's * crosses "/"; Meta's original/
# checkpoint, which vLLM leaves out with "original/**/*") and Mistral's consolidated.safetensors (the same weights in
# Mistral's names, which the index leaves out).
FOLDER_IGNORED = ["*/*", "consolidated*.safetensors"]
# What reading a PEFT adapter opens: model/lora.py's CONFIG_FILE and WEIGHTS_FILE (named again here, as model/lora.py
# imports model/loader.py, which imports this module). Names with no wildcard match the top folder's files alone, not
# a training run's checkpoint-*/ folders.
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]

# vLLM's size suffixes of a GGML type in GGUF file names (Q4_K_M is a Q4_K).
SIZE_SUFFIXES = ("_M", "_S", "_L", "_XL", "_XS", "_XXS")
SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
PROJECTOR = "*mmproj*"  # a multimodal model's vision projector, whose name may end in the quant type too


class HubError(RuntimeError):
    """A model id the Hub cannot give; the message, one line, names the id and says what to do."""


@dataclass(frozen=True)
class Wanted:
    """What Sluice reads of a kind of Hub repository: the files downloaded (`patterns` less `ignored`, as
    snapshot_download's allow_patterns and ignore_patterns), whether a snapshot `holds` enough of them to be read,
    what that is (`needed`, as an error says it) and what a repository without it is told (`otherwise`)."""

    patterns: list[str]
    ignored: list[str]
    holds: Callable[[Path], bool]
    needed: str
    otherwise: str


MODEL = Wanted(FOLDER_FILES, FOLDER_IGNORED,
               holds=lambda folder: (folder / "config.json").is_file() and any(folder.glob("*.safetensors")),
               needed="config.json with *.safetensors",
               otherwise="Sluice reads safetensors or GGUF (a GGUF repository's file is named by its quant type, as "
                         "ORG/NAME-GGUF:Q4_K_M)")
ADAPTER = Wanted(ADAPTER_FILES, [],
                 holds=lambda folder: all((folder / name).is_file() for name in ADAPTER_FILES),
                 needed=" with ".join(ADAPTER_FILES),
                 otherwise="it is no PEFT adapter that Sluice reads (one saved as adapter_model.bin, a pickle: "
                           "convert it to safetensors)")


def is_hub_id(model: str) -> bool:
    """Whether `model` reads as a Hub model id, `ORG/NAME` or `ORG/NAME:QUANT` (a local path is looked for first)."""
    return REPO_ID.fullmatch(model) is not None or GGUF_ID.fullmatch(model) is not None


def download(model: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The local path of Hub model `model` at `revision` (None: the default branch): its snapshot folder, or for
    `ORG/NAME:QUANT` its GGUF file, kept in the HF cache (`download_dir`, else huggingface_hub's) as the module's
    docstring tells; HubError if neither the Hub nor the cache can give it."""
    with _said_in_one_line(model, revision, download_dir):
        if (gguf_id := GGUF_ID.fullmatch(model)) is not None:
            return _gguf_file(model, *gguf_id.groups(), revision, download_dir)
        return _folder(model, revision, download_dir, MODEL)


def download_adapter(repo_id: str, download_dir: str | None = None) -> Path:
    """The snapshot folder of the PEFT adapter `repo_id` at its default branch, holding ADAPTER_FILES, kept in the HF
    cache as `download` keeps a model's folder; HubError if neither the Hub nor the cache can give it, or the
    repository is no PEFT adapter in safetensors."""
    with _said_in_one_line(repo_id, None, download_dir):
        return _folder(repo_id, None, download_dir, ADAPTER)


@contextmanager
def _said_in_one_line(model: str, revision: str | None, download_dir: str | None) -> Iterator[None]:
    """Any error getting `model` raised as a HubError of one line that names it."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import httpx  # httpx or httpx2, whichever this huggingface_hub runs on

    try:
        yield
    except HubError:
        raise
    except (OSError, HFValidationError, httpx.TransportError) as error:
        raise _refusal(model, revision, download_dir or constants.HF_HUB_CACHE, error) from None
    except Exception as error:  # hf_xet's RuntimeErrors, the ValueError asking to install hf_xet, ...
        first_line = next(iter(str(error).strip().splitlines()), "")
        raise HubError(f"cannot download {model}: {type(error).__name__}: {first_line}") from None


def _folder(model: str, revision: str | None, download_dir: str | None, wanted: Wanted) -> Path:
    """The snapshot folder of `model` at `revision` holding the files `wanted`, from the HF cache or the Hub."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if _cache_first(revision):
        try:
            cached = _cached_snapshot(model, revision, download_dir, wanted.patterns, wanted.ignored)
        except LocalEntryNotFoundError:
            if constants.HF_HUB_OFFLINE:
                raise
            cached = None
        if cached is not None and wanted.holds(cached):
            return cached
        if constants.HF_HUB_OFFLINE:
            raise _incomplete(model, revision, cached, "HF_HUB_OFFLINE is set: unset it to complete the download "
                              f"(it holds no {wanted.needed})")
    folder = Path(snapshot_download(model, revision=revision, cache_dir=download_dir, allow_patterns=wanted.patterns,
                                    ignore_patterns=wanted.ignored))
    if not wanted.holds(folder):
        raise HubError(f"{model} holds no {wanted.needed}: {wanted.otherwise}")
    return folder


def _gguf_file(model: str, repo_id: str, quant_type: str, revision: str | None, download_dir: str | None) -> Path:
    from huggingface_hub import HfApi, constants, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, RevisionNotFoundError
    from huggingface_hub.utils import httpx

    if not is_quant_type(quant_type):
        raise HubError(f"{model}: {quant_type!r} is not a GGUF quant type (as Q4_K_M, Q8_0, F16 or UD-Q4_K_XL)")
    if _cache_first(revision):
        if (cached := _cached_gguf(repo_id, quant_type, revision, download_dir)) is not None:
            return cached
        if constants.HF_HUB_OFFLINE:
            raise _offline(model, revision, download_dir)
    try:
        # The repository's information names its files, in one request (list_repo_files retries an unreachable Hub
        # for some 20 s before the cached copy could be served).
        names = [file.rfilename for file in HfApi().model_info(repo_id, revision=revision).siblings or []]
    except RevisionNotFoundError:
        raise
    except (httpx.ConnectError, httpx.TimeoutException, HfHubHTTPError):
        # What snapshot_download does when the Hub cannot be reached or refuses: the cached copy, if there is one.
        if (cached := _cached_gguf(repo_id, quant_type, revision, download_dir)) is not None:
            return cached
        raise
    name = choose_gguf(model, names, quant_type)
    return Path(hf_hub_download(repo_id, name, revision=revision, cache_dir=download_dir))


def _cache_first(revision: str | None) -> bool:
    """Whether the HF cache's copy of `revision` is served without asking the Hub: where it is a commit, whose files
    never change, or huggingface_hub is offline. A branch or tag is asked for its commit, as vLLM asks
    (`snapshot_download`), and the cached copy served only if the Hub cannot be reached or refuses."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or (revision is not None and COMMIT.fullmatch(revision) is not None)


def is_quant_type(text: str) -> bool:
    """vLLM's rule: a GGML type (Q8_0), one with a size suffix (Q4_K_M), or either after a dashed prefix
    (UD-Q4_K_XL); in either case, as GGUF file names spell them (Qwen's are lower case)."""
    from gguf import GGMLQuantizationType

    base = text.rsplit("-", 1)[-1].upper()
    return any(base.removesuffix(suffix) in GGMLQuantizationType.__members__ for suffix in ("", *SIZE_SUFFIXES))


def gguf_patterns(quant_type: str) -> list[str]:
    """vLLM's names of a quant type's GGUF files, in lower case: NAME-QUANT.gguf, or NAME-QUANT-REST.gguf (a split
    part), in any folder (fnmatch's * crosses "/", as huggingface_hub's allow_patterns, where vLLM passes them)."""
    return [f"*-{quant_type.lower()}.gguf", f"*-{quant_type.lower()}-*.gguf"]


def matching(names: list[str], quant_type: str) -> list[str]:
    """The names of `names` that are `quant_type`'s GGUF files (`gguf_patterns`, in either case), but for a vision
    projector."""
    return sorted(name for name in names if any(fnmatch.fnmatchcase(name.lower(), p) for p in gguf_patterns(quant_type))
                  and not fnmatch.fnmatchcase(name.lower(), PROJECTOR))


def single_files(names: list[str]) -> list[str]:
    return [name for name in names if SPLIT_PART.search(name) is None]


def choose_gguf(model: str, names: list[str], quant_type: str) -> str:
    """The one single-file GGUF of `quant_type` among a repository's file `names`; HubError if none or several
    are, or the model is split over files."""
    found = matching(names, quant_type)
    single = single_files(found)
    if len(single) == 1:
        return single[0]
    if len(single) > 1:
        raise HubError(f"{model}: {len(single)} GGUF files are {quant_type} ({some_of(single)}): Sluice reads one; "
                       f"download the one meant and pass its path")
    if found:
        raise HubError(f"{model}: the {quant_type} model is split over files ({some_of(found)}): Sluice reads "
                       f"single-file GGUFs (llama.cpp's gguf-split --merge makes one)")
    others = sorted(name for name in names if name.endswith(".gguf"))
    holds = f"its GGUF files are {some_of(others)}" if others else "it holds no GGUF file"
    raise HubError(f"{model}: no GGUF file of quant type {quant_type} ({holds})")


def some_of(names: list[str]) -> str:
    """The first three of `names`, and "..." for any more: a listing that fits in an error's line."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _cached_snapshot(repo_id: str, revision: str | None, download_dir: str | None,
                     allow_patterns: list[str] | None = None, ignore_patterns: list[str] | None = None) -> Path:
    """The snapshot folder of `revision` in the HF cache, without going to the network; LocalEntryNotFoundError if
    it is not there, IncompleteSnapshotError if the cache's listing of the commit's files names some it lacks of
    `allow_patterns` less `ignore_patterns`."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir, local_files_only=True,
                                  allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))


def _cached_gguf(repo_id: str, quant_type: str, revision: str | None, download_dir: str | None) -> Path | None:
    """The one single-file GGUF of `quant_type` in the HF cache's snapshot of `revision`; None if there is not one."""
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        snapshot = _cached_snapshot(repo_id, revision, download_dir)
    except IncompleteSnapshotError as error:
        # The cache's listing of the commit's files names files the cache lacks (the quant type's split parts, other
        # quant types, the README): the one looked for may be there all the same.
        snapshot = Path(error.snapshot_path)
    except LocalEntryNotFoundError:
        return None
    names = [str(path.relative_to(snapshot)) for path in snapshot.rglob("*.gguf")]
    single = single_files(matching(names, quant_type))
    return snapshot / single[0] if len(single) == 1 else None


def _offline(model: str, revision: str | None, download_dir: str | None) -> HubError:
    """The refusal of a model found in no HF cache while huggingface_hub is offline (HF_HUB_OFFLINE)."""
    from huggingface_hub import constants

    return HubError(f"{_named(model, revision)} is not in the HF cache ({download_dir or constants.HF_HUB_CACHE}) and "
                    f"HF_HUB_OFFLINE is set: unset it to download the model, or download it where there is a network "
                    f"into that cache")


def _incomplete(model: str, revision: str | None, snapshot: Path | str, reason: str) -> HubError:
    """The refusal of a copy in the HF cache that lacks files, which cannot be completed for `reason`."""
    return HubError(f"the HF cache's copy of {_named(model, revision)} ({snapshot}) is incomplete and {reason}")


def _named(model: str, revision: str | None) -> str:
    return model if revision is None else f"{model} at revision {revision!r}"


def _refusal(model: str, revision: str | None, cache: str, error: Exception) -> HubError:
    """`error`, raised getting `model`, said in one line. huggingface_hub raises LocalEntryNotFoundError for a
    download it could not begin, from the Hub's refusal or the network's error that is the reason."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, IncompleteSnapshotError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)
    from huggingface_hub.utils import httpx

    if isinstance(error, IncompleteSnapshotError):
        reason = ("HF_HUB_OFFLINE is set: unset it to complete the download" if constants.HF_HUB_OFFLINE else
                  f"the Hugging Face Hub ({constants.ENDPOINT}) could not complete it "
                  f"({type(error.__cause__).__name__}): check the network")
        return _incomplete(model, revision, error.snapshot_path, reason)
    if isinstance(error, LocalEntryNotFoundError) and constants.HF_HUB_OFFLINE:
        return _offline(model, revision, cache)
    if isinstance(error, LocalEntryNotFoundError) and error.__cause__ is not None:
        error = error.__cause__
    if isinstance(error, GatedRepoError):
        return HubError(f"{model} is gated on the Hugging Face Hub: accept its terms on its page, and set HF_TOKEN "
                        f"to a token of that account")
    if isinstance(error, RepositoryNotFoundError):
        return HubError(f"no model {model} on the Hugging Face Hub (a private one needs HF_TOKEN set to a token with "
                        f"access to it), nor a file or folder {model} here")
    if isinstance(error, RevisionNotFoundError):
        return HubError(f"{model} has no revision {revision!r} on the Hugging Face Hub")
    if isinstance(error, HfHubHTTPError) and error.response.status_code in (401, 403):
        return HubError(f"the Hugging Face Hub refused {model} ({error.response.status_code}): set HF_TOKEN to a "
                        f"token with access to it")
    if isinstance(error, HfHubHTTPError):
        return HubError(f"the Hugging Face Hub answered {error.response.status_code} for {model}")
    if isinstance(error, (LocalEntryNotFoundError, httpx.TransportError)):
        return HubError(f"cannot reach the Hugging Face Hub ({constants.ENDPOINT}) for {_named(model, revision)}, "
                        f"which is not in the HF cache ({cache}): check the network")
    if isinstance(error, HFValidationError):
        return HubError(f"{model} is not a Hugging Face Hub model id: {error}")
    return HubError(f"cannot keep {model} in the HF cache ({cache}): {error.strerror or error}: set HF_HOME or "
                    f"--download-dir to a folder Sluice may write")
