"""Tokenizer (HF `tokenizers`, built from GGUF metadata or `tokenizer.json`), chat templates, streaming detokenizer."""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import Template, nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from sluice.model.config import read_json_object

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


# The pre-tokenizers (`tokenizer.ggml.pre`: Llama 3's, Mistral's Tekken) whose files llama.cpp adds a BOS to where
# they do not say whether to (`tokenizer.ggml.add_bos_token`).
ADDS_BOS_UNLESS_TOLD = ("llama3", "llama-v3", "llama-bpe", "tekken", "pixtral")


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
        # A tokenizer.json keeps the truncation and padding it was last used with, which the library applies to
        # every encode; transformers applies them only where a call asks (a prompt was cut to their length).
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self.special = special
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._pieces_by_kept: dict[frozenset[int], BytePieces] = {}

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
        # encode_batch lets go of the GIL while it runs (encode does not): a megabyte of prompt encoded in a
        # worker thread then stalls no other thread for the second it takes.
        ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.special.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int] | tuple[int, ...], *, skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def special_token_id(self, text: str) -> int | None:
        """The id of `text` if the vocabulary holds it as one special token (so it decodes to no text by default)."""
        ids = self.encode(text, add_special_tokens=False) if text else []
        return ids[0] if len(ids) == 1 and not self.decode(ids) else None

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (bytes of a split character come out as U+FFFD)."""
        return self._backend.decode([token_id], skip_special_tokens=False)

    def vocab_strings(self, ids: list[int]) -> list[str]:
        """Each token's string as the vocabulary writes it (`Ġthe` for a byte-level BPE's " the"), as HF's
        `convert_ids_to_tokens` gives it."""
        return [self._backend.id_to_token(token_id) for token_id in ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for, even when they are part of a UTF-8 character."""
        token = self._backend.id_to_token(token_id)
        if token is None or token_id in self._added_tokens:
            return self.token_text(token_id).encode()
        if self._byte_level:
            return bytes(_BYTE_OF_CHAR[c] for c in token)
        if (byte := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", token)) is not None:  # SentencePiece byte fallback
            return bytes([int(byte.group(1), 16)])
        return token.replace("\u2581", " ").encode()

    def decode_stream(self, prompt_ids: list[int] | tuple[int, ...] = (), *, skip_special_tokens: bool = True,
                      kept_special_ids: frozenset[int] = frozenset()) -> IncrementalDetokenizer | ByteDetokenizer:
        """A streaming detokenizer for a sequence that follows `prompt_ids`, whose text joins to `decode`'s with
        the same `skip_special_tokens`. `kept_special_ids`: special tokens whose text is kept all the same (a tool
        call format's markers), as if they were no special tokens."""
        if self._byte_pieces is not None:
            return ByteDetokenizer(self._byte_pieces_keeping(self._special_ids if not skip_special_tokens
                                                             else kept_special_ids & self._special_ids))
        return IncrementalDetokenizer(self._backend, prompt_ids, skip_special_tokens=skip_special_tokens,
                                      kept_special_ids=kept_special_ids, special_ids=self._special_ids)

    @cached_property
    def _byte_pieces(self) -> BytePieces | None:
        """Each token's bytes, special tokens' none (skipped), for a byte-level vocabulary whose added tokens are
        all special; None otherwise."""
        added = self._added_tokens
        if not self._byte_level or any(not token.special for token in added.values()):
            return None
        size = self._backend.get_vocab_size(with_added_tokens=True)
        return BytePieces([b"" if i in added else self.token_bytes(i) for i in range(size)])

    def _byte_pieces_keeping(self, kept: frozenset[int]) -> BytePieces:
        """`_byte_pieces` with the bytes (the text) of the special tokens `kept`, for streams that keep it; built on
        first use for each set (a server's requests keep few: none, all, a tool-call format's markers). The
        library's decode passes special tokens through the byte-level decoder like any other, so their bytes join
        their neighbours' as a table lookup joins them."""
        if not kept:
            return self._byte_pieces
        if kept not in self._pieces_by_kept:
            pieces = self._byte_pieces.bytes
            self._pieces_by_kept[kept] = BytePieces([self.token_bytes(i) if i in kept else piece
                                                     for i, piece in enumerate(pieces)])
        return self._pieces_by_kept[kept]

    @cached_property
    def _special_ids(self) -> frozenset[int]:
        return _special_ids(self._backend)

    @cached_property
    def _added_tokens(self) -> dict[int, AddedToken]:
        """The added tokens by id (the library builds this dict anew on every call)."""
        return self._backend.get_added_tokens_decoder()

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The model's chat template rendered as Hugging Face renders it; ChatTemplateError if it cannot be.

        `tools`: function definitions (OpenAI's `{"type": "function", "function": {...}}`), the template's `tools`.
        `template_kwargs`: more variables for the template (vLLM's `chat_template_kwargs`, such as Qwen3's
        `enable_thinking`); none may be one of `TEMPLATE_VARIABLES`. `documents` is None unless they set it, as
        Hugging Face's `apply_chat_template` always passes it (`documents is defined` holds).
        """
        template = self._chat_template
        if template is None:
            raise ChatTemplateError("this model has no chat template; use the completions API")
        if isinstance(template, ChatTemplateError):
            raise ChatTemplateError(str(template))
        bos = self.token_text(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.token_text(self.eos_token_ids[0]) if self.eos_token_ids else ""
        try:
            return template.render(
                **{"documents": None, **(template_kwargs or {})}, messages=messages,
                add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos, tools=tools,
            )
        except Exception as error:  # the model's code, failing on these messages: raise_exception's or any other
            raise ChatTemplateError(f"the chat template failed: {error}") from None

    @cached_property
    def _chat_template(self) -> Template | ChatTemplateError | None:
        """The compiled template, or why it does not compile: found once, not at each chat."""
        if not self.special.chat_template:
            return None
        try:
            return compile_chat_template(self.special.chat_template)
        except ChatTemplateError as error:
            return ChatTemplateError(f"the model's {error}")

    @property
    def chat_template_error(self) -> str | None:
        """Why the chat template does not compile (None: it does, or there is none)."""
        return str(self._chat_template) if isinstance(self._chat_template, ChatTemplateError) else None

    def with_chat_template(self, template: str) -> Tokenizer:
        """This tokenizer, rendering chats with `template` instead of the model's (vLLM's --chat-template)."""
        return Tokenizer(self._backend, replace(self.special, chat_template=template))

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
        bos, eos, eot = (token_ids_of(fields.get(f"tokenizer.ggml.{key}"),
                                      f"the GGUF metadata's tokenizer.ggml.{key}", len(tokens), many=False)
                         for key in ("bos_token_id", "eos_token_id", "eot_token_id"))
        special = SpecialTokens(
            bos_token_id=bos[0] if bos else None,
            eos_token_ids=tuple(dict.fromkeys((*eos, *eot))),
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token",
                                    fields.get("tokenizer.ggml.pre") in ADDS_BOS_UNLESS_TOLD)),
            chat_template=fields.get("tokenizer.chat_template"),
        )
        return cls(backend, special)

    @classmethod
    def from_hf_folder(cls, folder: Path, model_config: Mapping[str, Any]) -> Tokenizer:
        """Reads `tokenizer.json` (+ `tokenizer_config.json` for the chat template, BOS policy and the BOS and EOS
        tokens; `model_config`, the folder's config.json, for the BOS and EOS ids where tokenizer_config.json names
        none); ValueError naming the file that is missing or does not read, or the key whose tokens are no ids of
        the tokenizer. Its EOS is the chat template's `eos_token`, as transformers renders it; the model stops at
        more (`generation_config.hf_stop_token_ids`)."""
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{folder} has no tokenizer.json (Sluice reads an HF folder's tokenizer from it)")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as error:  # the library raises a bare Exception for a file it cannot parse
            raise ValueError(f"tokenizer.json does not read as a tokenizer: {error}") from None
        config = read_json_object(folder / "tokenizer_config.json", missing_ok=True)  # tokenizer.json alone will do
        size = backend.get_vocab_size(with_added_tokens=True)
        named_bos, named_eos = (_named_token_id(backend, config, key) for key in ("bos_token", "eos_token"))
        bos_ids = named_bos or token_ids_of(model_config.get("bos_token_id"), "config.json's bos_token_id", size,
                                            many=False)
        eos_ids = named_eos or token_ids_of(model_config.get("eos_token_id"), "config.json's eos_token_id", size)
        bos = bos_ids[0] if bos_ids else None
        # A tokenizer.json whose post-processor already adds BOS must not get a second one.
        adds_bos_itself = bos is not None and bos in backend.encode("a", add_special_tokens=True).ids
        special = SpecialTokens(
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            add_bos=bool(config.get("add_bos_token", False)) or adds_bos_itself,
            chat_template=_hf_chat_template(folder, config.get("chat_template")),
        )
        return cls(backend, special)


def _named_token_id(backend: HFTokenizer, config: Mapping[str, Any], key: str) -> tuple[int, ...]:
    """The id of the token tokenizer_config.json's `key` names (its text, or an AddedToken's object), if the
    vocabulary holds it: () otherwise; ValueError for a value of another kind."""
    token = config.get(key)
    if isinstance(token, dict):
        token = token.get("content")
    if token is not None and not isinstance(token, str):
        raise ValueError(f"tokenizer_config.json's {key} must be a token's text, got {config[key]!r:.80}")
    found = None if token is None else backend.token_to_id(token)
    return () if found is None else (found,)


def token_ids_of(value: Any, where: str, vocab_size: int, *, many: bool = True) -> tuple[int, ...]:
    """A JSON file's token-id field (an id, a list of them where `many`, or null) as ids; ValueError naming it
    (`where`) for another value, or an id not below the tokenizer's `vocab_size`."""
    ids = value if many and isinstance(value, list) else [] if value is None else [value]
    if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(f"{where} must be a token id{' or a list of them' if many else ''}, got {value!r:.80}")
    if outside := [i for i in ids if not 0 <= i < vocab_size]:
        raise ValueError(f"{where} {outside[0]} is not an id of the tokenizer's {vocab_size} tokens")
    return tuple(ids)


def _hf_chat_template(folder: Path, configured: Any) -> str | None:
    """The chat template as transformers reads an HF folder's: its chat_template.jinja, else tokenizer_config.json's
    `chat_template`, which may be a list of named templates (the one named "default" renders chats); ValueError
    for one that is neither."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if isinstance(configured, list):
        named = {t.get("name"): t.get("template") for t in configured if isinstance(t, dict)}
        configured = named.get("default")
    if configured is not None and not isinstance(configured, str):
        raise ValueError(f"tokenizer_config.json's chat_template is neither a template nor a list of named ones: "
                         f"{configured!r:.80}")
    return configured


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, or failed on these messages (raise_exception included)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`, which marks an assistant's text for transformers'
    `return_assistant_tokens_mask`: the text renders as it is."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def compile_chat_template(text: str) -> Template:
    """`text` as a chat template; ChatTemplateError if it does not compile."""
    try:
        return _chat_template_environment().from_string(text)
    except TemplateError as error:
        raise ChatTemplateError(f"chat template does not compile: {error}") from None


def _chat_template_environment() -> ImmutableSandboxedEnvironment:
    """The environment Hugging Face renders chat templates in: sandboxed, lenient undefined variables,
    `{% break %}`/`{% continue %}`, `{% generation %}`, `raise_exception`, `strftime_now` and a `tojson` that keeps
    non-ASCII text."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# What `apply_chat_template` gives a template itself, and the environment's globals (`namespace`, `range`, ...):
# a request's template variables may not replace them.
TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
                                *_chat_template_environment().globals})


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}


_BYTE_OF_CHAR = _byte_level_alphabet()
# DecodeStream needs a few preceding ids for context-dependent decoders (a SentencePiece leading space).
_DECODE_CONTEXT = 4


class BytePieces:
    """A byte-level vocabulary's tokens as bytes, and as text where their bytes are whole UTF-8 characters."""

    def __init__(self, pieces: list[bytes]):
        self.bytes = pieces
        self.text = [_whole_text(piece) for piece in pieces]


def _whole_text(piece: bytes) -> str | None:
    try:
        return piece.decode()
    except UnicodeDecodeError:
        return None


class ByteDetokenizer:
    """`IncrementalDetokenizer` for a byte-level vocabulary, where every token stands for fixed bytes: a table
    lookup per token instead of a call into the tokenizers library, with the same text (tests/test_tokenizer.py).

    Bytes of a character split across tokens are held back until the character completes (bytes that never can
    come out as U+FFFD, as the library's decoding does); special tokens produce the text `pieces` gives them (none
    from `Tokenizer._byte_pieces`, which skips them).
    """

    def __init__(self, pieces: BytePieces):
        self._bytes = pieces.bytes
        self._texts = pieces.text
        self._held = b""

    def push(self, new_ids: list[int] | tuple[int, ...]) -> str:
        """Appends tokens and returns the text they complete (possibly "")."""
        if not self._held:
            try:  # the usual case, every token a whole piece of text: no bytes held, none to hold
                return "".join([self._texts[token_id] for token_id in new_ids])
            except (TypeError, IndexError):  # a piece of a character (None), or a token past the tokenizer's
                pass
        text = ""
        for token_id in new_ids:
            if token_id >= len(self._bytes):
                continue  # a model's vocabulary padded past the tokenizer's: no text, as for a special token
            if not self._held and (piece := self._texts[token_id]) is not None:
                text += piece
                continue
            self._held += self._bytes[token_id]
            decoded = self._held.decode(errors="replace")
            if not decoded.endswith("\ufffd"):
                text += decoded
                self._held = b""
        return text

    def flush(self) -> str:
        """The held bytes as U+FFFD, for a stream that ends before their character completes: the whole text
        then reads as the library's decode of the ids (its lossy UTF-8 decoding, as Python's errors="replace")."""
        text, self._held = self._held.decode(errors="replace"), b""
        return text


class IncrementalDetokenizer:
    """Turns a growing sequence of token ids into text deltas, for streaming (tokenizers' `DecodeStream`).

    Bytes of a character split across tokens are held back until the character completes; special tokens
    produce no text unless `skip_special_tokens` is False or they are among `kept_special_ids`. Those kept are
    decoded as the others are with `skip_special_tokens` False, the rest left out before decoding, as the library
    leaves them out. `special_ids`: the backend's special tokens, if known (`Tokenizer` keeps them: a request
    should not list the vocabulary's added tokens again).
    """

    def __init__(self, backend: HFTokenizer, prompt_ids: list[int] | tuple[int, ...] = (), *,
                 skip_special_tokens: bool = True, kept_special_ids: frozenset[int] = frozenset(),
                 special_ids: frozenset[int] | None = None):
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens and not kept_special_ids
        if skip_special_tokens and kept_special_ids:
            self._dropped = (_special_ids(backend) if special_ids is None else special_ids) - kept_special_ids
        else:
            self._dropped = frozenset()
        # the ids of the last text, as the stream keeps them
        self._context = _decode_context(backend, [i for i in prompt_ids if i not in self._dropped],
                                        self._skip_special_tokens)
        self._stream = DecodeStream(ids=self._context, skip_special_tokens=self._skip_special_tokens)
        self._held: list[int] = []  # the ids pushed since the last text

    def push(self, new_ids: list[int] | tuple[int, ...]) -> str:
        """Appends tokens and returns the text they complete (possibly "")."""
        text = ""
        for token_id in new_ids:
            if token_id in self._dropped:
                continue
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception as error:  # noqa: BLE001 - the library raises a bare Exception
                piece = self._restart(token_id, error)
            if piece is None:
                self._held.append(token_id)
            else:
                text += piece
                self._context, self._held = [*self._held, token_id], []
        return text

    def flush(self) -> str:
        """The held ids' text, bytes of an unfinished character as U+FFFD, for a stream that ends here: decoded
        after the ids of the last text, as `DecodeStream` decodes them (a decoder may strip the text's leading
        space), or on their own where that decode takes back text already emitted (`_restart`)."""
        if not self._held:
            return ""
        held, self._held = self._held, []
        before = self._decode(self._context)
        text = self._decode([*self._context, *held])
        if text.startswith(before):
            return text[len(before):]
        return self._decode(held)

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _restart(self, token_id: int, error: Exception) -> str | None:
        """A fresh stream from the held ids, when `DecodeStream` finds the text it emitted is no longer a prefix
        of the decode: byte-fallback tokens decode as one run, all U+FFFD if the run is not UTF-8, so a lead byte
        never finished takes back the bytes emitted before it. Their text stands; the held ones come out as
        U+FFFD."""
        if not str(error).startswith("Invalid prefix"):
            raise error
        self._stream = DecodeStream(ids=self._held, skip_special_tokens=self._skip_special_tokens)
        return self._stream.step(self._backend, token_id)


def _special_ids(backend: HFTokenizer) -> frozenset[int]:
    """The ids of the added tokens that are special (those `skip_special_tokens` leaves out)."""
    return frozenset(i for i, token in backend.get_added_tokens_decoder().items() if token.special)


def _decode_context(backend: HFTokenizer, prompt_ids: list[int] | tuple[int, ...],
                    skip_special_tokens: bool) -> list[int]:
    """The last few prompt ids, less the bytes of a character the prompt leaves unfinished (its text decoded as
    the stream decodes it): from a context whose text ends in U+FFFD, `DecodeStream` would put the context's own
    text into the stream along with the first output text."""
    context = list(prompt_ids[-_DECODE_CONTEXT:])
    while context and backend.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
        context.pop()
    return context
