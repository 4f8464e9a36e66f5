"""Tokenizer (HF `tokenizers`, built from GGUF metadata or `tokenizer.json`), chat templates, streaming detokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import StrictUndefined
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

GGUF_CONTROL_TOKEN = 3
GGUF_USER_DEFINED_TOKEN = 4

# How llama.cpp pre-tokenizers split text before byte-level BPE, by `tokenizer.ggml.pre`.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"):
        split = LLAMA3_SPLIT
    elif pre in ("qwen2", "deepseek-r1-qwen"):
        split = QWEN2_SPLIT
    elif pre in ("smollm", "starcoder", "refact"):
        # SmolLM's own tokenizer.json splits every digit apart before the GPT-2 byte-level regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        return byte_level
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


@dataclass(frozen=True)
class SpecialTokens:
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos: bool
    chat_template: str | None


class Tokenizer:
    """Text <-> token ids, plus the model's own chat template rendered with jinja2."""

    def __init__(self, backend: HFTokenizer, special: SpecialTokens):
        self._backend = backend
        self.special = special
        self._template = None
        if special.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=StrictUndefined)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(special.chat_template)

    @property
    def bos_token_id(self) -> int | None:
        return self.special.bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.special.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. `<|im_start|>`) map to their ids.

        A BOS is prepended only when the model's metadata asks for it and `add_special_tokens` is set.
        """
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.special.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int] | tuple[int, ...], *, skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (bytes of a split character come out as U+FFFD)."""
        return self._backend.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; use the completions API")
        bos = self.token_text(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.token_text(self.eos_token_ids[0]) if self.eos_token_ids else ""
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
        )

    def to_json(self) -> str:
        """The backend tokenizer as `tokenizer.json` text (special-token policy lives in `special`)."""
        return self._backend.to_str()

    @classmethod
    def from_json(cls, text: str, special: SpecialTokens) -> Tokenizer:
        return cls(HFTokenizer.from_str(text), special)

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        """Builds the byte-level BPE tokenizer that a GGUF file describes (`tokenizer.ggml.*`)."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer {kind!r}: only byte-level BPE ('gpt2') is supported")
        tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = _byte_level_pre_tokenizer(fields.get("tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        token_types = list(fields.get("tokenizer.ggml.token_type") or [])
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, token_types) if k == GGUF_CONTROL_TOKEN]
        )
        backend.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, token_types) if k == GGUF_USER_DEFINED_TOKEN]
        )
        eos = fields.get("tokenizer.ggml.eos_token_id")
        eot = fields.get("tokenizer.ggml.eot_token_id")
        special = SpecialTokens(
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(t) for t in (eos, eot) if t is not None)),
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=fields.get("tokenizer.chat_template"),
        )
        return cls(backend, special)

    @classmethod
    def from_hf_folder(cls, folder: Path) -> Tokenizer:
        """Reads `tokenizer.json` (+ `tokenizer_config.json` for the chat template and BOS policy)."""
        backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        model_config = json.loads((folder / "config.json").read_text())

        def token_id(token: Any) -> int | None:
            if isinstance(token, dict):
                token = token.get("content")
            return None if token is None else backend.token_to_id(token)

        bos = token_id(config.get("bos_token"))
        if bos is None:
            bos = model_config.get("bos_token_id")
        eos = model_config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not eos_ids and token_id(config.get("eos_token")) is not None:
            eos_ids = (token_id(config.get("eos_token")),)
        # A tokenizer.json whose post-processor already adds BOS must not get a second one.
        adds_bos_itself = bos is not None and bos in backend.encode("a", add_special_tokens=True).ids
        special = SpecialTokens(
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            add_bos=bool(config.get("add_bos_token", False)) or adds_bos_itself,
            chat_template=config.get("chat_template"),
        )
        return cls(backend, special)


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, for streaming.

    Decoding a window of recent tokens and diffing against the previous window keeps it O(1) per token; a
    window ending in U+FFFD (a multi-byte character split across tokens) is held back until it completes.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | tuple[int, ...] = ()):
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids)
        self._prefix_offset = max(len(self._ids) - 6, 0)
        self._read_offset = len(self._ids)

    def push(self, new_ids: list[int] | tuple[int, ...]) -> str:
        """Appends tokens and returns the text they complete (possibly "")."""
        self._ids.extend(new_ids)
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix_offset : self._read_offset])
        after = decode(self._ids[self._prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return after[len(before) :]
