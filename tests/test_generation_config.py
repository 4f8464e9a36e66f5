"""A model's own sampling defaults (`model/generation_config.py`): read from an HF folder's generation_config.json
and a GGUF file's general.sampling.* metadata, kept with the converted model, and given to the fields a request of
each API leaves out."""

from __future__ import annotations

import json

import gguf
import pytest

from sluice.app import anthropic_messages, responses_api_convert
from sluice.app.anthropic_schemas import MessagesRequest
from sluice.app.responses_api_schemas import ResponsesRequest
from sluice.app.schemas import ChatCompletionRequest, CompletionRequest
from sluice.model.config import ModelConfig
from sluice.model.generation_config import from_gguf_fields, from_hf_folder
from sluice.model.loader import load_model
from hf_folder import write_hf_folder

HELLO = [{"role": "user", "content": "hi"}]


def test_an_hf_folders_generation_config_sets_the_defaults_its_ranges_allow(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "max_new_tokens": 512,
        "repetition_penalty": 3.0, "bos_token_id": 1, "eos_token_id": [2, 3]}))
    assert from_hf_folder(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                             "max_tokens": 512}
    assert "repetition_penalty of 3.0" in caplog.text  # beyond the API's bound: left out, with a warning


def test_a_folder_without_a_generation_config_sets_none(tmp_path):
    assert from_hf_folder(tmp_path) == {}


def test_a_null_in_a_generation_config_sets_no_default_and_is_no_warning(tmp_path, caplog):
    """null is how a config writes "not set" (vLLM reads it so): not a value out of the field's range."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": None, "max_new_tokens": None,
                                                                 "top_p": 0.9}))
    assert from_hf_folder(tmp_path) == {"top_p": 0.9}
    assert "ignoring" not in caplog.text


@pytest.mark.parametrize("text", ["{", "[0.6]"])
def test_a_generation_config_that_is_no_json_object_is_refused(tmp_path, text):
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match="generation_config.json"):
        from_hf_folder(tmp_path)


def test_a_gguf_files_sampling_metadata_sets_the_defaults(tmp_path):
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.6)  # float32: read back as 0.6, not 0.6000000238
    writer.add_int32("general.sampling.top_k", 20)
    writer.add_float32("general.sampling.penalty_repeat", 1.1)
    writer.add_float32("general.sampling.xtc_probability", 0.5)  # no such field here
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fields = {name: field.contents() for name, field in gguf.GGUFReader(str(path)).fields.items()}
    assert from_gguf_fields(fields) == {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1}


def test_a_converted_model_keeps_its_defaults_and_a_load_needs_no_source_reader(tmp_path, monkeypatch):
    """Read once, at conversion: a later load reads them from the converted folder (the GPU image has no gguf)."""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    folder = tmp_path / "hf"
    write_hf_folder(folder, ModelConfig.tiny(), seed=1)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.8}))
    assert load_model(str(folder), dtype="float32").generation_defaults == {"temperature": 0.7, "top_p": 0.8}
    monkeypatch.setattr("sluice.model.generation_config.from_hf_folder", None)  # not called again
    assert load_model(str(folder), dtype="float32").generation_defaults == {"temperature": 0.7, "top_p": 0.8}


DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 100}


def test_a_request_takes_the_defaults_of_the_fields_it_leaves_out_and_keeps_its_own():
    params = ChatCompletionRequest(messages=HELLO, top_p=1.0).sampling_params(1000, DEFAULTS)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 1.0, 20, 100)
    params = ChatCompletionRequest(messages=HELLO, max_completion_tokens=500).sampling_params(1000, DEFAULTS)
    assert params.max_tokens == 500  # the request's own limit, past the model's
    assert CompletionRequest(prompt="hi").sampling_params(16, DEFAULTS).max_tokens == 16  # the smaller default
    assert ChatCompletionRequest(messages=HELLO).sampling_params(1000).temperature == 1.0  # none: the API's


def test_a_models_max_tokens_below_16_leaves_completions_their_default_of_16():
    """As vLLM: 16 is the completions API's own default (its field's), which the model's bounds no more than a
    request's own max_tokens; a chat request has none, so the model's applies."""
    short = {"max_tokens": 8}
    assert CompletionRequest(prompt="hi").sampling_params(16, short).max_tokens == 16
    assert ChatCompletionRequest(messages=HELLO).sampling_params(1000, short).max_tokens == 8


def test_anthropic_and_responses_requests_leave_out_what_their_clients_left_out():
    messages = MessagesRequest(model="m", max_tokens=8, messages=HELLO, top_k=5)
    params = anthropic_messages.chat_request(messages).sampling_params(1000, DEFAULTS)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, 5, 8)
    response = ResponsesRequest(input="hi", temperature=0.2)
    params = responses_api_convert.chat_request(response, response.input).sampling_params(1000, DEFAULTS)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.2, 0.9, 100)
