"""Every Pallas kernel lowers for the GPU ("cuda") at the served shapes, on any host.

`jax.export` lowers without a GPU, so a kernel using an operation with no GPU lowering rule fails
here on a CPU-only CI machine. Both kernel families lower: Triton (a `__gpu$xla.gpu.triton` custom
call) and Mosaic GPU (`mosaic_gpu_v2`; 16-bit dtypes only). Lowering is not compiling: the backend
compile and the kernels' speed and GPU numerics show only on a GPU (`python -m sluice.bench.gpu_check` runs
them there).
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from sluice.pallas_kernels.attention import paged_decode_attention, ragged_paged_attention
from sluice.pallas_kernels.kv_cache import QuantizedPages

TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CALL = "mosaic_gpu_v2"
KERNEL_CALLS = {"pallas-triton": TRITON_CALL, "pallas-mosaic": MOSAIC_CALL}
# The Triton call is not on export's list of stable custom calls; the Mosaic one is on jax 0.10.2's,
# and accepting it explicitly keeps the test about lowering whatever a later jax's list says.
DISABLED_CHECKS = [jax.export.DisabledSafetyCheck.custom_call(call) for call in KERNEL_CALLS.values()]
# The GPU the kernels are lowered for. Without a GPU here, jax 0.10.2's Triton lowering assumed compute
# capability 9.0; jax 0.11 asks for an abstract device instead ("No supported GPU devices found").
TARGET = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")


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

    def int8_pool(self):
        values = self.pool()
        return QuantizedPages(jax.ShapeDtypeStruct(values.shape, jnp.int8),
                              jax.ShapeDtypeStruct(values.shape[:-1], jnp.float32))

    def page_table(self):
        return jax.ShapeDtypeStruct((self.max_num_seqs, self.max_model_len // self.page_size), jnp.int32)


SERVED = {
    "smollm2-135m-f32": Served(9, 3, 64, 30, jnp.float32),
    "smollm2-135m-bf16": Served(9, 3, 64, 30, jnp.bfloat16),
    "llama3-8b-bf16": Served(32, 8, 128, 32, jnp.bfloat16, pages_per_layer=512),
}


def lower_for_cuda(fn, *args):
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=TARGET)):
        return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=DISABLED_CHECKS)(*args)


def kernel_cases():
    """(backend, model) pairs a kernel family serves: Mosaic GPU takes 16-bit dtypes only."""
    return [
        pytest.param(backend, name, id=f"{backend}-{name}")
        for backend in KERNEL_CALLS
        for name, served in SERVED.items()
        if backend != "pallas-mosaic" or jnp.dtype(served.dtype).itemsize == 2
    ]


@pytest.mark.parametrize("num_seqs", [1, 64])  # 1: split-K over many programs; 64: one program per head
@pytest.mark.parametrize("backend, name", kernel_cases())
def test_decode_kernel_lowers_for_cuda(backend, name, num_seqs):
    m = dataclasses.replace(SERVED[name], max_num_seqs=num_seqs)
    q = jax.ShapeDtypeStruct((m.max_num_seqs, m.num_q_heads, m.head_dim), m.dtype)
    kv_lens = jax.ShapeDtypeStruct((m.max_num_seqs,), jnp.int32)
    exported = lower_for_cuda(
        lambda *a: paged_decode_attention(*a, sm_scale=m.head_dim**-0.5, backend=backend),
        q, m.pool(), m.pool(), kv_lens, m.page_table(),
    )
    assert exported.platforms == ("cuda",)
    assert exported.mlir_module().count(f"@{KERNEL_CALLS[backend]}(") == 1


@pytest.mark.parametrize("num_seqs", [1, 64])  # 1: split-K partials; 64: normalized tiles
@pytest.mark.parametrize("tiling", ["128x2", "64x3", "64x1", "64x2n", "64x1n"])
def test_mosaic_decode_kernel_lowers_for_cuda_at_each_swept_tiling(tiling, num_seqs):
    """`bench.kernels --mosaic-tilings` times these on a GPU: each must lower first. A narrow one ("n") copies
    the GQA group's 4 query rows as one 8-row tile per sequence and head, not 64."""
    from sluice.pallas_kernels.mosaic_attention import Tiling, paged_decode_attention_mosaic

    m = dataclasses.replace(SERVED["llama3-8b-bf16"], max_num_seqs=num_seqs)
    q = jax.ShapeDtypeStruct((m.max_num_seqs, m.num_q_heads, m.head_dim), m.dtype)
    kv_lens = jax.ShapeDtypeStruct((m.max_num_seqs,), jnp.int32)
    exported = lower_for_cuda(
        lambda *a: paged_decode_attention_mosaic(*a, sm_scale=m.head_dim**-0.5, tiling=Tiling.parse(tiling)),
        q, m.pool(), m.pool(), kv_lens, m.page_table(),
    )
    module = exported.mlir_module()
    assert module.count(f"@{MOSAIC_CALL}(") == 1
    q_tile_rows = 8 if tiling.endswith("n") else 64
    assert f"tensor<{num_seqs}x8x1x{q_tile_rows}x128xbf16>" in module


def test_mosaic_refuses_a_kv_block_its_v_mask_cannot_lay_out():
    from sluice.pallas_kernels.mosaic_attention import Tiling, check_shapes

    with pytest.raises(ValueError, match="multiple of 64 tokens"):
        check_shapes(16, 128, jnp.bfloat16, Tiling(block_kv=32, stages=3))


@pytest.mark.parametrize("max_q_len", [1, 16, 512])
@pytest.mark.parametrize("backend, name", kernel_cases())
def test_ragged_kernel_lowers_for_cuda(backend, name, max_q_len):
    m = SERVED[name]
    q = jax.ShapeDtypeStruct((m.max_num_batched_tokens, m.num_q_heads, m.head_dim), m.dtype)
    kv_lens = jax.ShapeDtypeStruct((m.max_num_seqs,), jnp.int32)
    cu_q_lens = jax.ShapeDtypeStruct((m.max_num_seqs + 1,), jnp.int32)
    exported = lower_for_cuda(
        lambda *a: ragged_paged_attention(*a, max_q_len=max_q_len, sm_scale=m.head_dim**-0.5, backend=backend),
        q, m.pool(), m.pool(), kv_lens, m.page_table(), cu_q_lens,
    )
    assert exported.mlir_module().count(f"@{KERNEL_CALLS[backend]}(") == 1


@pytest.mark.parametrize("max_q_len", [1, 16])
@pytest.mark.parametrize("name", ["smollm2-135m-bf16", "llama3-8b-bf16"])
def test_triton_kernels_lower_for_cuda_over_an_int8_kv_cache(name, max_q_len):
    m = SERVED[name]
    q = jax.ShapeDtypeStruct((m.max_num_batched_tokens, m.num_q_heads, m.head_dim), m.dtype)
    kv_lens = jax.ShapeDtypeStruct((m.max_num_seqs,), jnp.int32)
    cu_q_lens = jax.ShapeDtypeStruct((m.max_num_seqs + 1,), jnp.int32)
    exported = lower_for_cuda(
        lambda *a: ragged_paged_attention(*a, max_q_len=max_q_len, sm_scale=m.head_dim**-0.5, backend="pallas-triton"),
        q, m.int8_pool(), m.int8_pool(), kv_lens, m.page_table(), cu_q_lens,
    )
    assert exported.mlir_module().count(f"@{TRITON_CALL}(") == 1


def test_mosaic_kernel_lowering_is_checked_for_real():
    """A Mosaic GPU kernel body with an operation it has no rule for fails to lower, so the tests above
    would catch one in the attention kernels."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def sort_rows(x_ref, o_ref):
        o_ref[...] = jnp.sort(x_ref[...], axis=-1)

    kernel = plgpu.kernel(sort_rows, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32))
    with pytest.raises(NotImplementedError, match="sort"):
        lower_for_cuda(kernel, jax.ShapeDtypeStruct((64, 64), jnp.float32))
