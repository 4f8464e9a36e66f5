"""Tokenizer details the API exposes: raw token bytes, streaming detokenization, Hugging Face's template environment."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

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


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_byte_level_stream_gives_the_text_of_the_library_stream(tokenizer, skip_special_tokens):
    """The table-driven stream (`ByteDetokenizer`) against tokenizers' own `DecodeStream`, on text with split
    characters, special tokens, and random ids (bytes that never form a character), pushed in random groups."""
    rng = random.Random(0)
    texts = [SPLIT_CHARACTER_TEXT, "Emoji 🙂👍🏽 and café, naïve, 数学, Привет", "plain words and digits 12345"]
    sequences = [tokenizer.encode(text) for text in texts]
    sequences.append([*sequences[1][:5], tokenizer.eos_token_ids[0], *sequences[1][5:]])
    sequences += [[rng.randrange(tokenizer.vocab_size) for _ in range(60)] for _ in range(20)]
    for ids in sequences:
        fast = tokenizer.decode_stream([], skip_special_tokens=skip_special_tokens)
        assert isinstance(fast, ByteDetokenizer)
        library = IncrementalDetokenizer(tokenizer._backend, skip_special_tokens=skip_special_tokens)
        start = 0
        while start < len(ids):
            group = ids[start:start + rng.randint(1, 4)]
            assert fast.push(group) == library.push(group), ids
            start += len(group)
        assert fast.flush() == library.flush(), ids


@pytest.mark.parametrize("streaming", ["byte_level", "library"])
def test_a_stream_ended_mid_character_flushes_its_held_bytes_as_the_whole_decode_does(tokenizer, library_streamed,
                                                                                       streaming):
    ids = tokenizer.encode("Hi 🦜")[:-1]  # the parrot's last byte cut off
    stream = (tokenizer if streaming == "byte_level" else library_streamed).decode_stream(tokenizer.encode("Say:"))
    assert stream.push(ids) == "Hi"  # the space is a byte of the parrot's first token
    assert stream.flush() == " \ufffd" and tokenizer.decode(ids) == "Hi \ufffd"


@pytest.mark.parametrize("streaming", ["byte_level", "library"])
def test_a_stream_that_keeps_special_tokens_gives_their_text_where_they_were(tokenizer, library_streamed, streaming):
    text = "<|im_start|>assistant\n東京<|im_end|>Hi"
    ids = tokenizer.encode(text)
    stream = (tokenizer if streaming == "byte_level" else library_streamed).decode_stream(
        tokenizer.encode("Say:<|im_end|>"), skip_special_tokens=False)
    pieces = [stream.push([i]) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=False) == text
    assert pieces[0] == "<|im_start|>"


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


def test_a_template_that_does_not_compile_is_compiled_once_and_says_why(tokenizer, monkeypatch):
    """A server checks it once at load and warns; each chat request then gets its error, not another compile."""
    import sluice.model.tokenizer as module

    compiles = []
    compile_chat_template = module.compile_chat_template
    monkeypatch.setattr(module, "compile_chat_template", lambda text: compiles.append(text) or compile_chat_template(text))
    broken = with_template(tokenizer, "{% for m in messages %}")
    assert broken.chat_template_error.startswith("the model's chat template does not compile: ")
    for _ in range(2):
        with pytest.raises(ChatTemplateError, match="the model's chat template does not compile"):
            broken.apply_chat_template([{"role": "user", "content": "x"}])
    assert len(compiles) == 1
    assert tokenizer.chat_template_error is None


def _hf_folder_tokenizer(tmp_path, tokenizer_config_template, jinja=None) -> Tokenizer:
    import json

    from hf_folder import write_hf_folder
    from sluice.model.config import ModelConfig

    folder = tmp_path / "hf"
    write_hf_folder(folder, ModelConfig.tiny(vocab_size=300), seed=0)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": tokenizer_config_template}))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    return Tokenizer.from_hf_folder(folder, json.loads((folder / "config.json").read_text()))


def test_an_hf_folder_with_named_chat_templates_renders_chats_with_the_default_one(tmp_path):
    """tokenizer_config.json's chat_template may be a list of named templates (NousResearch's Hermes 3 Llama 3.1:
    "default" and "tool_use"), as transformers reads it; Sluice compiled the list's text and failed each chat."""
    named = [{"name": "tool_use", "template": "tools: {{ tools }}"},
             {"name": "default", "template": "{{ messages[0]['content'] }}!"}]
    tokenizer = _hf_folder_tokenizer(tmp_path, named)
    assert tokenizer.chat_template_error is None
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def test_an_hf_folder_s_chat_template_jinja_is_its_chat_template(tmp_path):
    """Recent transformers save the template as chat_template.jinja beside tokenizer_config.json, and read it first;
    Sluice read only tokenizer_config.json's and served such a folder without a template."""
    tokenizer = _hf_folder_tokenizer(tmp_path, "{{ 'old' }}", jinja="{{ messages[0]['content'] }}?")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi?"


def test_an_hf_folder_s_chat_template_of_another_kind_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="tokenizer_config.json's chat_template is neither a template nor a list of "
                                         "named ones: 42"):
        _hf_folder_tokenizer(tmp_path, 42)


@pytest.mark.parametrize("failing", ["{{ messages[0]['content'] + 1 }}", "{{ messages[0]['name'] | tojson }}",
                                     "{{ range(10 ** 9) | list }}"])
def test_any_error_a_template_raises_is_a_chat_template_error(tokenizer, failing):
    with pytest.raises(ChatTemplateError, match="the chat template failed"):
        with_template(tokenizer, failing).apply_chat_template([{"role": "user", "content": "x"}])


def test_a_template_that_marks_the_generation_renders_as_hugging_face_renders_it(tokenizer):
    """Templates written for training mark the assistant's text with `{% generation %}` (transformers'
    `return_assistant_tokens_mask`); rendering leaves the text as it is."""
    marked = with_template(tokenizer, "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
                                      "{% endfor %}")
    assert marked.apply_chat_template([{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]) == "ab"

def with_user_defined_token(tokenizer: Tokenizer) -> Tokenizer:
    """The same vocabulary plus a non-special added token (as Qwen's GGUF files have `<tool_call>`): its text
    is output, so streams go through the library (`IncrementalDetokenizer`)."""
    backend = HFTokenizer.from_str(tokenizer.to_json())
    backend.add_tokens([AddedToken("<user_defined>", special=False, normalized=False)])
    return Tokenizer(backend, tokenizer.special)


@pytest.fixture(scope="module")
def library_streamed(tokenizer) -> Tokenizer:
    streaming = with_user_defined_token(tokenizer)
    assert isinstance(streaming.decode_stream(), IncrementalDetokenizer)
    return streaming


@pytest.fixture(scope="module")
def piece_ids(tokenizer) -> list[int]:
    """Ids of tokens that hold only part of a character (on their own they decode to U+FFFD)."""
    return [i for i in range(tokenizer.vocab_size) if "\ufffd" in tokenizer.token_text(i)]


def streamed(stream: IncrementalDetokenizer | ByteDetokenizer, ids: list[int], group_sizes: list[int]) -> list[str]:
    """The pieces of text a stream gives for `ids` pushed in groups of the given sizes (the rest one by one),
    then its flush, as for a sequence that ends there."""
    pieces, start = [], 0
    for size in group_sizes:
        pieces.append(stream.push(ids[start:start + size]))
        start += size
    return pieces + [stream.push([i]) for i in ids[start:]] + [stream.flush()]


def assert_streams_as_the_whole_decodes(tokenizer: Tokenizer, pieces: list[str], ids: list[int],
                                        skip_special_tokens: bool = True) -> None:
    """The pieces, the flush of a character left unfinished at the end included, join to the whole decode (with
    the same `skip_special_tokens`); none has a U+FFFD that the whole decode has not."""
    whole, joined = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), "".join(pieces)
    assert joined == whole
    if "\ufffd" not in whole:
        assert not any("\ufffd" in piece for piece in pieces)


def token_ids(tokenizer: Tokenizer, piece_ids: list[int]) -> st.SearchStrategy[int]:
    """Any id of the vocabulary, often one holding part of a character or a special token."""
    specials = [tokenizer.bos_token_id, *tokenizer.eos_token_ids]
    return st.one_of(st.integers(0, tokenizer.vocab_size - 1), st.sampled_from(piece_ids), st.sampled_from(specials))


SOME_TEXT = st.text(st.one_of(st.characters(codec="utf-8"), st.sampled_from("🙂👍🏽東京数学é ")), max_size=40)
GROUP_SIZES = st.lists(st.integers(1, 4), max_size=10)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), group_sizes=GROUP_SIZES, skip_special_tokens=st.booleans())
def test_the_stream_of_random_ids_joins_to_their_whole_decode(tokenizer, library_streamed, piece_ids, data,
                                                               group_sizes, skip_special_tokens):
    prompt = data.draw(st.lists(token_ids(tokenizer, piece_ids), max_size=6))
    ids = data.draw(st.lists(token_ids(tokenizer, piece_ids), max_size=20))
    for streaming in (tokenizer, library_streamed):
        pieces = streamed(streaming.decode_stream(prompt, skip_special_tokens=skip_special_tokens), ids, group_sizes)
        assert_streams_as_the_whole_decodes(tokenizer, pieces, ids, skip_special_tokens)


@settings(max_examples=200, deadline=None)
@given(prompt=SOME_TEXT, text=SOME_TEXT, group_sizes=GROUP_SIZES)
def test_the_stream_of_encoded_text_joins_to_its_whole_decode(tokenizer, library_streamed, prompt, text,
                                                               group_sizes):
    ids = tokenizer.encode(text)
    for streaming in (tokenizer, library_streamed):
        pieces = streamed(streaming.decode_stream(tokenizer.encode(prompt)), ids, group_sizes)
        assert_streams_as_the_whole_decodes(tokenizer, pieces, ids)


def test_a_prompt_that_ends_mid_character_puts_none_of_its_text_in_the_stream(tokenizer, library_streamed):
    tokyo = tokenizer.encode("東京")
    assert len(tokyo) == 4, "京 should be split across the last two tokens"
    prompt, output = tokenizer.encode("Say ") + tokyo[:3], [tokyo[3], *tokenizer.encode(" is big")]
    for streaming in (tokenizer, library_streamed):
        stream = streaming.decode_stream(prompt)
        assert "".join(stream.push([i]) for i in output) == tokenizer.decode(output) == "\ufffd is big"


def test_a_prompt_ending_in_bytes_around_a_special_token_puts_none_of_its_text_in_a_stream_that_keeps_it(
        tokenizer, library_streamed):
    # Skipped, the special token leaves the bytes one character; kept, it splits them into two U+FFFD.
    east = tokenizer.encode("東")
    assert len(east) == 2, "東 should be split across two tokens"
    prompt, output = [east[0], tokenizer.eos_token_ids[0], east[1]], tokenizer.encode(" is east")
    for streaming in (tokenizer, library_streamed):
        stream = streaming.decode_stream(prompt, skip_special_tokens=False)
        assert "".join(stream.push([i]) for i in output) == " is east"


def llama_style_tokenizer() -> HFTokenizer:
    """A SentencePiece vocabulary with Llama 2's normalizer and decoder: "▁" for a space, `<0xE6>`-style
    byte-fallback tokens, and a decoder that drops the text's leading space."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "▁Hello", "▁world", "▁is", "京"]
    backend = HFTokenizer(models.Unigram([(p, -1.0) for p in pieces], unk_id=0, byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    return backend


def test_a_sentencepiece_stream_keeps_the_space_after_the_prompt_and_holds_byte_fallback_characters_whole():
    backend = llama_style_tokenizer()
    prompt, output = backend.encode("Hello").ids, backend.encode("world is 東京 🙂").ids
    assert backend.id_to_token(output[-1]) == "<0x82>"
    stream = IncrementalDetokenizer(backend, [1, *prompt])
    pieces = [stream.push([i]) for i in output]
    assert "".join(pieces) == " world is 東京 🙂"
    assert "" in pieces and not any("\ufffd" in p for p in pieces)


def test_a_sentencepiece_stream_goes_on_past_a_byte_fallback_character_left_unfinished():
    """Byte-fallback tokens decode as one run, so a lead byte never finished turns the newline emitted before it
    into U+FFFD in the whole decode, which tokenizers' `DecodeStream` reports as an invalid prefix."""
    backend = llama_style_tokenizer()
    output = [backend.token_to_id("<0x0A>"), backend.token_to_id("<0xE6>"), *backend.encode("world").ids]
    assert backend.decode(output) == "\ufffd\ufffd world"
    stream = IncrementalDetokenizer(backend, backend.encode("Hello").ids)
    assert [stream.push([i]) for i in output] == ["\n", "", "\ufffd world"]


def test_a_sentencepiece_stream_ended_mid_character_flushes_its_held_byte_fallback_tokens_as_u_fffd():
    backend = llama_style_tokenizer()
    prompt, output = backend.encode("Hello").ids, backend.encode("world is 🙂").ids[:-1]
    stream = IncrementalDetokenizer(backend, prompt)
    pieces = [stream.push([i]) for i in output] + [stream.flush()]
    assert pieces[-1] == "\ufffd" * 3  # one for each byte-fallback token, as the library's decode renders them
    assert "".join(pieces) == backend.decode([*prompt, *output])[len("Hello"):] == " world is \ufffd\ufffd\ufffd"


def test_a_sentencepiece_stream_restarted_past_an_unfinished_character_flushes_the_next_one_as_u_fffd():
    backend = llama_style_tokenizer()
    lead = backend.token_to_id("<0xE6>")
    output = [backend.token_to_id("<0x0A>"), lead, *backend.encode("world").ids, lead]
    stream = IncrementalDetokenizer(backend, backend.encode("Hello").ids)
    assert [stream.push([i]) for i in output] + [stream.flush()] == ["\n", "", "\ufffd world", "", "\ufffd"]
