"""Partition rules for the Llama parameters and the KV pool (Megatron-style tensor parallelism), in one place.

- q/k/v projections and MLP gate/up are column-parallel (split over heads / intermediate features);
  the o and down projections are row-parallel, so each layer needs one all-reduce after attention and one
  after the MLP (XLA inserts them from these shardings).
- The embedding is split over the vocabulary: a lookup is a masked local gather plus an all-reduce of a
  [T, hidden] activation, and the tied LM head then yields vocab-sharded logits that are gathered once for
  sampling. Splitting it divides the largest tensor of small models (SmolLM2: 113 MB of 540 MB in float32)
  across devices. A vocabulary that tp does not divide is replicated instead.
- The KV pool is split over KV heads: each device holds only its heads' pages.
- Norm weights are tiny and replicated.
Heads are never padded or replicated: tp must divide the KV-head count (and so the query-head count) and the
MLP width, and `validate_tp` names the valid values otherwise.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from model.config import ModelConfig
from model.llama import Llama
from sharding.mesh import TP_AXIS, InvalidTensorParallelism

T = TP_AXIS
PARAM_SPECS: dict[str, P] = {
    "embed": P(T, None),  # [vocab, hidden]
    "lm_head": P(None, T),  # [hidden, vocab]
    "attn_norm": P(),
    "mlp_norm": P(),
    "final_norm": P(),
    "wq": P(None, None, T),  # [layers, hidden, heads * head_dim]
    "wk": P(None, None, T),
    "wv": P(None, None, T),
    "bq": P(None, T),
    "bk": P(None, T),
    "bv": P(None, T),
    "wo": P(None, T, None),  # [layers, heads * head_dim, hidden]
    "w_gate": P(None, None, T),  # [layers, hidden, intermediate]
    "w_up": P(None, None, T),
    "w_down": P(None, T, None),  # [layers, intermediate, hidden]
}
VOCAB_SHARDED = {"embed", "lm_head"}
KV_CACHE_SPEC = P(None, None, T, None, None)  # [layers, pages, kv_heads, page_size, head_dim]


def valid_tp_values(config: ModelConfig) -> list[int]:
    return [n for n in range(1, config.num_kv_heads + 1)
            if config.num_kv_heads % n == 0 and config.intermediate_size % n == 0]


def validate_tp(config: ModelConfig, tp: int) -> None:
    if tp not in valid_tp_values(config):
        raise InvalidTensorParallelism(
            f"--tp {tp} does not divide this model's {config.num_kv_heads} KV heads ({config.num_heads} query heads); "
            f"valid values: {', '.join(map(str, valid_tp_values(config)))}"
        )


def param_sharding(mesh: Mesh, config: ModelConfig, name: str, shape: tuple[int, ...]) -> NamedSharding:
    """Where parameter `name` lives on `mesh` (a `model.loader.ShardingRule` once the mesh is bound)."""
    validate_tp(config, mesh.shape[T])
    spec = PARAM_SPECS[name]
    if name in VOCAB_SHARDED and config.vocab_size % mesh.shape[T]:
        spec = P()
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
