"""A model's own default sampling parameters, as its authors recommend them: an HF folder's
`generation_config.json`, a GGUF file's `general.sampling.*` metadata (which llama.cpp's converter writes from
it). The server applies them to the fields a request leaves out, as vLLM does (`--generation-config auto`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def generation_defaults(source: Path) -> dict[str, float | int]:
    """The request fields (`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `max_tokens`) that the
    model at `source` (a .gguf file or an HF folder) sets defaults for, with their values. A value out of the field's
    range is left out, with a warning: a request could not have set it either."""
    if source.is_dir():
        path = source / "generation_config.json"
        try:
            found = json.loads(path.read_text()) if path.is_file() else {}
        except ValueError as error:
            raise ValueError(f"{path} is not JSON: {error}") from None
        if not isinstance(found, dict):
            raise ValueError(f"{path} is not a JSON object")
        # null is "not set" (as vLLM reads it), not a value out of range
        found = {field: found[key] for field, (key, _, _) in _FIELDS.items() if found.get(key) is not None}
    else:
        found = _gguf_sampling(source)
    defaults = {}
    for field, value in found.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or not _FIELDS[field][2](value):
            logger.warning("%s: ignoring the model's default %s of %r (out of the field's range)", source.name,
                           field, value)
            continue
        defaults[field] = value
    return defaults


def _gguf_sampling(path: Path) -> dict[str, Any]:
    from sluice.model.weights import open_gguf

    reader = open_gguf(path)
    keys = {key: field for field, (_, key, _) in _FIELDS.items() if key}
    found = {keys[name]: f.contents() for name, f in reader.fields.items() if name in keys}
    return {field: round(value, 6) if isinstance(value, float) else value  # float32 metadata: 0.6, not 0.6000000238
            for field, value in found.items()}
