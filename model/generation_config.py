"""A model's own default sampling parameters, as its authors recommend them: an HF folder's
`generation_config.json`, a GGUF file's `general.sampling.*` metadata (which llama.cpp's converter writes from
it). Read once, at conversion, and kept beside the converted model (`checkpoint.GENERATION_DEFAULTS_FILE`). The
server applies them to the fields a request leaves out, as vLLM does (`--generation-config auto`).
And an HF folder's stop ids, its tokenizer's EOS and its generation config's, which the loader keeps in the
model's config.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sluice.model.config import read_json_object
from sluice.model.tokenizer import Tokenizer, token_ids_of

logger = logging.getLogger(__name__)

# Each default a request field may take: its key in generation_config.json, in GGUF metadata, and the values
# that field accepts (the API schemas' bounds).
_FIELDS: dict[str, tuple[str, str, Callable[[Any], bool]]] = {
    "temperature": ("temperature", "general.sampling.temp", lambda v: 0.0 <= v <= 2.0),
    "top_p": ("top_p", "general.sampling.top_p", lambda v: 0.0 < v <= 1.0),
    "top_k": ("top_k", "general.sampling.top_k", lambda v: isinstance(v, int) and v >= -1),
    "min_p": ("min_p", "general.sampling.min_p", lambda v: 0.0 <= v <= 1.0),
    "repetition_penalty": ("repetition_penalty", "general.sampling.penalty_repeat", lambda v: 0.0 < v <= 2.0),
    "max_tokens": ("max_new_tokens", "", lambda v: isinstance(v, int) and v >= 1),
}


def from_hf_folder(folder: Path) -> dict[str, float | int]:
    """The defaults an HF folder's generation_config.json sets (none without one); ValueError if it is no JSON
    object."""
    found = read_json_object(folder / "generation_config.json", missing_ok=True)
    # null is "not set" (as vLLM reads it), not a value out of range
    return _in_range({field: found[key] for field, (key, _, _) in _FIELDS.items() if found.get(key) is not None})


def hf_stop_token_ids(folder: Path, hf_config: Mapping[str, Any], tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids an HF folder's model stops at, as vLLM takes them: its tokenizer's EOS, then its generation
    config's: generation_config.json's `eos_token_id`, or config.json's (`hf_config`) where the folder has no
    generation_config.json (transformers derives the generation config from config.json then). ValueError naming
    the key, in either file, that holds no ids of the tokenizer."""
    size = tokenizer.vocab_size
    config_eos = token_ids_of(hf_config.get("eos_token_id"), "config.json's eos_token_id", size)
    path = folder / "generation_config.json"
    generation_eos = (token_ids_of(read_json_object(path, missing_ok=False).get("eos_token_id"),
                                   "generation_config.json's eos_token_id", size) if path.exists() else config_eos)
    return tuple(dict.fromkeys((*tokenizer.eos_token_ids, *generation_eos)))


def from_gguf_fields(fields: Mapping[str, Any]) -> dict[str, float | int]:
    """The defaults a GGUF file's metadata (`fields`: key -> value, as gguf's reader gives them) sets."""
    found = {field: fields[key] for field, (_, key, _) in _FIELDS.items() if key and key in fields}
    return _in_range({field: round(value, 6) if isinstance(value, float) else value  # float32: 0.6, not 0.6000000238
                      for field, value in found.items()})


def _in_range(found: dict[str, Any]) -> dict[str, float | int]:
    """`found` without the values out of their field's range, each left out with a warning: a request could not
    have set it either."""
    defaults = {}
    for field, value in found.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or not _FIELDS[field][2](value):
            logger.warning("ignoring the model's default %s of %r (out of the field's range)", field, value)
            continue
        defaults[field] = value
    return defaults
