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
- Norm weights are tiny and replicated.
Heads are never padded or replicated: tp must divide the KV-head count (and so the query-head count) and the
MLP width, and `validate_tp` names the valid values otherwise.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sluice.model.config import ModelConfig
from sluice.model.llama import LINEAR_WEIGHTS, Llama
from sluice.model.quantize import packed_order
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
}
VOCAB_SHARDED = {"embed", "lm_head"}
# [layers, pages, kv_heads, ...]: values [..., page_size, head_dim] and an int8 pool's scales [..., page_size] alike.
KV_CACHE_SPEC = P(None, None, T)


def valid_tp_values(config: ModelConfig) -> list[int]:
    return [n for n in range(1, config.num_kv_heads + 1)
            if config.num_kv_heads % n == 0 and config.intermediate_size % n == 0]


def validate_tp(config: ModelConfig, tp: int) -> None:
    if tp not in valid_tp_values(config):
        raise InvalidTensorParallelism(
            f"--tp {tp} must divide this model's {config.num_kv_heads} KV heads ({config.num_heads} query heads) "
            f"and its MLP width of {config.intermediate_size}; valid values: "
            f"{', '.join(map(str, valid_tp_values(config)))}"
        )


def param_spec(name: str, shape: tuple[int, ...]) -> P:
    """The partition of parameter `name`, a quantized weight's values, scale or min included (`shape` tells its
    form from the float one's: the packed layout has more axes, a per-channel scale one fewer)."""
    base = name.removesuffix("_scale").removesuffix("_min")
    spec = tuple(PARAM_SPECS[base])
    if base not in LINEAR_WEIGHTS or len(shape) == len(spec):  # a float parameter, or per-channel int8 values
        return P(*spec)
    if len(shape) == len(spec) - 1:  # a per-channel scale
        return P(*(part for axis, part in enumerate(spec) if axis != LINEAR_WEIGHTS[base]))
    return P(*packed_order(base, spec))


def param_sharding(mesh: Mesh, config: ModelConfig, name: str, shape: tuple[int, ...]) -> NamedSharding:
    """Where parameter `name` lives on `mesh` (a `model.loader.ShardingRule` once the mesh is bound)."""
    validate_tp(config, mesh.shape[T])
    spec = param_spec(name, shape)
    tp = mesh.shape[T]
    if name.removesuffix("_scale") in VOCAB_SHARDED and any(p and shape[a] % tp for a, p in enumerate(spec)):
        spec = P()
    for axis, part in enumerate(spec):
        if part is not None and shape[axis] % tp:
            raise InvalidTensorParallelism(
                f"--tp {tp} does not divide axis {axis} of {name} {tuple(shape)}"
            )
    return NamedSharding(mesh, spec)


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_CACHE_SPEC)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_model(model: Llama, mesh: Mesh) -> None:
    """Moves an already-built model's parameters onto `mesh` by the rules (random-init models; real weights
    are restored straight into their shardings by `model.loader.load_model`)."""
    state = nnx.state(model)
    shardings = {
        path[0]: param_sharding(mesh, model.config, path[0], var.shape) for path, var in nnx.to_flat_state(state)
    }
    nnx.update(model, jax.tree.map_with_path(lambda path, x: jax.device_put(x, shardings[path[0].key]), state))
