"""Every Pallas kernel lowers for the GPU ("cuda") at the served shapes, on any host.

`jax.export` lowers without a GPU, so a kernel using an operation with no GPU lowering rule fails
here on a CPU-only CI machine. Lowering is not compiling: Triton's compile and the kernel's speed
and GPU numerics show only on a GPU (bench/kernels.py, and this suite run there).
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.attention import paged_decode_attention, ragged_paged_attention

TRITON_CALL = "__gpu$xla.gpu.triton"
# The served kernels lower through Triton (see pallas_kernels/kernel_common.py).
DISABLED_CHECKS = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]


@dataclasses.dataclass(frozen=True)
class Served:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    dtype: type
    page_size: int = 16
    pages_per_layer: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096

    def pool(self):
        shape = (self.num_layers * self.pages_per_layer, self.num_kv_heads, self.page_size, self.head_dim)
        return jax.ShapeDtypeStruct(shape, self.dtype)

    def page_table(self):
        return jax.ShapeDtypeStruct((self.max_num_seqs, self.max_model_len // self.page_size), jnp.int32)


SERVED = {
    "smollm2-135m-f32": Served(9, 3, 64, 30, jnp.float32),
    "smollm2-135m-bf16": Served(9, 3, 64, 30, jnp.bfloat16),
    "llama3-8b-bf16": Served(32, 8, 128, 32, jnp.bfloat16, pages_per_layer=512),
}


def lower_for_cuda(fn, *args):
    return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=DISABLED_CHECKS)(*args)


@pytest.mark.parametrize("name", SERVED)
def test_decode_kernel_lowers_for_cuda(name):
    m = SERVED[name]
    q = jax.ShapeDtypeStruct((m.max_num_seqs, m.num_q_heads, m.head_dim), m.dtype)
    kv_lens = jax.ShapeDtypeStruct((m.max_num_seqs,), jnp.int32)
    exported = lower_for_cuda(
        lambda *a: paged_decode_attention(*a, sm_scale=m.head_dim**-0.5, backend="pallas"),
        q, m.pool(), m.pool(), kv_lens, m.page_table(),
    )
    assert exported.platforms == ("cuda",)
    assert exported.mlir_module().count(f"@{TRITON_CALL}(") == 1


@pytest.mark.parametrize("max_q_len", [1, 512])
@pytest.mark.parametrize("name", SERVED)
def test_ragged_kernel_lowers_for_cuda(name, max_q_len):
    m = SERVED[name]
    q = jax.ShapeDtypeStruct((m.max_num_batched_tokens, m.num_q_heads, m.head_dim), m.dtype)
    kv_lens = jax.ShapeDtypeStruct((m.max_num_seqs,), jnp.int32)
    cu_q_lens = jax.ShapeDtypeStruct((m.max_num_seqs + 1,), jnp.int32)
    exported = lower_for_cuda(
        lambda *a: ragged_paged_attention(
            *a, max_q_len=max_q_len, sm_scale=m.head_dim**-0.5, backend="pallas"
        ),
        q, m.pool(), m.pool(), kv_lens, m.page_table(), cu_q_lens,
    )
    assert exported.mlir_module().count(f"@{TRITON_CALL}(") == 1
