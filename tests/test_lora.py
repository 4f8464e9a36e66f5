"""LoRA adapters (model/lora.py) over tests/data/tiny_llama3: PEFT's own forward with each adapter of
tests/data/tiny_lora (written by tests/reference/make_lora_golden.py), from the HF folder and from a GGUF of the same
weights; the weights merged by hand; slots mixed in one batch; the base model's program untouched; quantized,
unstacked and tensor-parallel models; and each adapter Sluice refuses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.flax import load_file
from safetensors.numpy import save_file

from golden_checks import (LOGPROB_TOLERANCE, assert_top5_match, copy_with_tokenizer, home,  # noqa: F401 (a fixture)
                           load_as_gguf, log_softmax)
from sluice.model.config import ModelConfig
from sluice.model.generate import contiguous_attend
from sluice.model.llama import KVCache, Llama, empty_kv_cache
from sluice.model.loader import LoadedModel, load_model
from sluice.model.lora import CONFIG_FILE, MODULES, WEIGHTS_FILE, AdapterNotFound, LoraAdapter, LoraError, \
    attach_adapters, load_adapter
from sluice.model.quantize import quantize_model
from sluice.model.weights import LAYER_TENSORS, ROPE_FREQS

DATA = Path(__file__).parent / "data"
BASE = DATA / "tiny_llama3"
ADAPTERS = DATA / "tiny_lora"
GOLDEN = json.loads((ADAPTERS / "golden.json").read_text())
NAMES = list(GOLDEN["adapters"])  # all_modules (r 8), qv_rslora (r 4): slots 0 and 1
LENGTH = 64  # every forward pass padded to it: one program a model (padding after a token never changes its logits)
PROMPT = GOLDEN["adapters"][NAMES[0]]["cases"][-1]["prompt_ids"]  # 40 tokens


@partial(jax.jit, static_argnums=(0,))
def _logits(graphdef: nnx.GraphDef, state: nnx.State, token_ids: jax.Array, adapters: jax.Array | None) -> jax.Array:
    model = nnx.merge(graphdef, state)
    kv_cache = empty_kv_cache(model.config, num_pages=1, page_size=token_ids.shape[0], dtype=model.dtype)
    positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
    hidden, _ = model(token_ids, positions, kv_cache, contiguous_attend(jnp.int32(0), model.config.softmax_scale),
                      adapters=adapters)
    return model.logits(hidden)


def lora_logits(model: Llama, token_ids: list[int], slots: int | list[int] | None) -> np.ndarray:
    """[len(token_ids), vocab] float32 logits after each prefix (teacher forcing), every token in LoRA slot `slots`
    (or each its own; None: no adapters given)."""
    padding = LENGTH - len(token_ids)
    adapters = None if slots is None else jnp.asarray(
        np.broadcast_to(slots, len(token_ids)).tolist() + [-1] * padding, jnp.int32)
    graphdef, state = nnx.split(model)
    logits = _logits(graphdef, state, jnp.asarray(token_ids + [0] * padding, jnp.int32), adapters)
    return np.asarray(logits[:len(token_ids)])


def read_adapters(config: ModelConfig) -> list[LoraAdapter]:
    return [load_adapter(name, ADAPTERS / name, config) for name in NAMES]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return copy_with_tokenizer(BASE, tmp_path_factory.mktemp("base"), 320)


def with_adapters(loaded: LoadedModel) -> Llama:
    """`loaded`'s model with both golden adapters attached, in slots 0 and 1, at rank 8."""
    attach_adapters(loaded.model, read_adapters(loaded.config), max_loras=2, max_rank=8)
    return loaded.model


@pytest.fixture(scope="module")
def lora_model(home, folder) -> Llama:
    return with_adapters(load_model(str(folder), dtype="float32"))


@pytest.fixture(scope="module")
def base_model(home, folder) -> Llama:
    return load_model(str(folder), dtype="float32").model


@pytest.fixture(scope="module")
def gguf_lora_model(home, folder, tmp_path_factory) -> Llama:
    """The base's weights as llama.cpp's converter writes them (Q/K rows permuted; the loader permutes them back)."""
    config = load_model(str(folder), dtype="float32").config
    extras = {ROPE_FREQS: np.asarray(json.loads((BASE / "golden.json").read_text())["rope_freq_factors"], np.float32)}
    return with_adapters(load_as_gguf(BASE, config, "llama", tmp_path_factory.mktemp("gguf"), extras))


# ---- PEFT's golden

GOLDEN_CASES = [(name, case) for name in NAMES for case in GOLDEN["adapters"][name]["cases"]]


@pytest.mark.parametrize("source", ["lora_model", "gguf_lora_model"])
@pytest.mark.parametrize("name, case", GOLDEN_CASES, ids=[f"{n}-{c['name']}" for n, c in GOLDEN_CASES])
def test_each_adapter_gives_pefts_greedy_tokens_and_logprobs(source, name, case, request):
    """Both adapters attached (slots 0 and 1, qv_rslora's rank 4 padded to 8), every token in the adapter's slot.
    Greedy by teacher forcing: the argmax after each prefix of the golden path is its next token."""
    assert case["min_top2_gap"] > 10 * LOGPROB_TOLERANCE, case["min_top2_gap"]
    model = request.getfixturevalue(source)
    prompt, expected = case["prompt_ids"], case["greedy_ids"]
    logprobs = log_softmax(lora_logits(model, prompt + expected[:-1], NAMES.index(name)))
    assert logprobs[len(prompt) - 1:].argmax(axis=-1).tolist() == expected
    assert_top5_match(logprobs[len(prompt) - 1:], case)
    np.testing.assert_allclose(logprobs[np.arange(len(prompt) - 1), prompt[1:]], case["prompt_logprobs"],
                               atol=LOGPROB_TOLERANCE)


def test_slot_minus_one_is_the_base_model(lora_model, base_model):
    np.testing.assert_allclose(lora_logits(lora_model, PROMPT, -1), lora_logits(base_model, PROMPT, None),
                               rtol=1e-6, atol=1e-6)


# ---- The weights merged by hand

def write_adapter(folder: Path, tensors: dict[str, np.ndarray], **settings) -> Path:
    """A PEFT folder with `tensors` and adapter_config.json's `settings` (beside r and lora_alpha, which they give)."""
    folder.mkdir(parents=True)
    (folder / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "bias": "none", **settings}))
    save_file(tensors, str(folder / WEIGHTS_FILE))
    return folder


def module_path(module: str) -> str:
    """HF's path of `module` within a layer: "self_attn.q_proj"."""
    return LAYER_TENSORS[MODULES[module]][1].removesuffix(".weight")


def random_adapter(module: str, config: ModelConfig, rank: int, seed: int) -> dict[str, np.ndarray]:
    """lora_A and lora_B of `module` on every layer, as PEFT names and shapes them, with `scaling * B @ A` (scaling 2)
    about a fifth of a base weight."""
    base = load_file(str(BASE / "model.safetensors"))
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        out_features, in_features = base[f"model.layers.{layer}.{module_path(module)}.weight"].shape
        key = f"base_model.model.model.layers.{layer}.{module_path(module)}"
        tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.3 / in_features ** 0.5, (rank, in_features)).astype("f4")
        tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.3 / rank ** 0.5, (out_features, rank)).astype("f4")
    return tensors


def merged_folder(folder: Path, parent: Path, tensors: dict[str, np.ndarray], scaling: float) -> Path:
    """The base HF folder `folder` copied into `parent` with each weight W the adapter `tensors` targets replaced by
    W + scaling * B @ A (in float32)."""
    merged = parent / "merged"
    shutil.copytree(folder, merged)
    weights = {name: np.asarray(value, np.float32)
               for name, value in load_file(str(folder / "model.safetensors")).items()}
    for key, a in tensors.items():
        if key.endswith(".lora_A.weight"):
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            weights[key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"] += scaling * b @ a
    save_file(weights, str(merged / "model.safetensors"))
    return merged


def assert_each_slot_is_its_weights_merged(folder: Path, parent: Path,
                                           adapters: dict[str, tuple[dict[str, np.ndarray], dict]]) -> None:
    """Each of `adapters` (name -> its tensors and adapter_config.json's settings; rank 3, padded to 4; alpha 6), in
    a slot of its own of one model of the base HF folder `folder`, gives the logits of `folder` with the weights it
    holds merged, loaded as any model is."""
    loaded = load_model(str(folder), dtype="float32")
    read = [load_adapter(name, write_adapter(parent / f"adapter-{slot}", tensors, r=3, lora_alpha=6, **settings),
                         loaded.config) for slot, (name, (tensors, settings)) in enumerate(adapters.items())]
    attach_adapters(loaded.model, read, max_loras=len(adapters), max_rank=4)
    for slot, (name, (tensors, _)) in enumerate(adapters.items()):
        merged = load_model(str(merged_folder(folder, parent / f"merged-{slot}", tensors, 2.0)), dtype="float32").model
        np.testing.assert_allclose(lora_logits(loaded.model, PROMPT, slot), lora_logits(merged, PROMPT, None),
                                   rtol=1e-4, atol=1e-4, err_msg=name)


def test_lora_of_each_projection_equals_its_weights_merged(home, folder, base_model, tmp_path):
    """Seven adapters, one a module, in seven slots of one model."""
    assert_each_slot_is_its_weights_merged(folder, tmp_path, {
        module: (random_adapter(module, base_model.config, rank=3, seed=i), {"target_modules": [module]})
        for i, module in enumerate(MODULES)})


PARTIAL = {  # form -> adapter_config.json's targets, and the layers of each module the file holds (of 2)
    "a regex naming layer 0": ({"target_modules": r".*\.layers\.0\..*q_proj"}, {"q_proj": [0]}),
    "exclude_modules, a list": ({"target_modules": ["q_proj", "v_proj"],
                                 "exclude_modules": ["model.layers.1.self_attn.v_proj"]},
                                {"q_proj": [0, 1], "v_proj": [0]}),
    "exclude_modules, a regex": ({"target_modules": "all-linear", "exclude_modules": r".*\.0\.mlp\..*"},
                                 {module: [1] if module in ("gate_proj", "up_proj", "down_proj") else [0, 1]
                                  for module in MODULES}),
    "a path in the list": ({"target_modules": ["model.layers.1.self_attn.o_proj", "down_proj"]},
                           {"o_proj": [1], "down_proj": [0, 1]}),
    "layers_pattern": ({"target_modules": ["k_proj"], "layers_to_transform": [0], "layers_pattern": "layers"},
                       {"k_proj": [0]}),
}


def test_an_adapter_of_some_layers_equals_its_weights_merged_and_leaves_the_others_alone(home, folder, base_model,
                                                                                         tmp_path):
    """Where adapter_config.json alone does not say which modules of which layers the adapter holds (a regex, a path
    in the list, exclude_modules, layers_pattern), the file's tensors say it: each form in a slot of one model."""
    assert_each_slot_is_its_weights_merged(folder, tmp_path, {
        form: ({key: value for i, (module, layers) in enumerate(held.items())
                for key, value in random_adapter(module, base_model.config, rank=3, seed=10 * slot + i).items()
                if any(f".layers.{layer}." in key for layer in layers)}, settings)
        for slot, (form, (settings, held)) in enumerate(PARTIAL.items())})


# ---- Slots in one batch

def self_attend(layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: KVCache):
    """Each token attends to itself alone: the rows of a batch are then independent of each other."""
    return jnp.repeat(v, q.shape[1] // v.shape[1], axis=1), kv_cache


@partial(jax.jit, static_argnums=(0,))
def _hidden(graphdef: nnx.GraphDef, state: nnx.State, token_ids: jax.Array, adapters: jax.Array) -> jax.Array:
    model = nnx.merge(graphdef, state)
    kv_cache = empty_kv_cache(model.config, num_pages=1, page_size=1, dtype=model.dtype)
    return model(token_ids, jnp.arange(token_ids.shape[0], dtype=jnp.int32), kv_cache, self_attend,
                 adapters=adapters)[0]


def test_a_batch_mixing_slots_gives_each_row_what_it_gives_alone(lora_model):
    tokens, slots = [5, 17, 42, 99, 250, 7], [-1, 0, 1, 0, 1, -1]
    graphdef, state = nnx.split(lora_model)
    batch = _hidden(graphdef, state, jnp.asarray(tokens, jnp.int32), jnp.asarray(slots, jnp.int32))
    alone = [_hidden(graphdef, state, jnp.asarray([token], jnp.int32), jnp.asarray([slot], jnp.int32))[0]
             for token, slot in zip(tokens, slots)]
    np.testing.assert_allclose(batch, np.stack(alone), rtol=1e-5, atol=1e-5)
    assert not np.allclose(batch[1], batch[4])  # the same token under two adapters


# ---- The base model's program

def lowered(model: Llama, adapters: jax.Array | None) -> str:
    graphdef, state = nnx.split(model)
    return _logits.lower(graphdef, state, jnp.zeros(LENGTH, jnp.int32), adapters).as_text()


def test_a_model_without_lora_lowers_to_the_same_program_whether_or_not_adapters_are_given(base_model, lora_model):
    adapters = jnp.zeros(LENGTH, jnp.int32)
    assert lowered(base_model, adapters) == lowered(base_model, None)
    assert lowered(lora_model, adapters) != lowered(lora_model, None)


# ---- Quantized, unstacked and tensor-parallel models

def test_over_int8_weights_the_adapter_moves_the_logits_as_over_float_weights(home, folder, base_model, lora_model):
    """The change an adapter makes to the logits is the same over int8 weights as over float ones, within what int8
    changes of the base model itself."""
    quantized = load_model(str(folder), dtype="float32")
    quantize_model(quantized.model, "int8")
    quantized_base = lora_logits(quantized.model, PROMPT, None)
    with_adapters(quantized)
    float_change = lora_logits(lora_model, PROMPT, 0) - lora_logits(base_model, PROMPT, None)
    int8_change = lora_logits(quantized.model, PROMPT, 0) - quantized_base
    assert quantized.model.wqkv[...].dtype == jnp.int8 and quantized.model.q_proj_lora_b[...].dtype == jnp.float32
    int8_error = np.abs(quantized_base - lora_logits(base_model, PROMPT, None)).max()
    assert np.abs(int8_change - float_change).max() < 2 * int8_error < 0.1 * np.abs(float_change).max()
    # Tokens of no adapter run the plain projections on a CPU, whose kernels normalize their input inside: the
    # same logits to the bit as the model without LoRA (`llama.with_lora`).
    np.testing.assert_array_equal(lora_logits(quantized.model, PROMPT, -1), quantized_base)


@pytest.mark.parametrize("attach_first", [True, False], ids=["attached-then-unstacked", "unstacked-then-attached"])
def test_unstacked_layers_give_the_stacked_models_logits(home, folder, lora_model, attach_first):
    loaded = load_model(str(folder), dtype="float32")
    if attach_first:
        with_adapters(loaded)
    loaded.model.unstack_layers()
    if not attach_first:
        with_adapters(loaded)
    assert isinstance(loaded.model.q_proj_lora_b.get_value(), tuple)
    slots = [i % 3 - 1 for i in range(len(PROMPT))]
    np.testing.assert_allclose(lora_logits(loaded.model, PROMPT, slots), lora_logits(lora_model, PROMPT, slots),
                               rtol=1e-5, atol=1e-5)


TENSOR_PARALLEL = """
import json, sys
from functools import partial
import numpy as np
from test_lora import PROMPT, lora_logits, read_adapters
from sluice.model.loader import load_model
from sluice.model.lora import attach_adapters
from sluice.sharding.mesh import make_mesh
from sluice.sharding.rules import param_sharding
rule = partial(param_sharding, make_mesh(2))
model = load_model(sys.argv[1], dtype="float32", sharding_rule=rule).model
attach_adapters(model, read_adapters(model.config), 2, 8, rule)
shards = {name: [list(shard.data.shape) for shard in value[...].addressable_shards]
          for name, value in vars(model).items() if "_lora_" in name}
print(json.dumps({"shards": shards, "logits": lora_logits(model, PROMPT, json.loads(sys.argv[2])).tolist()}))
"""


def test_two_way_tensor_parallelism_splits_each_delta_as_its_projection_and_gives_the_same_logits(folder, lora_model):
    """On 2 simulated CPU devices, in a process of its own (the device count is set before jax starts): the Bs of
    q/k/v and gate/up split over their outputs, the As of o and down over their inputs, the others whole on each
    device."""
    slots = [i % 3 - 1 for i in range(len(PROMPT))]
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"}
    run = subprocess.run([sys.executable, "-c", TENSOR_PARALLEL, str(folder), json.dumps(slots)], env=env,
                         cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert len(result["shards"]) == 4 + 7
    halved = {"wo_lora_a": 2, "w_down_lora_a": 2,
              **{f"{module}_lora_b": 3 for module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}}
    for name, shards in result["shards"].items():
        whole = list(getattr(lora_model, name)[...].shape)
        split = [size // 2 if axis == halved.get(name) else size for axis, size in enumerate(whole)]
        assert shards == [split, split], name
    np.testing.assert_allclose(result["logits"], lora_logits(lora_model, PROMPT, slots), rtol=1e-5, atol=1e-5)


# ---- What load_adapter reads

@pytest.fixture
def adapter(tmp_path) -> Path:
    """A copy of the golden qv_rslora adapter (q_proj and v_proj, r 4), to edit."""
    return Path(shutil.copytree(ADAPTERS / "qv_rslora", tmp_path / "qv_rslora"))


def config_of(folder: Path) -> dict:
    return json.loads((folder / CONFIG_FILE).read_text())


def edit_config(**changes) -> Callable[[Path], None]:
    return lambda folder: (folder / CONFIG_FILE).write_text(json.dumps({**config_of(folder), **changes}))


def edit_tensors(change: Callable[[dict[str, np.ndarray]], None]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        tensors = {key: np.array(value) for key, value in load_file(str(folder / WEIGHTS_FILE)).items()}
        change(tensors)
        save_file(tensors, str(folder / WEIGHTS_FILE))
    return edit


Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
LM_HEAD_A = "base_model.model.lm_head.lora_A.weight"
REFUSALS = {
    "missing folder": (shutil.rmtree, ["no such folder"]),
    "a file": (lambda f: [shutil.rmtree(f), f.write_text("{}")],
               ["is a file, not a folder", "PEFT adapter's folder, which holds adapter_config.json"]),
    "no config": (lambda f: (f / CONFIG_FILE).unlink(), ["has no adapter_config.json"]),
    "bad JSON": (lambda f: (f / CONFIG_FILE).write_text("{"), ["adapter_config.json is not JSON"]),
    "not LoRA": (edit_config(peft_type="IA3"), ["is a IA3 adapter, not LoRA"]),
    "DoRA": (edit_config(use_dora=True), ["sets use_dora (DoRA"]),
    "bias": (edit_config(bias="lora_only"), ["trains biases", "bias 'lora_only'"]),
    "lora_bias": (edit_config(lora_bias=True), ["trains biases", "lora_bias True"]),
    "modules_to_save": (edit_config(modules_to_save=["lm_head"]), ["sets modules_to_save (whole modules"]),
    "aLoRA": (edit_config(alora_invocation_tokens=[5, 6, 7]), ["sets alora_invocation_tokens (Activated LoRA"]),
    "QALoRA": (edit_config(use_qalora=True), ["sets use_qalora (QALoRA"]),
    "BD-LoRA": (edit_config(use_bdlora={"target_modules_bd_a": ["q_proj"], "nblocks": 2}),
                ["sets use_bdlora (BD-LoRA"]),
    "Arrow": (edit_config(arrow_config={"top_k": 3}), ["sets arrow_config (Arrow"]),
    "target_parameters": (edit_config(target_parameters=["mlp.experts.down_proj"]), ["sets target_parameters ("]),
    "layer_replication": (edit_config(layer_replication=[[0, 2], [1, 2]]), ["sets layer_replication ("]),
    "trainable_token_indices": (edit_config(trainable_token_indices=[0, 1]), ["sets trainable_token_indices ("]),
    "lm_head target": (edit_config(target_modules=["q_proj", "v_proj", "lm_head"]), ["targets lm_head,"]),
    "embed_tokens target": (edit_config(target_modules=["embed_tokens", "model.layers.0.self_attn.q_proj"]),
                            ["targets embed_tokens,"]),
    "rank_pattern": (edit_config(rank_pattern={"q_proj": 2}), ["sets rank_pattern"]),
    "alpha_pattern": (edit_config(alpha_pattern={"v_proj": 16}), ["sets alpha_pattern"]),
    "rank": (edit_config(r=0), ["has r 0, not a rank"]),
    "a huge r": (edit_config(r=10 ** 9),
                 ["lora_A.weight has shape [4, 64], but the model and r 1000000000 imply [1000000000, 64]"]),
    "alpha": (edit_config(lora_alpha="8"), ["has lora_alpha '8', not a finite number"]),
    "infinite alpha": (edit_config(lora_alpha=float("inf")), ["has lora_alpha inf, not a finite number"]),
    "a NaN weight": (edit_tensors(lambda t: t[Q_B].__setitem__((0, 0), np.nan)),
                     [f"{Q_B} holds values that are not finite"]),
    "layers_to_transform": (edit_config(layers_to_transform=[1, 2]), ["layers_to_transform [1, 2]", "2 layers"]),
    "layers_to_transform true": (edit_config(layers_to_transform=True), ["has layers_to_transform True, not layer"]),
    "layers_to_transform 1.0": (edit_config(layers_to_transform=1.0), ["has layers_to_transform 1.0, not layer"]),
    ".bin only": (lambda f: (f / WEIGHTS_FILE).rename(f / "adapter_model.bin"),
                  ["adapter_model.bin", "convert it to adapter_model.safetensors"]),
    "no weights": (lambda f: (f / WEIGHTS_FILE).unlink(), ["has no adapter_model.safetensors"]),
    "corrupt weights": (lambda f: (f / WEIGHTS_FILE).write_bytes((f / WEIGHTS_FILE).read_bytes()[:100]),
                        ["does not read as safetensors"]),
    "lm_head weights": (edit_tensors(lambda t: t.update({LM_HEAD_A: np.zeros((4, 64), np.float32)})),
                        ["holds lm_head.lora_A.weight", "does not serve"]),
    "a layer past the model's": (edit_tensors(lambda t: t.update({Q_B.replace(".0.", ".2."): t[Q_B]})),
                                 ["holds model.layers.2.self_attn.q_proj.lora_B.weight", "2-layer model"]),
    "a target's weights missing": (edit_config(target_modules=["q_proj", "k_proj", "v_proj"]),
                                   ["lacks model.layers.0.self_attn.k_proj.lora_A.weight"]),
    "a layer's weight missing": (edit_tensors(lambda t: t.pop(Q_B.replace(".0.", ".1."))),
                                 ["lacks model.layers.1.self_attn.q_proj.lora_B.weight, which its adapter_config"]),
    "all-linear's weights missing": (edit_config(target_modules="all-linear"),
                                     ["lacks model.layers.0.mlp.down_proj.lora_A.weight, which its adapter_config"]),
    "an A without its B": (lambda f: [edit_config(target_modules=r".*\.(q_proj|v_proj)")(f),
                                      edit_tensors(lambda t: t.pop(Q_B.replace(".0.", ".1.")))(f)],
                           ["lacks model.layers.1.self_attn.q_proj.lora_B.weight, which "
                            "model.layers.1.self_attn.q_proj.lora_A.weight implies"]),
    "a B without its A": (lambda f: [edit_config(exclude_modules=["lm_head"])(f),
                                     edit_tensors(lambda t: t.pop(Q_B.replace("lora_B", "lora_A")))(f)],
                          ["lacks model.layers.0.self_attn.q_proj.lora_A.weight, which "
                           "model.layers.0.self_attn.q_proj.lora_B.weight implies"]),
    "no targets": (edit_config(target_modules=[]), ["adds to none of the modules Sluice serves (q_proj, "]),
    "shape": (edit_tensors(lambda t: t.update({Q_B: t[Q_B][:64]})),
              ["q_proj.lora_B.weight has shape [64, 4], but the model and r 4 imply [128, 4]"]),
    "r unlike the weights'": (edit_config(r=8),
                              ["lora_A.weight has shape [4, 64], but the model and r 8 imply [8, 64]"]),
}


@pytest.mark.parametrize("edit, words", REFUSALS.values(), ids=REFUSALS.keys())
def test_load_adapter_refuses_in_one_line_naming_the_adapter(lora_model, adapter, edit, words):
    edit(adapter)
    with pytest.raises(LoraError) as error:
        load_adapter("tuned", adapter, lora_model.config)
    message = str(error.value)
    assert message.startswith(f"LoRA adapter 'tuned' ({adapter}): ") and "\n" not in message
    for word in words:
        assert word in message


@pytest.mark.parametrize("name, edit", [
    ("all_modules", edit_config(target_modules="all-linear")),
    ("qv_rslora", edit_config(target_modules=r".*\.(q_proj|v_proj)")),
    ("qv_rslora", edit_config(target_modules=["self_attn.q_proj", "v_proj"])),
    ("qv_rslora", edit_config(fan_in_fan_out=True)),
    ("qv_rslora", edit_config(alora_invocation_tokens=None, use_qalora=False, use_bdlora=None, arrow_config=None,
                              target_parameters=[], layer_replication=[], trainable_token_indices={})),
    ("qv_rslora", edit_tensors(lambda t: t.update({k.removeprefix("base_model.model."): t.pop(k) for k in list(t)}))),
    ("qv_rslora", edit_config(layers_to_transform=[])),
], ids=["all-linear", "a regex", "paths", "fan_in_fan_out", "variants unset", "no base_model.model. prefix",
        "no layers listed: all"])
def test_what_peft_also_writes_reads_as_the_same_adapter(lora_model, tmp_path, name, edit):
    """"all-linear" and a regex resolve to the modules the weights hold; fan_in_fan_out leaves lora_A [r, in] and
    lora_B [out, r] as they are (PEFT sets it for transposed Conv1D base weights only); a variant's field null, false
    or empty is no variant."""
    expected = load_adapter(name, ADAPTERS / name, lora_model.config)
    edit(folder := Path(shutil.copytree(ADAPTERS / name, tmp_path / name)))
    read = load_adapter(name, folder, lora_model.config)
    assert read.a.keys() == read.b.keys() == expected.a.keys()
    for module in read.a:
        np.testing.assert_array_equal(read.a[module], expected.a[module])
        np.testing.assert_array_equal(read.b[module], expected.b[module])


def test_layers_to_transform_leaves_the_other_layers_zero(lora_model, adapter):
    expected = load_adapter("tuned", adapter, lora_model.config)
    edit_tensors(lambda t: [t.pop(k) for k in list(t) if ".layers.0." in k])(adapter)
    edit_config(layers_to_transform=1)(adapter)
    read = load_adapter("tuned", adapter, lora_model.config)
    for module in ("q_proj", "v_proj"):
        assert not read.a[module][0].any() and not read.b[module][0].any()
        np.testing.assert_array_equal(read.a[module][1], expected.a[module][1])


def test_scaling_is_alpha_over_r_or_over_its_square_root_with_rslora(lora_model):
    all_modules, qv_rslora = read_adapters(lora_model.config)
    assert (all_modules.rank, all_modules.scaling) == (8, 16 / 8)
    assert (qv_rslora.rank, qv_rslora.scaling) == (4, 8 / 4 ** 0.5)


def test_the_fingerprint_is_the_files_content(lora_model, adapter):
    """The same files elsewhere: the same fingerprint; another adapter_config.json: another."""
    original = load_adapter("tuned", ADAPTERS / "qv_rslora", lora_model.config).fingerprint
    assert load_adapter("other", adapter, lora_model.config).fingerprint == original
    edit_config(lora_alpha=16)(adapter)
    assert load_adapter("other", adapter, lora_model.config).fingerprint != original


def test_more_adapters_than_slots_fill_the_slots_in_order_and_each_gets_its_slots_weights(lora_model):
    """The first in the slot; the second's weights, to swap in, of the projections either adds to: o_proj's too,
    which qv_rslora leaves out, at all_modules' rank."""
    loaded = Llama(lora_model.config, rngs=nnx.Rngs(0))
    adapters = read_adapters(lora_model.config)[::-1]  # qv_rslora, then all_modules
    weights = attach_adapters(loaded, adapters, max_loras=1, max_rank=8)
    assert [sorted(w) for w in weights] == [sorted(name for name in vars(loaded) if "_lora_" in name)] * 2
    assert weights[0]["o_proj_lora_b"].shape == (lora_model.config.num_layers, 8, lora_model.config.hidden_size)
    assert not weights[0]["o_proj_lora_b"].any() and weights[1]["o_proj_lora_b"].any()
    np.testing.assert_array_equal(np.asarray(loaded.q_proj_lora_b[...])[:, 0], weights[0]["q_proj_lora_b"])


def test_load_adapter_reads_a_folder_under_the_home_directory_written_with_a_tilde(lora_model, adapter, monkeypatch):
    """`~/...` as vLLM's lora_path and a model's path take it; `~user` of no such user is no folder, in one line."""
    monkeypatch.setenv("HOME", str(adapter.parent))
    assert load_adapter("tuned", "~/qv_rslora", lora_model.config).fingerprint == \
        load_adapter("tuned", adapter, lora_model.config).fingerprint
    with pytest.raises(AdapterNotFound, match=r"\(~nosuchuser57/x\): no such folder$"):
        load_adapter("tuned", "~nosuchuser57/x", lora_model.config)


def test_load_adapter_refuses_a_rank_above_the_largest_served(lora_model):
    with pytest.raises(LoraError, match=r"'all_modules' .* has rank 8, above the largest served, 4 \(max_lora_rank\)"):
        load_adapter("all_modules", ADAPTERS / "all_modules", lora_model.config, max_rank=4)


def test_attach_refuses_an_adapter_that_overflows_the_models_dtype(lora_model, adapter):
    """float16 tops out at 65504: B times the scaling past it would be inf, and reach every token of its steps."""
    edit_tensors(lambda t: t[Q_B].__setitem__((0, 0), 1e5))(adapter)
    with pytest.raises(LoraError, match="q_proj_lora_b overflows float16"):
        attach_adapters(Llama(lora_model.config, dtype=jnp.float16, rngs=nnx.Rngs(0)),
                        [load_adapter("big", adapter, lora_model.config)], max_loras=1, max_rank=4)


def test_slots_past_the_adapters_and_ranks_past_an_adapters_are_zeros(lora_model):
    """Slot 0 of 3 holds qv_rslora, of rank 4 in 8: q/k/v's parameters alone, k's zeros."""
    loaded = Llama(lora_model.config, rngs=nnx.Rngs(0))
    attach_adapters(loaded, read_adapters(lora_model.config)[1:], max_loras=3, max_rank=8)
    assert {name for name in vars(loaded) if "_lora_" in name} == {"wqkv_lora_a", "q_proj_lora_b", "k_proj_lora_b",
                                                                  "v_proj_lora_b"}
    a = np.asarray(loaded.wqkv_lora_a[...])  # [L, 3 slots, K, 3 modules, 8]
    bs = [np.asarray(getattr(loaded, f"{module}_lora_b")[...]) for module in ("q_proj", "k_proj", "v_proj")]
    assert a[:, 0, :, [0, 2], :4].all() and not a[..., 1, :].any() and not a[:, 1:].any() and not a[..., 4:].any()
    assert bs[0][:, 0, :4].all() and bs[2][:, 0, :4].all() and not bs[1].any()
    assert not any(b[:, 1:].any() or b[:, :, 4:].any() for b in bs)
