"""Pallas paged attention on Mosaic GPU (Hopper and newer): TMA page copies, warpgroup matrix multiplies.

One kernel body serves decode and ragged (chunked-prefill) steps. A program owns a tile of ROWS = 64 query
rows of one sequence and one kv head - the GQA q heads of block_q consecutive tokens, row = token *
group_rows + head - and walks a range of the sequence's pages in blocks of `Tiling.block_kv` (64) tokens:

- the page copies of the next `Tiling.stages` (2) blocks are in flight while a block is computed: each block's
  pages go by TMA from the pool (`[num_pages, num_kv_heads, page_size, head_dim]`, one contiguous
  `[page_size, head_dim]` tile per page and head) into 128-byte-swizzled shared memory, K and V on
  their own barriers;
- S = Q K^T and the P V update are `wgmma`s (Q and K from shared memory, P from registers), with an
  online softmax in float32 in between;
- with one program per tile (every ragged step, and decode steps whose sequences x kv heads fill the
  GPU) a program normalizes and stores its first `out_rows` rows in q's dtype by TMA from shared memory
  (the Q buffer, free by then); a decode step with few sequences splits each context over several
  programs (flash-decoding), which write unnormalized float32 accumulators with running max and sum for
  `kernel_common.combine_splits`.

Queries are gathered into `[num_seqs, num_kv_heads, num_q_tiles, ROWS, head_dim]` tiles before the
call and the results scattered back after it, in jnp: the kernel then reads and writes whole tiles
with static shapes, whatever the sequences' offsets in the flat token array. A decode tile holds one
token's group (the other rows are padding, and only the group's rows, rounded up to 8, are stored):
the warpgroup MMA has 64 rows, and decode is bound by reading K/V, not by the multiplies. With a narrow
tiling (`Tiling.narrow_q`) only those rounded-up rows are gathered and copied in; the padding is zeroed in
shared memory.

Contract as `attention.py` states it: K/V slots at positions >= kv_len never reach a result, even when
they hold NaN (S is masked with `where`; the V rows of a block that straddles kv_len are zeroed in
shared memory before the P V multiply, since 0 * NaN is NaN), and page-table entries past a sequence's
last page are never dereferenced (they are replaced by page 0). Requirements: a 16-bit dtype (the MMAs
take bf16/f16), head_dim a multiple of 64 (one 128-byte swizzle row) and page_size a multiple of 8 that
divides the block of KV tokens. An int8 KV cache (`kv_cache.QuantizedPages`) is not read here: `attention.py`
refuses it for this backend, naming the ones that read it (the wgmma takes both operands in one type, so K/V
would have to be dequantized into bf16 shared-memory tiles first, which needs a GPU to develop and check).

Checked on jax 0.10.2 and 0.11.2 (CPU): both entry points lower for `platforms=["cuda"]` through
`jax.export` (tests/test_kernel_lowering.py). They cannot run on a CPU: the portable `interpret=True`
has no rules for TMA copies and barriers, and the Mosaic GPU interpreter (`plgpu.InterpretGPUParams`)
fails on 0.10.2 on the transposed K operand of the first MMA with "AttributeError: 'TransposeTransform'
object has no attribute 'indices'", and on 0.11.2 with "NotImplementedError: MLIR translation rule for
primitive 'wgmma' not found for platform cpu" (it has no rule for the warpgroup MMA).
Their numerics and speed are first checked by `python -m sluice.bench.gpu_check` on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from sluice.pallas_kernels import kernel_common as kc

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError as exc:  # pragma: no cover - every jax this project supports has it
    raise ImportError(f"the Mosaic GPU attention needs jax.experimental.pallas.mosaic_gpu ({exc})") from exc

ROWS = 64
SWIZZLE_BYTES = 128
# Rows of a shared-memory tile, so the granularity of a stored slice of rows.
TILE_ROWS = 8
# wgmma and the TMA unit arrived with Hopper (sm_90).
MIN_COMPUTE_CAPABILITY = 9.0


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How a program walks its pages: block_kv tokens per step, `stages` blocks in flight; and, for decode,
    whether the query tile is copied narrow: only the GQA group's rows, rounded up to TILE_ROWS, go through
    device memory and the rest of the 64-row MMA tile is zeroed in shared memory (a 64-row pad of every
    sequence's q is 134 MB per layer at 1,024 sequences of Llama-3-8B; narrow, 17).

    The default's two stages keep a program under half of an SM's shared memory (Q 16 KiB + K/V 2 x 32 KiB at
    head_dim 128), so two programs share an SM and overlap each other's waits. `bench.kernels --mosaic-tilings`
    times others.
    """

    block_kv: int = 64
    stages: int = 2
    narrow_q: bool = False

    @classmethod
    def parse(cls, text: str) -> Tiling:
        """"64x2" -> Tiling(block_kv=64, stages=2); "64x2n" -> the same with narrow_q."""
        narrow_q = text.endswith("n")
        block_kv, stages = (int(part) for part in text.removesuffix("n").split("x"))
        return cls(block_kv, stages, narrow_q)

    def __str__(self) -> str:
        return f"{self.block_kv}x{self.stages}{'n' if self.narrow_q else ''}"


DEFAULT_TILING = Tiling()


def runs_on(device: jax.Device) -> bool:
    """Whether these kernels can run on `device`: an NVIDIA GPU of compute capability 9.0 or newer."""
    capability = getattr(device, "compute_capability", None)
    return device.platform == "gpu" and capability is not None and float(capability) >= MIN_COMPUTE_CAPABILITY


def check_shapes(page_size: int, head_dim: int, dtype, tiling: Tiling = DEFAULT_TILING) -> None:
    """Raises ValueError for shapes this kernel cannot tile (see the module docstring)."""
    if jnp.dtype(dtype).itemsize != 2:
        raise ValueError(f"the Mosaic GPU kernels need a 16-bit dtype (bfloat16/float16), got {jnp.dtype(dtype)}")
    if head_dim % 64:
        raise ValueError(f"the Mosaic GPU kernels need head_dim a multiple of 64, got {head_dim}")
    if tiling.block_kv % ROWS or tiling.stages < 1:
        raise ValueError(f"the Mosaic GPU kernels need a KV block of a multiple of {ROWS} tokens (the warpgroup "
                         f"layout of the V rows it masks) and a stage or more, got {tiling}")
    if page_size % 8 or tiling.block_kv % page_size:
        raise ValueError(f"the Mosaic GPU kernels need a page_size that is a multiple of 8 dividing "
                         f"{tiling.block_kv}, got {page_size}")


def _smem_tile(shape: tuple[int, ...], dtype):
    """A shared-memory buffer laid out for TMA and wgmma: 8-row tiles of one 128-byte swizzle row."""
    elems = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((TILE_ROWS, elems)), plgpu.SwizzleTransform(SWIZZLE_BYTES))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _attend_kernel(
    kv_lens_ref, q_lens_ref, page_table_ref, q_ref, k_ref, v_ref, *refs,
    sm_scale: float, page_size: int, block_q: int, group_rows: int, num_splits: int, blocks_per_split: int,
    out_rows: int | None, tiling: Tiling,
):
    """Outputs: `out` when out_rows is set (normalized), else `acc, m, l` (partials); then the scratch."""
    outs, (q_smem, k_smem, v_smem, q_barrier, k_barriers, v_barriers) = refs[:-6], refs[-6:]
    seq, head, part = lax.axis_index("seq"), lax.axis_index("head"), lax.axis_index("part")
    q_tile, split = lax.div(part, num_splits), lax.rem(part, num_splits)
    block_kv, stages = tiling.block_kv, tiling.stages
    pages_per_block = block_kv // page_size
    kv_len, q_len = kv_lens_ref[seq], q_lens_ref[seq]
    first_token = q_tile * block_q
    # Tokens of this tile attend kv positions < kv_end (causal); a tile past q_len attends nothing.
    last_token = jnp.minimum(q_len, first_token + block_q) - 1
    kv_end = jnp.where(first_token < q_len, kv_len - q_len + last_token + 1, 0)
    num_blocks = lax.div(kv_end + block_kv - 1, block_kv)
    first_block = split * blocks_per_split
    num_steps = jnp.maximum(jnp.minimum(first_block + blocks_per_split, num_blocks) - first_block, 0)
    num_used_pages = lax.div(kv_len + page_size - 1, page_size)

    def fetch(step, slot):
        for j in range(pages_per_block):
            index = (first_block + step) * pages_per_block + j
            page = jnp.where(index < num_used_pages, page_table_ref[seq, index], 0)
            rows = pl.ds(j * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_ref.at[page, head], k_smem.at[slot, rows], k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[page, head], v_smem.at[slot, rows], v_barriers.at[slot])

    q_rows = q_ref.shape[3]
    if q_rows < ROWS:  # a narrow query tile: the MMA's other rows are zeros (finite scores, results dropped)
        q_smem[...] = plgpu.layout_cast(jnp.zeros(q_smem.shape, q_smem.dtype), plgpu.Layout.WGMMA)
        plgpu.commit_smem()  # the zeros land before the copy into the first rows does
    plgpu.copy_gmem_to_smem(q_ref.at[seq, head, q_tile], q_smem.at[pl.ds(0, q_rows)], q_barrier)
    for stage in range(stages):
        pl.when(stage < num_steps)(functools.partial(fetch, stage, stage))
    plgpu.barrier_wait(q_barrier)

    row = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 0, layout=plgpu.Layout.WGMMA)
    column = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)
    q_pos = kv_len - q_len + first_token + lax.shift_right_logical(row, int(math.log2(group_rows)))

    def step(i, carry):
        acc, m, l = carry
        slot = lax.rem(i, stages)
        block_start = (first_block + i) * block_kv
        plgpu.barrier_wait(k_barriers.at[slot])

        def scores(s_ref):
            plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].T)
            return s_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((ROWS, block_kv), jnp.float32)) * sm_scale
        kv_pos = block_start + column
        visible = (kv_pos <= q_pos) & (kv_pos < kv_len)
        s = jnp.where(visible, s, kc.MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(visible, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
        l = alpha * l + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        plgpu.barrier_wait(v_barriers.at[slot])

        @pl.when(block_start + block_kv > kv_len)
        def _zero_v_past_kv_len():
            v_rows = plgpu.broadcasted_iota(jnp.int32, (block_kv, v_smem.shape[-1]), 0, layout=plgpu.Layout.WGMMA)
            v = v_smem.at[slot][...]  # a tiled, swizzled tile loads in the WGMMA layout
            v_smem.at[slot][...] = jnp.where(block_start + v_rows < kv_len, v, jnp.zeros_like(v))
            plgpu.commit_smem()

        def weighted_values(acc_ref):
            plgpu.wgmma(acc_ref, p.astype(v_smem.dtype), v_smem.at[slot])

        acc = pl.run_state(weighted_values)(plgpu.ACC.init(acc))
        # The MMAs reading this slot are done (run_state waits for them): refill it.
        pl.when(i + stages < num_steps)(lambda: fetch(i + stages, slot))
        return acc, m_new, l

    head_dim = q_smem.shape[-1]
    init = (
        plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((ROWS,), kc.MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )
    acc, m, l = lax.fori_loop(0, num_steps, step, init)
    if out_rows is None:
        acc_ref, m_ref, l_ref = outs
        acc_ref[split, seq, head, q_tile] = acc
        m_ref[split, seq, head, q_tile] = m
        l_ref[split, seq, head, q_tile] = l
        return
    (out_ref,) = outs
    # Rows that saw no context (l = 0) come out as zeros.
    out = acc / lax.broadcast_in_dim(jnp.where(l > 0, l, 1.0), acc.shape, [0])
    q_smem[...] = out.astype(q_smem.dtype)  # the scores MMAs that read Q are done
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem.at[pl.ds(0, out_rows)], out_ref.at[seq, head, q_tile])
    plgpu.wait_smem_to_gmem(0)


def _attend_tiles(
    q_tiles: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array, q_lens: jax.Array,
    page_table: jax.Array, *, sm_scale: float, block_q: int, group_rows: int, num_splits: int,
    out_rows: int | None, tiling: Tiling = DEFAULT_TILING,
) -> tuple[jax.Array, ...]:
    """q_tiles: [num_seqs, num_kv_heads, num_q_tiles, q_rows, head_dim], q_rows ROWS or (a narrow tile, decode's)
    a multiple of TILE_ROWS below it; row r of tile t of sequence s is token t * block_q + r // group_rows of its
    q_len (at position kv_len - q_len + token).
    page_table: [num_seqs, pages] int32, pages a multiple of tiling.block_kv // page_size.

    With out_rows (num_splits 1): (out [num_seqs, num_kv_heads, num_q_tiles, out_rows, head_dim] in q's
    dtype, normalized, each tile's first out_rows rows). Without: (acc [num_splits, num_seqs,
    num_kv_heads, num_q_tiles, ROWS, head_dim] f32 unnormalized, m, l [num_splits, num_seqs, num_kv_heads,
    num_q_tiles, ROWS] f32 running max and sum).
    """
    num_seqs, num_kv_heads, num_q_tiles, q_rows, head_dim = q_tiles.shape
    page_size = k_pages.shape[2]
    check_shapes(page_size, head_dim, k_pages.dtype, tiling)
    if q_rows % TILE_ROWS or not 0 < q_rows <= ROWS:
        raise ValueError(f"a query tile has a multiple of {TILE_ROWS} rows up to {ROWS}, got {q_rows}")
    max_blocks = page_table.shape[1] * page_size // tiling.block_kv
    if out_rows is None:
        stats = (num_splits, num_seqs, num_kv_heads, num_q_tiles, ROWS)
        out_type = (
            jax.ShapeDtypeStruct((*stats, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(stats, jnp.float32),
            jax.ShapeDtypeStruct(stats, jnp.float32),
        )
    else:
        if num_splits != 1 or out_rows % TILE_ROWS or not 0 < out_rows <= ROWS:
            raise ValueError(f"normalized output needs one split and out_rows a multiple of {TILE_ROWS} up to {ROWS}")
        out_type = (jax.ShapeDtypeStruct((num_seqs, num_kv_heads, num_q_tiles, out_rows, head_dim), q_tiles.dtype),)
    kernel = functools.partial(
        _attend_kernel, sm_scale=sm_scale, page_size=page_size, block_q=block_q, group_rows=group_rows,
        num_splits=num_splits, blocks_per_split=pl.cdiv(max_blocks, num_splits), out_rows=out_rows, tiling=tiling,
    )
    kv_tile, pages_per_block = (tiling.stages, tiling.block_kv, head_dim), tiling.block_kv // page_size
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=(
            _smem_tile((ROWS, head_dim), q_tiles.dtype),
            _smem_tile(kv_tile, k_pages.dtype),
            _smem_tile(kv_tile, v_pages.dtype),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=tiling.stages),
            plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=tiling.stages),
        ),
        grid=(num_seqs, num_kv_heads, num_q_tiles * num_splits),
        grid_names=("seq", "head", "part"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(kv_lens.astype(jnp.int32), q_lens.astype(jnp.int32), page_table.astype(jnp.int32), q_tiles, k_pages, v_pages)


def _pad_page_table(page_table: jax.Array, page_size: int, block_kv: int) -> jax.Array:
    pages_per_block = block_kv // page_size
    padded = pl.cdiv(page_table.shape[1], pages_per_block) * pages_per_block
    return jnp.pad(page_table, ((0, 0), (0, padded - page_table.shape[1])))


@functools.partial(jax.jit, static_argnames=("sm_scale", "num_splits", "tiling"))
def paged_decode_attention_mosaic(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    *,
    sm_scale: float,
    num_splits: int | None = None,
    tiling: Tiling = DEFAULT_TILING,
) -> jax.Array:
    """q: [num_seqs, num_q_heads, head_dim]; k_pages, v_pages: [num_pages, num_kv_heads, page_size,
    head_dim]; kv_lens: [num_seqs] int32; page_table: [num_seqs, max_pages_per_seq] int32.
    Returns [num_seqs, num_q_heads, head_dim] in q's dtype; rows with kv_len 0 are zeros.
    num_splits: split-K factor, chosen from the shapes when None.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    if group > ROWS:
        raise ValueError(f"a GQA group of {group} q heads does not fit a {ROWS}-row tile")
    check_shapes(page_size, head_dim, q.dtype, tiling)
    page_table = _pad_page_table(page_table, page_size, tiling.block_kv)
    max_blocks = page_table.shape[1] * page_size // tiling.block_kv
    if num_splits is None:
        num_splits = kc.num_splits_for(num_seqs, num_kv_heads, max_blocks)
    num_splits = pl.cdiv(max_blocks, pl.cdiv(max_blocks, num_splits))

    group_tile_rows = pl.cdiv(group, TILE_ROWS) * TILE_ROWS
    q_tiles = q.reshape(num_seqs, num_kv_heads, 1, group, head_dim)
    q_rows = group_tile_rows if tiling.narrow_q else ROWS
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, 0), (0, q_rows - group), (0, 0)))
    # Every row is the sequence's one token (block_q 1, group_rows ROWS): padding rows see its context.
    attend = functools.partial(
        _attend_tiles, q_tiles, k_pages, v_pages, kv_lens, (kv_lens > 0).astype(jnp.int32), page_table,
        sm_scale=sm_scale, block_q=1, group_rows=ROWS, num_splits=num_splits, tiling=tiling,
    )
    if num_splits == 1:
        (out,) = attend(out_rows=group_tile_rows)
    else:
        out = kc.combine_splits(*attend(out_rows=None))
    return out[:, :, 0, :group].reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)


def tile_shape(group: int) -> tuple[int, int]:
    """(block_q tokens, group_rows heads per token) of a ROWS-row query tile, both powers of 2."""
    group_rows = kc.next_power_of_2(group)
    return ROWS // group_rows, group_rows


@functools.partial(jax.jit, static_argnames=("max_q_len", "sm_scale"))
def ragged_paged_attention_mosaic(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    *,
    max_q_len: int,
    sm_scale: float,
) -> jax.Array:
    """q: [num_tokens, num_q_heads, head_dim]; k_pages, v_pages: [num_pages, num_kv_heads, page_size,
    head_dim]; kv_lens: [num_seqs] int32; page_table: [num_seqs, max_pages_per_seq] int32; cu_q_lens:
    [num_seqs + 1] int32. Returns [num_tokens, num_q_heads, head_dim] in q's dtype; rows at or past
    cu_q_lens[-1] are zeros. Semantics as `attention.ragged_paged_attention`.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_pages.shape
    num_seqs = kv_lens.shape[0]
    group = num_q_heads // num_kv_heads
    if group > ROWS:
        raise ValueError(f"a GQA group of {group} q heads does not fit a {ROWS}-row tile")
    check_shapes(page_size, head_dim, q.dtype)
    block_q, group_rows = tile_shape(group)
    num_q_tiles = pl.cdiv(max_q_len, block_q)
    q_starts = cu_q_lens[:-1].astype(jnp.int32)
    q_lens = cu_q_lens[1:].astype(jnp.int32) - q_starts

    # Token i of tile t of sequence s: row q_starts[s] + t * block_q + i of q, when below q_len.
    local = jnp.arange(num_q_tiles * block_q, dtype=jnp.int32).reshape(num_q_tiles, block_q)
    owned = local[None] < q_lens[:, None, None]  # [num_seqs, num_q_tiles, block_q]
    rows = jnp.where(owned, q_starts[:, None, None] + local[None], num_tokens)
    gathered = jnp.take(q, rows, axis=0, mode="fill", fill_value=0)  # [S, tiles, block_q, Hq, D]
    gathered = gathered.reshape(num_seqs, num_q_tiles, block_q, num_kv_heads, group, head_dim)
    gathered = jnp.pad(gathered, ((0, 0),) * 4 + ((0, group_rows - group), (0, 0)))
    q_tiles = gathered.transpose(0, 3, 1, 2, 4, 5).reshape(num_seqs, num_kv_heads, num_q_tiles, ROWS, head_dim)

    (out,) = _attend_tiles(
        q_tiles, k_pages, v_pages, kv_lens, q_lens, _pad_page_table(page_table, page_size, DEFAULT_TILING.block_kv),
        sm_scale=sm_scale, block_q=block_q, group_rows=group_rows, num_splits=1, out_rows=ROWS,
    )  # [S, Hkv, tiles, ROWS, D]
    out = out.reshape(num_seqs, num_kv_heads, num_q_tiles, block_q, group_rows, head_dim)
    # Each token's rows gathered from its tile: only the real rows are read, not every tile's padding.
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:].astype(jnp.int32), token, side="right",
                           method="compare_all")  # num_seqs: past the last
    local = token - q_starts[jnp.minimum(seq, num_seqs - 1)]
    taken = out.at[seq, :, local // block_q, local % block_q, :group].get(mode="fill", fill_value=0)
    return taken.reshape(num_tokens, num_q_heads, head_dim)
