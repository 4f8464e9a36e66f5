"""What the `sluice` commands' flags accept: argparse types that refuse a bad value in one line, and the parser
that prints only that line; and what a flag must set in the environment before jax starts."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any, NoReturn

from sluice.model.tokenizer import ChatTemplateError, compile_chat_template


class CommandError(RuntimeError):
    """Input a command refuses once it has read it (a prompt too long for the model, say): one line, exit 2."""


class OneLineErrors(argparse.ArgumentParser):
    """A parser whose refusals are one line, exit 2: argparse's own print the whole usage first, 48 lines for
    `sluice serve`, above the line that says what was wrong."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


CHAT_TEMPLATE_HELP = "a Jinja chat template, or a file holding one, rendered instead of the model's own"


def chat_template(text: str) -> str:
    """An argparse type, as vLLM reads --chat-template: the template in a file at `text`, else `text` itself if it
    reads as one (it holds a brace or a line break); refused if it does not compile."""
    path = Path(text).expanduser()
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise argparse.ArgumentTypeError(f"cannot read {path}: {error}") from None
    elif not any(mark in text for mark in "{}\n"):
        raise argparse.ArgumentTypeError(f"no such file: {text!r} (a template given inline holds {{{{ or {{%)")
    try:
        compile_chat_template(text)
    except ChatTemplateError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float": "float32", "half": "float16",
               "auto": None}
DTYPE_HELP = ("parameter dtype: float32, bfloat16 or float16 (vLLM's auto, half and float too; default: float32 on CPU, "
              "bfloat16 on GPU)")


def dtype_name(text: str) -> str | None:
    """A dtype by Sluice's name or vLLM's (`half`, `float`; `auto`: the device's default, None)."""
    if text not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(map(repr, DTYPE_NAMES))})")
    return DTYPE_NAMES[text]


def at_least(low: float, kind: type) -> Callable[[str], float]:
    """An argparse type: `kind` of the text, refused below `low` (and if not finite)."""
    return number(kind, lambda value: value >= low, f"of at least {low}")


def above(low: float, kind: type) -> Callable[[str], float]:
    """An argparse type: `kind` of the text, refused at `low` or below (and if not finite)."""
    return number(kind, lambda value: value > low, f"greater than {low}")


def fraction(text: str) -> float:
    """An argparse type: a share of something, greater than 0 and at most 1."""
    return number(float, lambda value: 0 < value <= 1, "greater than 0 and at most 1")(text)


def number(kind: type, fits: Callable[[float], bool], bound: str) -> Callable[[str], float]:
    """An argparse type: `kind` of the text, refused unless finite and `fits` (which `bound` says in words)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'a whole' if kind is int else 'a'} number: {text!r}") from None
        if not math.isfinite(value) or not fits(value):
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text}")
        return value

    return parse


def claim_gpu_memory(utilization: float | None, environ: MutableMapping[str, str]) -> str | None:
    """vLLM's --gpu-memory-utilization as jax takes it: `utilization` of each GPU's memory is what its allocator
    may hold, weights, activations and KV pool together, set in `environ` for jax's GPU backend to read when it
    starts (it has no effect once started, nor on a CPU). A share the environment gives already wins; the line
    saying so is returned (None: nothing to say, as where it gives this share: a --hosts actor, given the
    command's environment)."""
    from sluice.batching.config import MEMORY_FRACTION_VARIABLES, memory_fraction_variable  # jax: not for --help

    if utilization is None:
        return None
    given = memory_fraction_variable(environ)
    if given is None:
        environ[MEMORY_FRACTION_VARIABLES[0]] = str(utilization)
    elif _share(environ[given]) != utilization:
        return (f"--gpu-memory-utilization {utilization:g} is ignored: {given}={environ[given]} gives jax's share of "
                f"each GPU")
    return None


def _share(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def json_object(text: str, example: str) -> dict[str, Any]:
    """`text` as a JSON object; argparse's refusal, showing `example`, if it is none."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r} (example: '{example}')")
    return value


HF_OVERRIDES_EXAMPLE = ('{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, '
                        '"original_max_position_embeddings": 32768}}')
HF_OVERRIDES_HELP = ("a JSON object whose keys replace an HF folder's config.json's top-level keys before the model "
                     "is read, as vLLM's (an object given replaces the key's whole value; a rope_scaling joins "
                     "transformers 5's rope_parameters, keeping its rope_theta); the model is converted apart from "
                     f"the plain one; not for a GGUF. Example, YaRN to 4x a 32k context: '{HF_OVERRIDES_EXAMPLE}'")


def hf_overrides(text: str) -> dict[str, Any]:
    """vLLM's `--hf-overrides` JSON: the keys that replace config.json's (`model.loader.with_overrides`)."""
    return json_object(text, HF_OVERRIDES_EXAMPLE)


REVISION_HELP = "a Hub model's branch, tag or commit (default: its default branch)"
DOWNLOAD_DIR_HELP = "the HF cache folder Hub models are kept in (default: huggingface_hub's, under HF_HOME)"
