"""The Llama-family decoder in Flax NNX.

Layer weights are stacked on a leading `[num_layers, ...]` axis, as loaded, and the layers run under
`jax.lax.scan`, so compile time does not grow with depth. `Llama.unstack_layers` stores them instead as one
array per layer and the layers then run unrolled: on a GPU, XLA copies a layer's slice of a stacked weight out
before multiplying it, so a scanned step moves the weights three times (`resolve_layer_loop`). The model knows
nothing about how K/V are cached: each layer hands its q/k/v to an `AttendFn`, which writes the new K/V into the
cache and attends (paged in the engine, contiguous in the baseline `generate`). Linear weights are stored
`[in_features, out_features]` (`x @ w`).

Projections are fused, one matmul each for q/k/v and for gate/up, with the output axis split so that a
tensor-parallel shard of the fused weight holds whole units of its own:
- `wqkv` `[L, hidden, num_kv_heads, (q_per_kv + 2) * head_dim]`: per KV head, its q_per_kv query heads, then
  its key head, then its value head (shards split KV heads, as attention does);
- `w_gate_up` `[L, hidden, 2, intermediate]`: gate then up (shards split the intermediate axis).
A model given LoRA adapters (`model.lora.attach_adapters`) also holds, for each projection they add to, its A
`{name}_lora_a` and a B `{module}_lora_b` for each module fused in it (`LORA_MODULES`), and adds each token's
adapter's delta to that projection (`lora_delta`).
A Qwen3 (`ModelConfig.qk_norm`) also holds `q_norm` and `k_norm` `[L, head_dim]`, the RMSNorm weights each query and
key head is normalized by before RoPE. A Granite scales its embeddings, residual branches and logits by the config's
scalars (`ModelConfig.embedding_multiplier`, ...).
Any of the linear weights may be stored quantized (`model.quantize`); `model.linear` multiplies them.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from sluice.model.config import ModelConfig
from sluice.model.linear import RmsNorm, Weight, embed_rows, layer_slice, project, project_rows
from sluice.pallas_kernels import cpu_rows_matmul
from sluice.pallas_kernels.cpu_qmatmul import rms_norm
from sluice.pallas_kernels.kv_cache import Pages, empty_pages

KVCache = tuple[Pages, Pages]
"""(k, v) as the `AttendFn` keeps them (arrays, or int8 `QuantizedPages`): the model only threads them through its
layers."""

AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, KVCache], tuple[jax.Array, KVCache]]
"""attend(layer, q [T, Hq, Dh], k [T, Hkv, Dh], v [T, Hkv, Dh], kv_cache) -> (out [T, Hq, Dh], kv_cache)."""

LORA_MODULES = {"wqkv": ("q_proj", "k_proj", "v_proj"), "wo": ("o_proj",), "w_gate_up": ("gate_proj", "up_proj"),
                "w_down": ("down_proj",)}
"""The projections a LoRA adapter may add to -> the (PEFT) modules fused in each, in the order of its output axes."""


def lora_a(weight: str) -> str:
    """The name of projection `weight`'s LoRA A, `[L, S, K, P, R]`: S slots of P modules of rank R (`model.lora`)."""
    return f"{weight}_lora_a"


def lora_b(module: str) -> str:
    """The name of a module's LoRA B, `[L, S, R, out]`, the scaling folded in (`model.lora`)."""
    return f"{module}_lora_b"


LORA_PARAMS = (*map(lora_a, LORA_MODULES), *(lora_b(m) for modules in LORA_MODULES.values() for m in modules))
LAYER_PARAMS = ("attn_norm", "wqkv", "bqkv", "q_norm", "k_norm", "wo", "mlp_norm", "w_gate_up", "w_down", *LORA_PARAMS)
LAYER_LOOPS = ("auto", "scan", "unrolled")
LINEAR_WEIGHTS = {"wqkv": 1, "wo": 1, "w_gate_up": 1, "w_down": 1, "embed": 1, "lm_head": 0}
"""The weights that are multiplied (and may be quantized) -> their input-feature (contracting) axis. The
tied `embed [vocab, hidden]` is the LM head `hidden -> vocab` read row-wise."""


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array,
                 attention_factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """positions: [T] int32, inv_freq: [Dh/2] -> cos, sin: [T, 1, Dh/2] float32 (broadcast over heads), both scaled
    by `attention_factor` (YaRN's: rotating q and k by them scales q.k by its square)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return scaled(jnp.cos(angles), attention_factor)[:, None, :], scaled(jnp.sin(angles), attention_factor)[:, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the HF Llama layout). x: [T, H, Dh] -> [T, H, Dh]."""
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def scaled(x: jax.Array, factor: float) -> jax.Array:
    """x times `factor`, or x itself for a factor of 1: a Llama's program then holds no multiplication by it."""
    return x if factor == 1.0 else x * factor


def lora_delta(x: jax.Array, a: jax.Array, bs: list[jax.Array], adapters: jax.Array, layer: jax.Array | None,
               slot: jax.Array | None = None) -> list[jax.Array]:
    """Each token's LoRA delta from its adapter's slot, for each of the P modules of a projection. x: [T, K] (the
    projection's input, normalized as the base weight sees it), a: [S, K, P, R], bs: P arrays [S, R, out] (S slots of
    rank R, `model.lora`), or their stacks `[L, ...]` with `layer` the index into them; adapters: [T] int32, each
    token's slot (-1: none) -> P arrays [T, out] in x's dtype.

    Every token multiplies every slot's A (one small dense matmul, whatever the mix of adapters), and the columns of
    the slots not its own are zeroed before the Bs. With `slot` given, the tokens use that adapter or none, and its
    slot's weights alone are read. On a CPU with the kernel library (float32 weights), the matmuls are
    `cpu_rows_matmul`'s, whose rows sum in an order no other row changes: XLA's dot rounds a token's delta otherwise
    as the step's size changes, and the int8 quantization of the next projection's input (the CPU kernels) turns
    that last bit into other tokens."""
    def einsums() -> list[jax.Array]:
        return _lora_delta_einsums(x, a, bs, adapters, layer, slot)

    if a.dtype == jnp.float32 and cpu_rows_matmul.available():
        rows = lambda: _lora_delta_rows(x, a, bs, adapters, jnp.int32(0) if layer is None else layer, slot)
        return jax.lax.platform_dependent(cpu=rows, default=einsums)
    return einsums()


def _lora_delta_einsums(x: jax.Array, a: jax.Array, bs: list[jax.Array], adapters: jax.Array,
                        layer: jax.Array | None, slot: jax.Array | None) -> list[jax.Array]:
    """`lora_delta` in XLA's dots."""
    at = (lambda w: w) if layer is None else (lambda w: layer_slice(w, layer))
    if slot is not None:
        # One index of both axes: XLA then reads the slot's weights in place of a copy of the layer's slots.
        one = (lambda w: w[slot]) if layer is None else (lambda w: w[layer, slot])
        own = (adapters == slot).astype(jnp.float32)[:, None, None]
        h = (jnp.einsum("tk,kpr->tpr", x, one(a), preferred_element_type=jnp.float32) * own).astype(a.dtype)
        return [jnp.dot(h[:, part], one(b), preferred_element_type=jnp.float32).astype(x.dtype)
                for part, b in enumerate(bs)]
    own = jax.nn.one_hot(adapters, a.shape[-4], dtype=jnp.float32)  # [T, S]; a row of zeros for -1
    h = jnp.einsum("tk,skpr->tpsr", x, at(a), preferred_element_type=jnp.float32) * own[:, None, :, None]
    h = h.astype(a.dtype)
    return [jnp.einsum("tsr,sro->to", h[:, part], at(b), preferred_element_type=jnp.float32).astype(x.dtype)
            for part, b in enumerate(bs)]


def _lora_delta_rows(x: jax.Array, a: jax.Array, bs: list[jax.Array], adapters: jax.Array, layer: jax.Array,
                     slot: jax.Array | None) -> list[jax.Array]:
    """`lora_delta` in `cpu_rows_matmul`'s matmuls (float32 weights, `layer` 0 for unstacked ones), on the stacks
    seen as matrices, read in place: the As `[L S, K, P R]`, each B `[L S / C, C R, out]` for the C slots used
    (one, or all S: the tokens' A outputs of those C slots, side by side, then meet their Bs in one matmul)."""
    num_slots, k, parts, rank = a.shape[-4:]
    first, used = (layer * num_slots, num_slots) if slot is None else (layer * num_slots + slot, 1)
    own = jax.nn.one_hot(adapters, num_slots) if slot is None else (adapters == slot)[:, None]  # [T, C]
    h = cpu_rows_matmul.rows_matmul(x.astype(jnp.float32), a.reshape(-1, k, parts * rank), first, used)
    h = h.reshape(-1, used, parts, rank) * own.astype(jnp.float32)[:, :, None, None]

    def times_b(part: int, b: jax.Array) -> jax.Array:
        """Module `part`'s [T, C R] of h against its B [(L S / C), C R, out] -> [T, out]."""
        h_part = h[:, :, part].reshape(-1, used * rank)
        return cpu_rows_matmul.rows_matmul(h_part, b.reshape(-1, used * rank, b.shape[-1]), first // used, 1)[:, 0]

    return [times_b(part, b).astype(x.dtype) for part, b in enumerate(bs)]


def with_lora(plain: Callable[[], jax.Array], adapted: Callable[[jax.Array | None], jax.Array],
              adapters: jax.Array) -> jax.Array:
    """A projection's output for tokens of LoRA `adapters` ([T] int32, -1: none): `plain()` without LoRA, or
    `adapted(slot)` with its delta (`lora_delta`'s `slot`). On a CPU the delta costs as many milliseconds a step as
    the slots' float weights take to read, so the step's tokens choose: no adapter, the plain projection (its input
    normalized inside the CPU kernels); one, that slot's weights alone; several, every slot's. Elsewhere every slot's
    always: a branch on the device would stall the step for the host, and the slots' weights are small beside the
    model's."""
    def by_adapters() -> jax.Array:
        slot = jnp.max(adapters)
        branch = jnp.where(slot < 0, 0, jnp.where(jnp.all((adapters == slot) | (adapters < 0)), 1, 2))
        return jax.lax.switch(branch, [plain, lambda: adapted(slot), lambda: adapted(None)])

    return jax.lax.platform_dependent(cpu=by_adapters, default=lambda: adapted(None))


def fuse_outputs(weight: str, parts: list[jax.Array], config: ModelConfig) -> jax.Array:
    """The outputs of the modules fused in projection `weight` (`LORA_MODULES`), each `[T, out]` -> `[T, *N]`, laid
    as the projection lays its output (`fuse_qkv`; gate then up)."""
    if weight == "wqkv":
        return fuse_qkv(*parts, config)
    if weight == "w_gate_up":
        return jnp.stack(parts, axis=-2)
    return parts[0]


def fuse_qkv(wq, wk, wv, config: ModelConfig):
    """wq [..., num_heads * head_dim], wk and wv [..., num_kv_heads * head_dim] (weights or biases)
    -> [..., num_kv_heads, (q_per_kv + 2) * head_dim] (the `wqkv` layout). NumPy or jnp arrays."""
    c = config
    lead = wq.shape[:-1]
    q = wq.reshape(*lead, c.num_kv_heads, c.q_per_kv * c.head_dim)
    k = wk.reshape(*lead, c.num_kv_heads, c.head_dim)
    v = wv.reshape(*lead, c.num_kv_heads, c.head_dim)
    concat = np.concatenate if isinstance(wq, np.ndarray) else jnp.concatenate
    return concat([q, k, v], axis=-1)


def split_qkv(qkv: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[..., num_kv_heads, (q_per_kv + 2) * head_dim] -> q [..., num_heads, head_dim], k and v
    [..., num_kv_heads, head_dim]. Query head j sits in KV head j // q_per_kv's group, as GQA reads it."""
    c = config
    lead = qkv.shape[:-2]
    grouped = qkv.reshape(*lead, c.num_kv_heads, c.q_per_kv + 2, c.head_dim)
    q = grouped[..., : c.q_per_kv, :].reshape(*lead, c.num_heads, c.head_dim)
    return q, grouped[..., c.q_per_kv, :], grouped[..., c.q_per_kv + 1, :]


def resolve_layer_loop(choice: str) -> str:
    """"scan" or "unrolled" for a `LAYER_LOOPS` choice. "auto": unrolled on a GPU, where the scan's per-layer
    weight copies took two-thirds of Llama-3-8B's decode step on an H200 (bench/RESULTS.md); a scan elsewhere:
    compile time independent of depth, and the CPU kernels read a layer of the stack in place."""
    if choice == "auto":
        return "unrolled" if jax.default_backend() == "gpu" else "scan"
    return choice


def _split_layers(stacked: jax.Array) -> tuple[jax.Array, ...]:
    """[L, ...] -> L arrays [...], each sharded as the stack was over its other axes."""
    sharding = None if isinstance(stacked, jax.core.Tracer) else stacked.sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    return jax.jit(lambda a: tuple(a), out_shardings=sharding)(stacked)


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype, fan_in: int) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype))


class Llama(nnx.Module):
    """Decoder-only Llama. Random init here; `model.loader` fills real weights."""

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        c = config
        self.config = config
        self.dtype = dtype  # of activations and the KV cache; quantized weights keep their own dtypes
        L, D, F = c.num_layers, c.hidden_size, c.intermediate_size
        q_dim = c.num_heads * c.head_dim
        qkv_group = (c.q_per_kv + 2) * c.head_dim
        self.embed = _init(rngs, (c.vocab_size, D), dtype, 1)
        self.attn_norm = nnx.Param(jnp.ones((L, D), dtype))
        self.wqkv = _init(rngs, (L, D, c.num_kv_heads, qkv_group), dtype, D)
        if c.attention_bias:
            self.bqkv = _init(rngs, (L, c.num_kv_heads, qkv_group), dtype, 1)
        if c.qk_norm:
            self.q_norm = nnx.Param(jnp.ones((L, c.head_dim), dtype))
            self.k_norm = nnx.Param(jnp.ones((L, c.head_dim), dtype))
        self.wo = _init(rngs, (L, q_dim, D), dtype, q_dim)
        self.mlp_norm = nnx.Param(jnp.ones((L, D), dtype))
        self.w_gate_up = _init(rngs, (L, D, 2, F), dtype, D)
        self.w_down = _init(rngs, (L, F, D), dtype, F)
        self.final_norm = nnx.Param(jnp.ones((D,), dtype))
        if not c.tie_word_embeddings:
            self.lm_head = _init(rngs, (D, c.vocab_size), dtype, D)

    @property
    def has_lora(self) -> bool:
        """Whether LoRA adapters were attached (`model.lora.attach_adapters`): then `__call__` takes `adapters`."""
        return any(hasattr(self, name) for name in LORA_PARAMS)

    @property
    def layers_unstacked(self) -> bool:
        """Whether the layer parameters are stored one array per layer (`unstack_layers`)."""
        return isinstance(self.wqkv.get_value(), tuple)

    def unstack_layers(self) -> None:
        """Stores every layer parameter (and a quantized weight's scales) as a tuple of `num_layers` arrays in
        place of its stack, freeing the stack; the layers then run unrolled."""
        if self.layers_unstacked:
            return
        for name, variable in vars(self).items():
            if isinstance(variable, nnx.Variable) and name.removesuffix("_scale").removesuffix("_min") in LAYER_PARAMS:
                variable.set_value(_split_layers(variable.get_value()))

    def set_layer_param(self, name: str, stacked: jax.Array) -> None:
        """Sets layer parameter `name` (one of `LAYER_PARAMS`) from its stack `[L, ...]`, stored as the others are
        (one array per layer if they are unstacked)."""
        setattr(self, name, nnx.Param(_split_layers(stacked) if self.layers_unstacked else stacked))

    def weight(self, name: str, layer: int | None = None) -> Weight:
        """A linear weight as stored, with its scales when quantized; `layer`: that layer's own arrays (the
        layers unstacked)."""
        def part(suffix: str) -> jax.Array | None:
            if not hasattr(self, name + suffix):
                return None
            value = getattr(self, name + suffix).get_value()
            return value if layer is None else value[layer]

        return Weight(part(""), part("_scale"), part("_min"))

    def _layer_params(self, layer: int | None = None) -> dict[str, jax.Array | Weight]:
        """The stacks, or with `layer` (the layers unstacked) that layer's arrays."""
        pick = lambda value: value if layer is None else value[layer]
        return {
            name: self.weight(name, layer) if name in LINEAR_WEIGHTS else pick(getattr(self, name).get_value())
            for name in LAYER_PARAMS if hasattr(self, name)
        }

    def __call__(
        self, token_ids: jax.Array, positions: jax.Array, kv_cache: KVCache, attend: AttendFn,
        num_real: jax.Array | None = None, adapters: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """token_ids, positions: [T] int32 -> (hidden [T, D] in the params dtype: the last layer's residual
        stream, which `logits` normalizes; updated kv_cache). `num_real` (int32 [], default T): only the first
        rows are real tokens, the others padding whose hidden rows are unspecified (the CPU kernels skip them).
        `adapters` ([T] int32): each token's LoRA slot, -1 for the base model; ignored by a model without LoRA
        (`has_lora`), whose program it leaves as it is."""
        c = self.config
        num_tokens = token_ids.shape[0]
        x = scaled(embed_rows(self.weight("embed"), token_ids, self.dtype), c.embedding_multiplier)
        cos, sin = rope_cos_sin(positions, jnp.asarray(c.rope_inv_freq(), jnp.float32), c.rope_attention_factor)
        def block(x: jax.Array, kv_cache: KVCache, p: dict, index: jax.Array | int, layer: jax.Array | None):
            """Decoder layer `index`. p: the stacks with `layer` the index into them (traced), or the layer's own
            arrays with `layer` None."""
            at = (lambda a: a) if layer is None else (lambda a: layer_slice(a, layer))

            def linear(x: jax.Array, name: str, norm: str | None = None) -> jax.Array:
                """x [T, K] through projection `name`, normalized first by the RMSNorm weights `norm` if given, plus
                its LoRA delta if it has one."""
                def plain() -> jax.Array:
                    rms = None if norm is None else RmsNorm(p[norm], c.rms_norm_eps)
                    return project(x, p[name], layer, norm=rms, num_real=num_real)

                def adapted(slot: jax.Array | None) -> jax.Array:
                    # The delta multiplies what the base weight does; the base projection is the plain one, so a
                    # token of no adapter gets the same bits whatever else shares its step.
                    h = x if norm is None else rms_norm(x, at(p[norm]), c.rms_norm_eps).astype(x.dtype)
                    bs = [p[lora_b(module)] for module in LORA_MODULES[name]]
                    return plain() + fuse_outputs(name, lora_delta(h, p[lora_a(name)], bs, adapters, layer, slot), c)

                if adapters is None or lora_a(name) not in p:
                    return plain()
                return with_lora(plain, adapted, adapters)

            qkv = linear(x, "wqkv", "attn_norm")
            if c.attention_bias:
                qkv = qkv + at(p["bqkv"])
            q, k, v = split_qkv(qkv, c)
            if c.qk_norm:
                q = rms_norm(q, at(p["q_norm"]), c.rms_norm_eps).astype(q.dtype)
                k = rms_norm(k, at(p["k_norm"]), c.rms_norm_eps).astype(k.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            attn, kv_cache = attend(index, q, k, v, kv_cache)
            attn_out = linear(attn.reshape(num_tokens, -1).astype(x.dtype), "wo")
            x = x + scaled(attn_out, c.residual_multiplier)
            gate_up = linear(x, "w_gate_up", "mlp_norm")
            mlp_out = linear(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], "w_down")
            x = x + scaled(mlp_out, c.residual_multiplier)
            return x, kv_cache

        if self.layers_unstacked:
            for index in range(c.num_layers):
                x, kv_cache = block(x, kv_cache, self._layer_params(index), index, None)
            return x, kv_cache
        # The stacks enter the scan whole (closed over), indexed by layer where they are used: the CPU kernels
        # then read a layer in place instead of a copy sliced out for them.
        p = self._layer_params()

        def scanned(carry: tuple[jax.Array, KVCache], index: jax.Array):
            return block(*carry, p, index, index), None

        (x, kv_cache), _ = jax.lax.scan(scanned, (x, kv_cache), jnp.arange(c.num_layers, dtype=jnp.int32))
        return x, kv_cache

    def logits(self, hidden: jax.Array, num_real: jax.Array | None = None) -> jax.Array:
        """hidden: [N, D] (the last layer's residual stream) -> [N, vocab] float32, through the final norm and
        divided by `logits_scaling`. Call it only on the rows that are sampled; `num_real` as in `__call__`."""
        norm = RmsNorm(self.final_norm[...], self.config.rms_norm_eps)
        if self.config.tie_word_embeddings:
            logits = project_rows(hidden, self.weight("embed"), norm, num_real=num_real)
        else:
            logits = project(hidden, self.weight("lm_head"), out_dtype=jnp.float32, norm=norm, num_real=num_real)
        return scaled(logits, 1.0 / self.config.logits_scaling)

    def pooled(self, hidden: jax.Array, segments: jax.Array, num_segments: int) -> jax.Array:
        """hidden: [T, D] (as `__call__` returns it), segments: [T] int32 (-1: none) -> [num_segments, D] float32,
        each segment's sum of its rows through the final norm (what an embedding pools, `app/embeddings.py`)."""
        normed = rms_norm(hidden, self.final_norm[...], self.config.rms_norm_eps)
        return jax.ops.segment_sum(normed, segments, num_segments)


def empty_kv_cache(
    config: ModelConfig, num_pages: int, page_size: int, dtype: jnp.dtype, sharding: jax.sharding.Sharding | None = None
) -> KVCache:
    """A zeroed KV pool: (k, v), each `[num_layers, num_pages, num_kv_heads, page_size, head_dim]` of `dtype`
    (int8: `QuantizedPages`, with scales `[num_layers, num_pages, num_kv_heads, page_size]`)."""
    shape = (config.num_layers, num_pages, config.num_kv_heads, page_size, config.head_dim)
    return empty_pages(shape, dtype, sharding), empty_pages(shape, dtype, sharding)
