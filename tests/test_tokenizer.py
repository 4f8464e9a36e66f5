"""Tokenizer details the API exposes: raw token bytes, streaming detokenization, Hugging Face's template environment."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from sluice.model.tokenizer import ByteDetokenizer, ChatTemplateError, IncrementalDetokenizer, Tokenizer

SPLIT_CHARACTER_TEXT = "Tokyo is 東京 (tōkyō)."


@pytest.fixture(scope="module")
def tokenizer(smollm2) -> Tokenizer:
    return smollm2.tokenizer


def with_template(tokenizer: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer.from_json(tokenizer.to_json(), replace(tokenizer.special, chat_template=template))


def test_token_bytes_are_raw_even_when_a_token_holds_part_of_a_character(tokenizer):
    ids = tokenizer.encode(SPLIT_CHARACTER_TEXT)
    partial = [i for i in ids if tokenizer.token_text(i).endswith("\ufffd")]
    assert partial, "the text should contain a character split across tokens"
    assert all(b"\xef\xbf\xbd" not in tokenizer.token_bytes(i) for i in partial)  # not U+FFFD's bytes
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == SPLIT_CHARACTER_TEXT.encode()


def test_special_token_bytes_are_its_text(tokenizer):
    assert tokenizer.token_bytes(tokenizer.eos_token_ids[0]) == b"<|im_end|>"


def test_decode_stream_holds_split_characters_back_and_joins_to_the_text(tokenizer):
    stream = tokenizer.decode_stream(tokenizer.encode("Say:"))
    pieces = [stream.push([i]) for i in tokenizer.encode(SPLIT_CHARACTER_TEXT)]
    assert "".join(pieces) == SPLIT_CHARACTER_TEXT
    assert "" in pieces and not any("\ufffd" in p for p in pieces)


def test_the_byte_level_stream_gives_the_text_of_the_library_stream(tokenizer):
    """The table-driven stream (`ByteDetokenizer`) against tokenizers' own `DecodeStream`, on text with split
    characters, special tokens, and random ids (bytes that never form a character), pushed in random groups."""
    rng = random.Random(0)
    texts = [SPLIT_CHARACTER_TEXT, "Emoji 🙂👍🏽 and café, naïve, 数学, Привет", "plain words and digits 12345"]
    sequences = [tokenizer.encode(text) for text in texts]
    sequences.append([*sequences[1][:5], tokenizer.eos_token_ids[0], *sequences[1][5:]])
    sequences += [[rng.randrange(tokenizer.vocab_size) for _ in range(60)] for _ in range(20)]
    for ids in sequences:
        fast = tokenizer.decode_stream([])
        assert isinstance(fast, ByteDetokenizer)
        library = IncrementalDetokenizer(tokenizer._backend)
        start = 0
        while start < len(ids):
            group = ids[start:start + rng.randint(1, 4)]
            assert fast.push(group) == library.push(group), ids
            start += len(group)


def test_ids_of_a_vocabulary_padded_past_the_tokenizers_give_no_text(tokenizer):
    hello = tokenizer.encode("Hello")
    stream = tokenizer.decode_stream([])
    assert stream.push([*hello, tokenizer.vocab_size, tokenizer.vocab_size + 63]) == "Hello"


def test_chat_template_gets_hugging_face_globals_filters_and_loop_controls(tokenizer):
    template = (
        "{% if tools %}TOOLS{% endif %}"
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{{ m['role'] }}={{ m['content'] | tojson }};{% endfor %}"
        "{{ strftime_now('%Y')[:2] }}"
    )
    rendered = with_template(tokenizer, template).apply_chat_template(
        [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
    )
    assert rendered == 'user="héllo";assistant="a";20'


def test_raise_exception_in_a_template_is_a_chat_template_error(tokenizer):
    strict = with_template(tokenizer, "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="user first"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_a_template_that_does_not_compile_is_a_chat_template_error(tokenizer):
    with pytest.raises(ChatTemplateError, match="does not compile"):
        with_template(tokenizer, "{% for m in messages %}").apply_chat_template([{"role": "user", "content": "x"}])
