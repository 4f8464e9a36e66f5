"""Weight loading: a GGUF written with llama.cpp's conventions and an HF safetensors folder round-trip into Llama."""

from __future__ import annotations

import errno
import json
import os
import re
from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from hf_folder import random_hf_tensors, write_gguf, write_hf_folder
from sluice.model import checkpoint
from sluice.model.config import ModelConfig, RopeScaling
from sluice.model.fetch import InvalidModel, ModelNotFound
from sluice.model.generate import sequence_logits
from sluice.model.llama import Llama
from sluice.model.loader import load_model
from sluice.model.weights import GLOBAL_TENSORS, LAYER_TENSORS, TRANSPOSED, fuse_projections

CONFIG = ModelConfig.tiny(vocab_size=300, head_dim=32, hidden_size=64, num_heads=2, num_kv_heads=1, max_position_embeddings=256)


def reference_model(config: ModelConfig, tensors: dict[str, np.ndarray]) -> Llama:
    model = Llama(config, rngs=nnx.Rngs(0))
    params = {}
    for name, (_, hf_suffix) in LAYER_TENSORS.items():
        layers = [tensors.get(f"model.layers.{i}.{hf_suffix}") for i in range(config.num_layers)]
        if layers[0] is not None:
            params[name] = np.stack([t.T if name in TRANSPOSED else t for t in layers])
    for name, (_, hf_name) in GLOBAL_TENSORS.items():
        if hf_name in tensors:
            params[name] = tensors[hf_name].T if name in TRANSPOSED else tensors[hf_name]
    for name, value in fuse_projections(params, config).items():
        getattr(model, name)[...] = jnp.asarray(value)
    return model


@pytest.fixture()
def sluice_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    return tmp_path


def test_hf_safetensors_folder_loads_the_same_model(sluice_home):
    folder = sluice_home / "hf"
    tensors = write_hf_folder(folder, CONFIG, seed=1, num_files=2)

    loaded = load_model(str(folder), dtype="float32")
    assert loaded.config == CONFIG
    ids = loaded.tokenizer.encode("the lazy fox")
    assert ids[0] == 1 and loaded.tokenizer.decode(ids) == "the lazy fox"
    tokens = [5, 17, 42, 99, 7]
    np.testing.assert_allclose(sequence_logits(loaded.model, tokens),
                               sequence_logits(reference_model(CONFIG, tensors), tokens), rtol=1e-5, atol=1e-5)

    reloaded = load_model(str(folder), dtype="bfloat16")
    assert reloaded.model.wqkv[...].dtype == jnp.bfloat16


def test_a_folder_with_an_index_reads_only_the_files_it_names(sluice_home):
    """Mistral's folders hold their weights twice: the HF shards the index names, and consolidated.safetensors in
    Mistral's own names, which the model does not read (vLLM reads the index's files alone)."""
    folder = sluice_home / "hf"
    tensors = write_hf_folder(folder, CONFIG, seed=1, num_files=2)
    weight_map = {name: path.name for path in folder.glob("*.safetensors") for name in load_file(str(path))}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({"tok_embeddings.weight": tensors["model.embed_tokens.weight"]}, str(folder / "consolidated.safetensors"))

    loaded = load_model(str(folder), dtype="float32")
    tokens = [5, 17, 42, 99, 7]
    np.testing.assert_allclose(sequence_logits(loaded.model, tokens),
                               sequence_logits(reference_model(CONFIG, tensors), tokens), rtol=1e-5, atol=1e-5)


LLAMA_3_1_KEYS = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
                  "transformers_version": "4.43.0.dev0", "hidden_act": "silu", "initializer_range": 0.02,
                  "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
                  "use_cache": True, "eos_token_id": [2, 1],
                  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64, "rope_type": "llama3"}}
MISTRAL_KEYS = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None,
                "torch_dtype": "bfloat16", "hidden_act": "silu"}
QWEN2_KEYS = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False,
              "sliding_window": 4096, "max_window_layers": 21, "rope_scaling": None, "torch_dtype": "bfloat16",
              "use_mrope": False, "tie_word_embeddings": True}


@pytest.mark.parametrize(("config", "keys"), [
    (replace(CONFIG, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64), eos_token_ids=(2, 1)), LLAMA_3_1_KEYS),
    (CONFIG, MISTRAL_KEYS),
    (replace(CONFIG, attention_bias=True, tie_word_embeddings=True), QWEN2_KEYS),
])
def test_llama_mistral_and_qwen2_folders_load_with_the_keys_their_configs_hold(sluice_home, config, keys):
    """The architectures Sluice serves, as their config.json files are written (Qwen2's q/k/v biases implied by its
    model type, with no attention_bias key): the keys Sluice does not read are no reason to refuse them."""
    folder = sluice_home / "hf"
    tensors = write_hf_folder(folder, config, seed=1)
    written = json.loads((folder / "config.json").read_text())
    written.pop("attention_bias", None)
    (folder / "config.json").write_text(json.dumps({**written, **keys}))

    loaded = load_model(str(folder), dtype="float32")
    assert loaded.config == config
    tokens = [5, 17, 42, 99, 7]
    np.testing.assert_allclose(sequence_logits(loaded.model, tokens),
                               sequence_logits(reference_model(config, tensors), tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra", [
    {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": np.ones(16, np.float32) for i in range(CONFIG.num_layers)},
    {"model.rotary_emb.inv_freq": np.ones(16, np.float32)},
])
def test_rotary_frequency_buffers_older_checkpoints_hold_are_not_refused(sluice_home, extra):
    """HF's older Llamas saved each layer's rotary frequencies, which the config implies."""
    folder = sluice_home / "hf"
    write_hf_folder(folder, CONFIG, seed=1)
    _edit_tensors(folder, lambda t: t.update(extra))
    assert load_model(str(folder), dtype="float32").config == CONFIG


def test_a_tied_model_whose_file_also_holds_the_lm_head_serves_the_embedding(sluice_home):
    folder = sluice_home / "hf"
    tensors = write_hf_folder(folder, CONFIG, seed=1)
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                    "tie_word_embeddings": True}))
    loaded = load_model(str(folder), dtype="float32")
    tied = replace(CONFIG, tie_word_embeddings=True)
    assert loaded.config == tied
    tokens = [5, 17, 42, 99, 7]
    del tensors["lm_head.weight"]
    np.testing.assert_allclose(sequence_logits(loaded.model, tokens),
                               sequence_logits(reference_model(tied, tensors), tokens), rtol=1e-5, atol=1e-5)


def test_a_folder_whose_files_are_rewritten_in_place_is_converted_again(sluice_home):
    """Weights copied over the old file, a chat template fixed in its config: the folder's own time stays as it
    was, and the model must not be served from the stale conversion."""
    folder = sluice_home / "hf"
    tensors = write_hf_folder(folder, CONFIG, seed=1)
    first = load_model(str(folder), dtype="float32")
    assert first.tokenizer.special.chat_template is None
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main")  # not the model: no new conversion
    assert load_model(str(folder), dtype="float32").weights == first.weights
    folder_times = os.stat(folder).st_atime_ns, os.stat(folder).st_mtime_ns
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": "{{ messages[0]['content'] }}"}))
    [weights] = folder.glob("*.safetensors")
    new_tensors = write_hf_folder(sluice_home / "other", CONFIG, seed=2)
    weights.write_bytes(next((sluice_home / "other").glob("*.safetensors")).read_bytes())
    os.utime(folder, ns=folder_times)

    reloaded = load_model(str(folder), dtype="float32")
    assert reloaded.weights != first.weights
    conversions = sluice_home / "home" / "checkpoints"
    assert sorted(p.name for p in conversions.iterdir()) == [reloaded.weights]  # the stale one is removed
    assert reloaded.tokenizer.special.chat_template == "{{ messages[0]['content'] }}"
    tokens = [5, 17, 42, 99, 7]
    np.testing.assert_allclose(sequence_logits(reloaded.model, tokens),
                               sequence_logits(reference_model(CONFIG, new_tensors), tokens), rtol=1e-5, atol=1e-5)
    assert not np.allclose(sequence_logits(reloaded.model, tokens),
                           sequence_logits(reference_model(CONFIG, tensors), tokens), atol=1e-3)


def test_gguf_with_quantized_permuted_tensors_loads_the_same_model(sluice_home):
    path = sluice_home / "tiny.gguf"
    expected = write_gguf(path, CONFIG, random_hf_tensors(CONFIG, seed=2))

    loaded = load_model(str(path), dtype="float32")
    assert loaded.config.num_kv_heads == 1 and not loaded.config.tie_word_embeddings
    tokens = [3, 8, 200, 41]
    np.testing.assert_allclose(sequence_logits(loaded.model, tokens),
                               sequence_logits(reference_model(CONFIG, expected), tokens), rtol=1e-5, atol=1e-5)


def llama_cpp_rope_factors(config: ModelConfig, scaling: RopeScaling) -> np.ndarray:
    """The rope_freqs.weight llama.cpp's converter writes for a Llama 3.1 config (its only record of the scaling)."""
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, config.head_dim, 2, dtype=np.float32) / config.head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    factors = np.where(wavelen > scaling.original_max_position_embeddings / scaling.low_freq_factor,
                       scaling.factor, 1 / ((1 - smooth) / scaling.factor + smooth))
    factors = np.where(wavelen < scaling.original_max_position_embeddings / scaling.high_freq_factor, 1.0, factors)
    return factors.astype(np.float32)


def test_a_llama_3_1_gguf_rotates_at_the_frequencies_its_rope_freqs_give(sluice_home):
    """llama.cpp's converter keeps Llama 3.1's RoPE scaling as rope_freqs.weight alone (no metadata key): the model
    was served with unscaled frequencies, another model than the HF folder's with its rope_scaling."""
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    path = sluice_home / "llama31.gguf"
    expected = write_gguf(path, CONFIG, random_hf_tensors(CONFIG, seed=2),
                          extra={"rope_freqs.weight": llama_cpp_rope_factors(CONFIG, scaling)})

    loaded = load_model(str(path), dtype="float32")
    tokens = list(range(3, 203, 4))
    logits = sequence_logits(loaded.model, tokens)
    np.testing.assert_allclose(logits, sequence_logits(reference_model(replace(CONFIG, rope_scaling=scaling), expected),
                                                       tokens), rtol=1e-4, atol=1e-4)
    assert not np.allclose(logits, sequence_logits(reference_model(CONFIG, expected), tokens), atol=1e-2)


def test_a_conversion_that_cannot_be_written_says_so_and_leaves_no_partial_folder(sluice_home, monkeypatch):
    """A disk filled midway through writing the converted weights: ModelNotFound naming the folder and the reason
    (not OSError's traceback), and no half-written folder left in the cache."""
    write_hf_folder(sluice_home / "hf", CONFIG, seed=1)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint.ocp.StandardCheckpointer, "save", full_disk)
    with pytest.raises(ModelNotFound, match=r"cannot keep the converted model in .*checkpoints \(No space left on"):
        load_model(str(sluice_home / "hf"), dtype="float32")
    assert list((sluice_home / "home" / "checkpoints").iterdir()) == []


def test_a_cache_where_the_conversion_cannot_be_kept_is_refused_before_a_weight_is_read(sluice_home, monkeypatch,
                                                                                        no_weight_reads):
    """SLUICE_HOME a file: refused once the whole model had been read (minutes, for a large one)."""
    write_hf_folder(sluice_home / "hf", CONFIG, seed=1)
    (sluice_home / "file").write_text("a file where SLUICE_HOME's folder should be")
    monkeypatch.setenv("SLUICE_HOME", str(sluice_home / "file" / "sluice"))
    with pytest.raises(ModelNotFound, match=re.escape(f"cannot keep the converted model in {sluice_home}/file/sluice/"
                                                      f"checkpoints (Not a directory): set SLUICE_HOME to a folder")):
        load_model(str(sluice_home / "hf"), dtype="float32")


@pytest.mark.parametrize(("edit", "words"), [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported architecture GPT2LMHeadModel"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"},
     "unsupported architecture Qwen3MoeForCausalLM"),
    ({"model_type": "gemma"}, "unsupported architecture gemma (Llama-family only: LlamaForCausalLM"),
    ({"vocab_size": None}, "config.json lacks vocab_size"),
    ({"num_attention_heads": 0, "head_dim": None}, "config.json's num_attention_heads must be a positive integer"),
    ({"num_key_value_heads": 0}, "config.json's num_key_value_heads must be a positive integer, got 0"),
    ({"hidden_size": "64"}, "config.json's hidden_size must be a positive integer, got '64'"),
    ({"max_position_embeddings": 0}, "config.json's max_position_embeddings must be a positive integer, got 0"),
])
def test_a_config_json_sluice_cannot_serve_is_refused_by_name(sluice_home, edit, words):
    """Another architecture (a Qwen3-MoE's experts, a Gemma's scaled embedding) was served as a Llama without them;
    a size missing, zero or a string was a KeyError, a ZeroDivisionError or a restore's traceback."""
    folder = sluice_home / "hf"
    write_hf_folder(folder, CONFIG, seed=1)
    config = {**json.loads((folder / "config.json").read_text()), **edit}
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    with pytest.raises(InvalidModel, match=re.escape(words)):
        load_model(str(folder), dtype="float32")


@pytest.mark.parametrize(("edit", "words"), [
    ({"general.architecture": "gpt2"}, "unsupported GGUF architecture 'gpt2' (Llama-family only: llama, mistral"),
    ({"llama.attention.head_count": 0}, "the GGUF metadata's llama.attention.head_count must be a positive integer"),
    ({"llama.embedding_length": None}, "the GGUF metadata lacks llama.embedding_length"),
    ({"tokenizer.ggml.tokens": None}, "the GGUF metadata lacks llama.vocab_size"),
    ({"llama.expert_count": 8, "llama.expert_used_count": 2},  # Mixtral: it lacked tensor blk.0.ffn_gate.weight
     "the GGUF metadata's llama.expert_count of 8 makes the model a mixture of experts, which Sluice does not serve"),
])
def test_gguf_metadata_sluice_cannot_serve_is_refused_by_name(edit, words):
    fields = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 2,
              "llama.feed_forward_length": 128, "llama.block_count": 2, "tokenizer.ggml.tokens": ["a", "b"]}
    fields = {k: v for k, v in {**fields, **edit}.items() if v is not None}
    with pytest.raises(ValueError, match=re.escape(words)):
        ModelConfig.from_gguf_fields(fields, tied_embeddings=True)


def test_rope_freqs_of_another_length_than_the_frequencies_a_head_rotates_are_refused():
    fields = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 2,
              "llama.feed_forward_length": 128, "llama.block_count": 2, "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.raises(ValueError, match=re.escape("tensor rope_freqs.weight has shape (3,), but the config implies "
                                                   "(16,)")):
        ModelConfig.from_gguf_fields(fields, tied_embeddings=True, rope_freq_factors=(1.0, 2.0, 4.0))


@pytest.fixture()
def no_weight_reads(monkeypatch):
    """Reading a tensor from a safetensors file fails the test: what the files' metadata shows (the config, the
    tokenizer, the tensors' names and shapes) is to be refused before a weight is read."""
    import safetensors

    opened = safetensors.safe_open

    class Unread:
        def __init__(self, *args, **kwargs):
            self._handle = opened(*args, **kwargs)

        def keys(self):
            return self._handle.keys()

        def get_slice(self, name):
            return self._handle.get_slice(name)

        def get_tensor(self, name):
            raise AssertionError(f"{name} was read")

    monkeypatch.setattr(safetensors, "safe_open", Unread)


def _edit_tensors(folder, edit):
    [path] = folder.glob("*.safetensors")
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


@pytest.mark.parametrize(("config_edit", "tensor_edit", "words"), [
    ({}, lambda t: t.pop("model.embed_tokens.weight"), "the file lacks tensor model.embed_tokens.weight"),
    ({}, lambda t: t.pop("lm_head.weight"), "the file lacks tensor lm_head.weight"),
    ({}, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "the file lacks tensor model.layers.1.mlp.up_proj.weight"),
    ({"num_hidden_layers": 3}, None, "the file lacks tensor model.layers.2.input_layernorm.weight"),
    ({"num_hidden_layers": 1}, None,
     "the file holds 9 tensors a 1-layer Llama-family model does not use (model.layers.1.input_layernorm.weight"),
    ({}, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": np.ones(32, np.float32)}),
     "does not use (model.layers.0.self_attn.q_norm.weight)"),
    ({}, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": np.zeros((5, 7), np.float32)}),
     "tensor model.layers.0.mlp.up_proj.weight has shape (5, 7), but the config implies (128, 64)"),
    ({"vocab_size": 100}, None, "tensor model.embed_tokens.weight has shape (300, 64), but the config implies (100, 64)"),
])
def test_tensors_that_do_not_make_the_configs_model_are_refused_by_name(sluice_home, no_weight_reads, config_edit,
                                                                         tensor_edit, words):
    """A tensor missing was KeyError: 'w_up' (or, for the embedding, a conversion saved without it that the restore
    then refused in a traceback); one of another shape than the config says was a restore's traceback; tensors the
    model does not read (a layer past the config's count, a Qwen3's q norm in a Llama's file) were dropped, serving
    another model. Each is found from the files' index of tensors, before a weight is read."""
    folder = sluice_home / "hf"
    write_hf_folder(folder, CONFIG, seed=1)
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()), **config_edit}))
    if tensor_edit is not None:
        _edit_tensors(folder, tensor_edit)
    with pytest.raises(InvalidModel, match=re.escape(words)):
        load_model(str(folder), dtype="float32")
    assert list((sluice_home / "home" / "checkpoints").iterdir()) == []  # no conversion kept


def _cut(path, size):
    path.write_bytes(path.read_bytes()[:size])


@pytest.mark.parametrize(("damage", "words"), [
    (lambda folder: (folder / "tokenizer.json").unlink(), "has no tokenizer.json"),
    (lambda folder: (folder / "tokenizer.json").write_text("{not json"), "tokenizer.json does not read as a tokenizer"),
    (lambda folder: _cut(next(folder.glob("*.safetensors")), 0), "does not read as safetensors (cut short or corrupt)"),
    (lambda folder: _cut(next(folder.glob("*.safetensors")), 5000),
     "does not read as safetensors (cut short or corrupt)"),
    (lambda folder: (folder / "only-the-magic.gguf").write_bytes(b"GGUF"), "not a whole GGUF file (cut short or"),
    (lambda folder: (folder / "config.json").write_text("{oops"), "config.json is not JSON: Expecting property name"),
    (lambda folder: (folder / "tokenizer_config.json").write_text("{oops"), "tokenizer_config.json is not JSON"),
    (lambda folder: (folder / "model.safetensors.index.json").write_text('{"weight_map": ['),
     "model.safetensors.index.json does not read as an index of weights (JSONDecodeError"),
])
def test_files_cut_short_or_corrupt_are_refused_by_name(sluice_home, no_weight_reads, damage, words):
    """A tokenizer.json missing or broken, a safetensors file cut short, a GGUF of its magic alone: each was the
    traceback of the library that read it (a bare Exception, SafetensorError, IndexError); a JSON file that is not
    JSON did not say which. Each is refused before a weight is read."""
    folder = sluice_home / "hf"
    write_hf_folder(folder, CONFIG, seed=1)
    damage(folder)
    model = next(folder.glob("*.gguf"), folder)
    with pytest.raises(InvalidModel, match=re.escape(words)):
        load_model(str(model), dtype="float32")


def test_a_model_the_quantized_layouts_cannot_pack_is_refused_by_name(sluice_home, no_weight_reads):
    """A vocabulary of 300 (not a multiple of the kernels' 16 outputs) stored as int4, as `--quantization auto`
    stores it on a CPU: the quantizer's ValueError ended the server with a logged error and exit 1. Found from the
    config, before a weight is read."""
    write_hf_folder(sluice_home / "hf", CONFIG, seed=1)
    with pytest.raises(InvalidModel, match=re.escape("cannot be stored as int4 (quantized weights need inputs in "
                                                     "multiples of 32 and outputs of 16, got (64, 300)): serve it")):
        load_model(str(sluice_home / "hf"), dtype="float32", quantization="int4")


@pytest.mark.parametrize("scaling", [{"type": "dynamic", "factor": 2.0}])
def test_a_rope_scaling_sluice_does_not_implement_is_refused_not_ignored(sluice_home, scaling):
    """It was read as none: the model served was not the one trained. (Linear and YaRN: tests/test_rope_scaling.py.)"""
    folder = sluice_home / "hf"
    write_hf_folder(folder, CONFIG, seed=1)
    written = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**written, "rope_scaling": scaling}))
    with pytest.raises(InvalidModel, match="RoPE scaling of type"):
        load_model(str(folder), dtype="float32")
    (folder / "config.json").write_text(json.dumps({**written, "rope_scaling": {**scaling, "factor": 1.0}}))
    assert load_model(str(folder), dtype="float32").config == CONFIG  # a factor of 1 changes nothing
