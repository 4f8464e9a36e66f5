"""Partition rules for the Llama parameters and the KV pool (Megatron-style tensor parallelism), in one place.

- The fused q/k/v projection and the fused MLP gate/up are column-parallel: `wqkv` is split over KV heads
  (each KV head's group of query heads, key and value sit together in it, `model.llama`), `w_gate_up` over
  the intermediate features (gate and up are a separate axis, so each shard holds both halves of its own
  features). The o and down projections are row-parallel, so each layer needs one all-reduce after attention
  and one after the MLP (XLA inserts them from these shardings).
- Quantized weights (`model.quantize`) are split like their float form, axis for axis in the packed layout's
  order (`packed_order`): values, scales and mins alike (the input axis counted in packs or blocks, the last
  output axis in panels of 16). Per-channel int8 values have the float form's shape, and their scales that
  shape without the input axis.
- The embedding is split over the vocabulary: a lookup is a masked local gather plus an all-reduce of a
  [T, hidden] activation, and the tied LM head then yields vocab-sharded logits that are gathered once for
  sampling. Splitting it divides the largest tensor of small models (SmolLM2: 113 MB of 540 MB in float32)
  across devices. A vocabulary that tp does not divide is replicated instead.
- The KV pool is split over KV heads: each device holds only its heads' pages (an int8 pool's scales too).
- LoRA adapters' A and B are split so that each delta is split as its projection's output: the Bs' outputs for
  q/k/v and gate/up (a module's heads or features in order: each shard's the weight's), A's input for o and down (as
  the weight's); the other replicated.
- Norm weights are tiny and replicated.
Heads are never padded or replicated: tp must divide the KV-head count (and so the query-head count), the MLP
width and, for packed quantized weights, the number of blocks of inputs of the row-parallel o and down projections
(a block is what one scale covers). `param_sharding` refuses any other tp for the whole model at once, naming the
valid values, as the loader builds its restore target from the model's config, before any conversion.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sluice.model.config import ModelConfig
from sluice.model.llama import LINEAR_WEIGHTS, Llama
from sluice.model.quantize import packed_order
from sluice.pallas_kernels.cpu_qmatmul import BLOCK
from sluice.sharding.mesh import TP_AXIS, InvalidTensorParallelism

T = TP_AXIS
PARAM_SPECS: dict[str, P] = {
    "embed": P(T, None),  # [vocab, hidden]
    "lm_head": P(None, T),  # [hidden, vocab]
    "attn_norm": P(),
    "mlp_norm": P(),
    "final_norm": P(),
    "wqkv": P(None, None, T, None),  # [layers, hidden, kv_heads, (q_per_kv + 2) * head_dim]
    "bqkv": P(None, T, None),  # [layers, kv_heads, (q_per_kv + 2) * head_dim]
    "q_norm": P(),  # [layers, head_dim], the same for every head
    "k_norm": P(),
    "wo": P(None, T, None),  # [layers, heads * head_dim, hidden]
    "w_gate_up": P(None, None, None, T),  # [layers, hidden, 2, intermediate]
    "w_down": P(None, T, None),  # [layers, intermediate, hidden]
    # LoRA (`model.lora`): A [layers, slots, K, modules, rank], B [layers, slots, rank, out] of each module
    "wqkv_lora_a": P(),
    "w_gate_up_lora_a": P(),
    "wo_lora_a": P(None, None, T, None, None),
    "w_down_lora_a": P(None, None, T, None, None),
    **dict.fromkeys(("q_proj_lora_b", "k_proj_lora_b", "v_proj_lora_b", "gate_proj_lora_b", "up_proj_lora_b"),
                    P(None, None, None, T)),  # each module's output split as wqkv's heads, w_gate_up's features
    "o_proj_lora_b": P(),
    "down_proj_lora_b": P(),
}
VOCAB_SHARDED = {"embed", "lm_head"}
# [layers, pages, kv_heads, ...]: values [..., page_size, head_dim] and an int8 pool's scales [..., page_size] alike.
KV_CACHE_SPEC = P(None, None, T)


def _valid_tp_values(config: ModelConfig, shapes: Mapping[str, tuple[int, ...]]) -> list[int]:
    """The tp values that split every parameter (`shapes`: name -> shape as stored) evenly: at most the KV heads,
    which the q/k/v projection is split by."""
    return [tp for tp in range(1, config.num_kv_heads + 1)
            if all(_partition(name, shape, tp) is not None for name, shape in shapes.items())]


def _check_tp(config: ModelConfig, tp: int, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """InvalidTensorParallelism in one line naming the sizes tp must divide and the valid values, unless `tp`
    splits every parameter (`shapes`) evenly. Packed weights split their blocks of inputs too: the o projection's
    (the attention width) and the down projection's (the MLP width)."""
    valid = _valid_tp_values(config, shapes)
    if tp in valid:
        return
    blocks = (f", and leave its quantized weights' blocks of {BLOCK} inputs whole (attention width "
              f"{config.num_heads * config.head_dim}, MLP width {config.intermediate_size})"
              if any(_is_packed(name, shape) for name, shape in shapes.items()) else "")
    raise InvalidTensorParallelism(
        f"--tp {tp} must divide this model's {config.num_kv_heads} KV heads ({config.num_heads} query heads) "
        f"and its MLP width of {config.intermediate_size}{blocks}; valid values: {', '.join(map(str, valid))}"
    )


def _is_packed(name: str, shape: tuple[int, ...]) -> bool:
    """Whether parameter `name` (a quantized weight's values, scale or min included) is in the packed layout, which
    has more axes than the float form."""
    base = _float_name(name)
    return base in LINEAR_WEIGHTS and len(shape) > len(PARAM_SPECS[base])


def _float_name(name: str) -> str:
    return name.removesuffix("_scale").removesuffix("_min")


def param_spec(name: str, shape: tuple[int, ...]) -> P:
    """The partition of parameter `name`, a quantized weight's values, scale or min included (`shape` tells its
    form from the float one's: the packed layout has more axes, a per-channel scale one fewer)."""
    base = _float_name(name)
    spec = tuple(PARAM_SPECS[base])
    if _is_packed(name, shape):
        return P(*packed_order(base, spec))
    if base in LINEAR_WEIGHTS and len(shape) == len(spec) - 1:  # a per-channel scale
        return P(*(part for axis, part in enumerate(spec) if axis != LINEAR_WEIGHTS[base]))
    return P(*spec)  # a float parameter, or per-channel int8 values


def _partition(name: str, shape: tuple[int, ...], tp: int) -> P | None:
    """Parameter `name`'s partition over `tp` devices: `param_spec`, or replicated for a vocabulary-split one whose
    vocabulary tp does not divide; None if tp does not divide another's split axis."""
    spec = param_spec(name, shape)
    if all(part is None or shape[axis] % tp == 0 for axis, part in enumerate(spec)):
        return spec
    return P() if _float_name(name) in VOCAB_SHARDED else None


def param_sharding(mesh: Mesh, config: ModelConfig, shapes: Mapping[str, tuple[int, ...]]
                   ) -> dict[str, NamedSharding]:
    """Where each parameter (`shapes`: name -> shape as stored, a quantized weight's values, scales and mins
    included) lives on `mesh` (a `model.loader.ShardingRule` once the mesh is bound); InvalidTensorParallelism
    naming the valid values if the mesh's tp does not split them all evenly."""
    tp = mesh.shape[T]
    _check_tp(config, tp, shapes)
    return {name: NamedSharding(mesh, _partition(name, shape, tp)) for name, shape in shapes.items()}


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """The KV pool's sharding, split over KV heads as the q/k/v projection is: a mesh `param_sharding` accepted
    for the model divides them (there is no other check: a pool of heads the mesh does not divide fails to
    allocate)."""
    return NamedSharding(mesh, KV_CACHE_SPEC)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_model(model: Llama, mesh: Mesh) -> None:
    """Moves an already-built model's parameters onto `mesh` by the rules (random-init models; real weights
    are restored straight into their shardings by `model.loader.load_model`)."""
    state = nnx.state(model)
    shardings = param_sharding(mesh, model.config, {path[0]: var.shape for path, var in nnx.to_flat_state(state)})
    nnx.update(model, jax.tree.map_with_path(lambda path, x: jax.device_put(x, shardings[path[0].key]), state))
