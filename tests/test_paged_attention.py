"""Paged attention (decode and ragged) against a float64 NumPy oracle, on every backend.

On a CPU the Triton kernels run with interpret=True and the Mosaic GPU kernels are skipped (they have
no interpret mode; tests/test_kernel_lowering.py lowers them for "cuda"). On a GPU every kernel runs
compiled - `python -m sluice.bench.gpu_check` runs this file there. The Mosaic kernels take 16-bit inputs, so
they run the float32 cases in bfloat16 (inputs cast, tolerance of bfloat16). Interpret mode allocates
kernel outputs filled with NaN (jax's `uninitialized_value`; `test_interpret_mode_poisons_kernel_outputs`
pins that), so a row a kernel forgets to write comes back NaN and fails. Every case draws fresh random inputs (never
zeros) and poisons what must not be read: pool pages no sequence owns and slots past each
sequence's kv_len hold NaN, and page-table entries past a sequence's last page hold garbage (ids of
NaN pages, ids past the pool, negative ids).

Cases cover page sizes 8/16/32 (and 1/64 for the CPU kernel), head dims 64/128, GQA ratios 1/3/4/8, batches
1..20, contexts of 1, a page boundary, boundary + 1 and the maximum, float32 and bfloat16 - pairwise, not the
full product, to keep the interpret-mode suite short.

An int8 KV cache (`kv_cache.QuantizedPages`) is quantized here in NumPy from the float pool, poison included (a
NaN row gets a NaN scale and random values); each backend must read exactly its dequantized values, and so land
within the bound the quantization step puts on attention's error against the float pool's oracle.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from sluice.pallas_kernels import cpu_attention, mosaic_attention
from sluice.pallas_kernels.attention import INT8_KV_KERNELS, paged_decode_attention, ragged_paged_attention, resolve_backend
from sluice.pallas_kernels.cpu_attention import ragged_paged_attention_cpu
from sluice.pallas_kernels.kv_cache import QuantizedPages
from sluice.pallas_kernels.mosaic_attention import paged_decode_attention_mosaic, runs_on
from sluice.pallas_kernels.triton_decode import paged_decode_attention_triton

TOLERANCE = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=1e-2, atol=1e-2)}
ON_GPU = jax.default_backend() == "gpu"
BACKEND_IDS = ["reference", "cpu", "pallas-triton", "pallas-mosaic"]
needs_gpu = pytest.mark.skipif(
    not runs_on(jax.devices()[0]),
    reason="the Mosaic GPU kernels run only on a GPU of compute capability 9.0+ (lowering: test_kernel_lowering.py)",
)


def backend_kwargs(name: str) -> dict:
    """How a test calls `name`: compiled on a GPU, interpreted (Triton) on a CPU."""
    return dict(backend=name, interpret=name == "pallas-triton" and not ON_GPU)


needs_cpu_kernel = pytest.mark.skipif(not cpu_attention.available(), reason="the C++ CPU kernel could not be built")
MARKS = {"pallas-mosaic": needs_gpu, "cpu": needs_cpu_kernel}
BACKENDS = [pytest.param(name, marks=MARKS.get(name, ())) for name in BACKEND_IDS]


@dataclasses.dataclass(frozen=True)
class Shapes:
    page_size: int
    head_dim: int
    group: int  # q heads per kv head
    num_kv_heads: int
    max_pages: int  # page-table columns per sequence
    dtype: type

    @property
    def max_context(self) -> int:
        return self.max_pages * self.page_size


@dataclasses.dataclass
class Batch:
    q: np.ndarray  # [num_tokens or num_seqs, num_q_heads, head_dim]
    k_pages: np.ndarray  # [num_pages, num_kv_heads, page_size, head_dim]
    v_pages: np.ndarray
    kv_lens: np.ndarray  # [num_seqs] int32
    page_table: np.ndarray  # [num_seqs, max_pages] int32
    cu_q_lens: np.ndarray  # [num_seqs + 1] int32

    def device_args(self):
        return tuple(jnp.asarray(a) for a in (self.q, self.k_pages, self.v_pages, self.kv_lens, self.page_table))


def make_batch(shapes: Shapes, q_lens, kv_lens, *, seed: int, extra_rows: int = 0) -> Batch:
    """Random pool, page tables and queries; q has sum(q_lens) + extra_rows rows."""
    rng = np.random.default_rng(seed)
    ps, d, kh = shapes.page_size, shapes.head_dim, shapes.num_kv_heads
    q_lens, kv_lens = np.asarray(q_lens, np.int32), np.asarray(kv_lens, np.int32)
    pages_used = -(-kv_lens // ps)
    num_poison_pages = 4
    num_pages = int(pages_used.sum()) + num_poison_pages
    owner = rng.permutation(num_pages)

    def pool():
        x = rng.standard_normal((num_pages, kh, ps, d)).astype(np.float32)
        x = np.array(jnp.asarray(x, shapes.dtype).astype(jnp.float32))  # values the dtype can hold
        x[owner[int(pages_used.sum()):]] = np.nan
        return x

    k_pages, v_pages = pool(), pool()
    poison_ids = owner[int(pages_used.sum()):]
    garbage = np.concatenate([poison_ids, [num_pages, num_pages + 12345, -3, 2**31 - 1]])
    page_table = rng.choice(garbage, size=(len(kv_lens), shapes.max_pages)).astype(np.int32)
    next_page = 0
    for s, (n, kv) in enumerate(zip(pages_used, kv_lens)):
        ids = owner[next_page:next_page + n]
        next_page += n
        page_table[s, :n] = ids
        if kv % ps:
            k_pages[ids[-1], :, kv % ps:] = np.nan
            v_pages[ids[-1], :, kv % ps:] = np.nan

    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_q_heads = kh * shapes.group
    q = rng.standard_normal((int(cu_q_lens[-1]) + extra_rows, num_q_heads, d)).astype(np.float32)
    cast = lambda x: np.asarray(jnp.asarray(x, shapes.dtype))
    return Batch(cast(q), cast(k_pages), cast(v_pages), kv_lens, page_table, cu_q_lens)


def oracle(batch: Batch, sm_scale: float) -> np.ndarray:
    """float64 ragged paged attention, token by token through the page table."""
    q = batch.q.astype(np.float64)
    num_pages, kh, ps, d = batch.k_pages.shape
    group = q.shape[1] // kh
    out = np.zeros(q.shape)
    for s, kv_len in enumerate(batch.kv_lens):
        start, end = batch.cu_q_lens[s], batch.cu_q_lens[s + 1]
        if end == start:
            continue
        pos = np.arange(kv_len)
        pages = batch.page_table[s, pos // ps]
        k = batch.k_pages[pages, :, pos % ps].astype(np.float64)  # [kv_len, kv_heads, head_dim]
        v = batch.v_pages[pages, :, pos % ps].astype(np.float64)
        qs = q[start:end].reshape(end - start, kh, group, d)
        logits = np.einsum("qkgd,tkd->qkgt", qs, k) * sm_scale
        q_pos = kv_len - (end - start) + np.arange(end - start)
        logits = np.where(pos[None, :] <= q_pos[:, None], 0.0, -np.inf)[:, None, None] + logits
        w = np.exp(logits - logits.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
        out[start:end] = np.einsum("qkgt,tkd->qkgd", w, v).reshape(end - start, kh * group, d)
    return out


def decode_oracle(batch: Batch, sm_scale: float) -> np.ndarray:
    """One query per sequence at kv_len - 1: the ragged oracle with q_len 1 (0 where kv_len is 0)."""
    q_lens = (batch.kv_lens > 0).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    ragged = dataclasses.replace(batch, q=batch.q[q_lens > 0], cu_q_lens=cu)
    out = np.zeros(batch.q.shape)
    out[q_lens > 0] = oracle(ragged, sm_scale)
    return out


def assert_matches(out, expected, dtype):
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all(), "output has NaN/inf rows"
    np.testing.assert_allclose(out, expected, **TOLERANCE[dtype])


def contexts(shapes: Shapes, n: int, rng) -> np.ndarray:
    """n context lengths cycling through 1, a page boundary, boundary + 1, the maximum, random."""
    ps, mx = shapes.page_size, shapes.max_context
    special = [1, ps, ps + 1, mx, 2 * ps, mx - 1]
    return np.array([special[i] if i < len(special) else rng.integers(1, mx + 1) for i in range(n)], np.int32)


DECODE_CASES = [
    # (shapes, num_seqs): batch 1 with a long context exercises split-K.
    (Shapes(8, 64, 1, 2, 64, jnp.float32), 1),
    (Shapes(16, 128, 4, 2, 6, jnp.bfloat16), 16),
    (Shapes(32, 64, 3, 3, 4, jnp.float32), 5),
    (Shapes(8, 128, 8, 1, 5, jnp.float32), 20),
    (Shapes(16, 64, 3, 1, 3, jnp.bfloat16), 1),
    (Shapes(32, 128, 1, 4, 3, jnp.bfloat16), 8),
]


def as_run_by(shapes: Shapes, backend: str) -> Shapes:
    """The shapes a backend is tested at: the Mosaic kernels take 16-bit inputs."""
    return dataclasses.replace(shapes, dtype=jnp.bfloat16) if backend == "pallas-mosaic" else shapes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_decode_matches_float64_oracle(case, backend):
    shapes, num_seqs = DECODE_CASES[case]
    shapes = as_run_by(shapes, backend)
    rng = np.random.default_rng(100 + case)
    kv_lens = contexts(shapes, num_seqs, rng) if num_seqs > 1 else [shapes.max_context if case == 0 else 1]
    batch = make_batch(shapes, np.ones(num_seqs), kv_lens, seed=case)
    sm_scale = shapes.head_dim**-0.5
    out = paged_decode_attention(*batch.device_args(), sm_scale=sm_scale, **backend_kwargs(backend))
    assert out.dtype == shapes.dtype
    assert_matches(out, decode_oracle(batch, sm_scale), shapes.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_gives_zeros_for_sequences_without_context(backend):
    shapes = as_run_by(Shapes(16, 64, 4, 2, 4, jnp.float32), backend)
    batch = make_batch(shapes, [1, 1, 1], [0, 17, 0], seed=7)
    out = paged_decode_attention(*batch.device_args(), sm_scale=0.125, **backend_kwargs(backend))
    assert_matches(out, decode_oracle(batch, 0.125), shapes.dtype)
    assert not np.asarray(out.astype(jnp.float32))[[0, 2]].any()


SPLIT_KERNELS = {
    "pallas-triton": functools.partial(paged_decode_attention_triton, interpret=not ON_GPU),
    "pallas-mosaic": paged_decode_attention_mosaic,
}


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] in SPLIT_KERNELS])
def test_decode_split_count_does_not_change_the_result(backend):
    shapes = as_run_by(Shapes(8, 64, 4, 2, 32, jnp.float32), backend)
    batch = make_batch(shapes, [1, 1, 1], [256, 9, 1], seed=11)
    run = functools.partial(SPLIT_KERNELS[backend], *batch.device_args(), sm_scale=0.125)
    # Up to 7 splits of 32 pages in blocks of 64 tokens: short sequences leave most splits empty.
    one, seven = run(num_splits=1), run(num_splits=7)
    assert_matches(seven, decode_oracle(batch, 0.125), shapes.dtype)
    np.testing.assert_allclose(
        np.asarray(one.astype(jnp.float32)), np.asarray(seven.astype(jnp.float32)), **TOLERANCE[shapes.dtype]
    )


@needs_gpu
@pytest.mark.parametrize("tiling", ["64x1", "64x2n", "64x1n"])
@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mosaic_decode_tilings_match_the_oracle(tiling, num_splits, group):
    """Every tiling `bench.kernels --mosaic-tilings` times, right before it can become the default: normalized
    tiles (one split) and partials (several), wide and narrow query tiles (the narrow one's padding rows zeroed in
    shared memory), at GQA groups of 1, 4 (Llama-3-8B's) and 8 (a narrow tile with no padding row)."""
    shapes = Shapes(16, 128, group, 2, 24, jnp.bfloat16)
    batch = make_batch(shapes, [1, 1, 1, 1], [384, 65, 1, 0], seed=group)
    out = paged_decode_attention_mosaic(*batch.device_args(), sm_scale=0.125, num_splits=num_splits,
                                        tiling=mosaic_attention.Tiling.parse(tiling))
    assert_matches(out, decode_oracle(batch, 0.125), shapes.dtype)


RAGGED_CASES = [
    # (shapes, [(q_len, kv_len), ...], padding rows after the last sequence)
    (Shapes(8, 64, 1, 2, 6, jnp.float32), [(1, 1), (7, 7), (0, 0), (16, 40), (1, 8), (3, 9), (5, 48)], 3),
    (Shapes(16, 128, 4, 2, 4, jnp.bfloat16), [(33, 33), (1, 17), (1, 16), (12, 64), (0, 0)], 0),
    (Shapes(8, 128, 8, 1, 8, jnp.bfloat16), [(24, 30), (1, 1), (2, 64)], 5),
    (Shapes(32, 64, 3, 3, 3, jnp.float32), "mixed-17", 2),
]


def mixed_batch(shapes: Shapes, num_seqs: int, rng) -> list[tuple[int, int]]:
    """Decode rows and prefill chunks (with and without cached context) in random order."""
    pairs = []
    for kv in contexts(shapes, num_seqs, rng):
        q = 1 if rng.random() < 0.5 else int(rng.integers(2, min(kv, 20) + 1)) if kv > 1 else 1
        pairs.append((q, int(kv)))
    return pairs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(RAGGED_CASES)))
def test_ragged_matches_float64_oracle(case, backend):
    shapes, pairs, extra_rows = RAGGED_CASES[case]
    shapes = as_run_by(shapes, backend)
    if isinstance(pairs, str):
        pairs = mixed_batch(shapes, 17, np.random.default_rng(200 + case))
    q_lens, kv_lens = zip(*pairs)
    batch = make_batch(shapes, q_lens, kv_lens, seed=50 + case, extra_rows=extra_rows)
    sm_scale = shapes.head_dim**-0.5
    out = ragged_paged_attention(
        *batch.device_args(), jnp.asarray(batch.cu_q_lens), max_q_len=max(q_lens), sm_scale=sm_scale,
        **backend_kwargs(backend),
    )
    assert out.dtype == shapes.dtype
    assert_matches(out, oracle(batch, sm_scale), shapes.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_only_ragged_step_matches_oracle(backend):
    shapes = as_run_by(Shapes(16, 64, 3, 3, 5, jnp.float32), backend)
    rng = np.random.default_rng(3)
    kv_lens = contexts(shapes, 18, rng)
    q_lens = np.ones(18, np.int32)
    q_lens[[4, 9]], kv_lens[[4, 9]] = 0, 0  # padding sequences between real ones
    batch = make_batch(shapes, q_lens, kv_lens, seed=3, extra_rows=4)
    out = ragged_paged_attention(
        *batch.device_args(), jnp.asarray(batch.cu_q_lens), max_q_len=1, sm_scale=0.125, **backend_kwargs(backend)
    )
    assert_matches(out, oracle(batch, 0.125), shapes.dtype)


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] != "reference"])
def test_decode_kernel_matches_jax_shipped_paged_attention(backend):
    # Deprecated from jax 0.11 (Triton ops): a jax without it skips this comparison, not the file.
    shipped = pytest.importorskip("jax.experimental.pallas.ops.gpu.paged_attention")
    # The shipped kernel reads every page-table entry and unmasked V, so it gets clean inputs. Its float32
    # dots run as TF32 on a GPU, so there the comparison is in bfloat16.
    shapes = as_run_by(Shapes(16, 64, 4, 2, 8, jnp.bfloat16 if ON_GPU else jnp.float32), backend)
    kv_lens = [1, 16, 17, 128]
    batch = make_batch(shapes, np.ones(4), kv_lens, seed=5)
    k_pages = np.nan_to_num(batch.k_pages)
    v_pages = np.nan_to_num(batch.v_pages)
    page_table = np.where(batch.page_table >= 0, batch.page_table, 0) % k_pages.shape[0]
    q = jnp.asarray(batch.q)
    theirs = shipped.paged_attention(
        q * shapes.head_dim**-0.5,  # it applies no softmax scale
        jnp.asarray(k_pages.transpose(1, 0, 2, 3)), jnp.asarray(v_pages.transpose(1, 0, 2, 3)),
        jnp.asarray(page_table), jnp.asarray(batch.kv_lens),
        pages_per_compute_block=4, k_splits=2, interpret=not ON_GPU,
    )
    ours = paged_decode_attention(
        q, jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(batch.kv_lens), jnp.asarray(page_table),
        sm_scale=shapes.head_dim**-0.5, **backend_kwargs(backend),
    )
    # On an H200 in bfloat16 the shipped kernel returned NaN rows for the short sequences (bench/RESULTS.md,
    # 2026-11-26): where it does, the fault is its own if ours matches the float64 oracle there, as everywhere.
    clean = dataclasses.replace(batch, k_pages=k_pages, v_pages=v_pages, page_table=page_table)
    assert_matches(ours, decode_oracle(clean, shapes.head_dim**-0.5), shapes.dtype)
    theirs = np.asarray(theirs.astype(jnp.float32))
    finite = np.isfinite(theirs).all(axis=(1, 2))
    assert finite[np.argmax(kv_lens)], "the shipped kernel fails on the longest sequence, which both split"
    np.testing.assert_allclose(np.asarray(ours.astype(jnp.float32))[finite], theirs[finite], **TOLERANCE[shapes.dtype])


def quantize_pool(pages: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    """The int8 form of a float pool [..., head_dim], per row: (values int8, scales float32 [...]). A row holding
    NaN (poison) gets a NaN scale and random values."""
    finite = np.nan_to_num(pages.astype(np.float32))
    scales = (np.abs(finite).max(-1) / 127).astype(np.float32)
    values = np.round(finite / np.where(scales > 0, scales, 1)[..., None]).astype(np.int8)
    poison = np.isnan(pages).any(-1)
    values[poison] = rng.integers(-128, 128, values[poison].shape)
    return values, np.where(poison, np.nan, scales).astype(np.float32)


def int8_pools(batch: Batch, seed: int) -> tuple[QuantizedPages, QuantizedPages, Batch]:
    """The batch's K and V pools in int8 (device arrays), and the batch with the pools they read back as."""
    rng = np.random.default_rng(seed)
    (kv, ks), (vv, vs) = quantize_pool(batch.k_pages, rng), quantize_pool(batch.v_pages, rng)
    dequantized = dataclasses.replace(batch, k_pages=kv * ks[..., None].astype(np.float64),
                                      v_pages=vv * vs[..., None].astype(np.float64))
    device = lambda v, s: QuantizedPages(jnp.asarray(v), jnp.asarray(s))
    return device(kv, ks), device(vv, vs), dequantized


def quantization_bound(batch: Batch, k_scales: np.ndarray, v_scales: np.ndarray, sm_scale: float) -> np.ndarray:
    """How far int8 K/V (scales [num_pages, num_kv_heads, page_size]) can move each output element from the float
    pool's: [num_tokens, num_q_heads, 1].

    Each element of a K row is off by at most its step, scale / 2, so a score by at most E = sm_scale * |q|_1 *
    max scale_k / 2; the softmax weights then move by at most a factor e^(+-2E), so the weighted sum of V by
    (e^(2E) - 1) * max |v|; and V itself is off by at most max scale_v / 2. Maxima over the context, per kv head.
    """
    ps = batch.k_pages.shape[2]
    group = batch.q.shape[1] // batch.k_pages.shape[1]
    bound = np.zeros(batch.q.shape[:2] + (1,))
    for s, kv_len in enumerate(batch.kv_lens):
        start, end = batch.cu_q_lens[s], batch.cu_q_lens[s + 1]
        if end == start:
            continue
        pos = np.arange(kv_len)
        pages, slots = batch.page_table[s, pos // ps], pos % ps
        per_q_head = lambda x: np.repeat(x, group)  # [num_kv_heads] -> [num_q_heads]
        k_step = per_q_head(k_scales[pages, :, slots].max(0) / 2)
        v_step = per_q_head(v_scales[pages, :, slots].max(0) / 2)
        v_max = per_q_head(np.abs(batch.v_pages[pages, :, slots].astype(np.float64)).max((0, 2)))
        e = sm_scale * np.abs(batch.q[start:end].astype(np.float64)).sum(-1) * k_step
        bound[start:end, :, 0] = np.expm1(2 * e) * v_max + v_step
    return bound


INT8_CASES = [
    # (decode or ragged, shapes, (q_len, kv_len) pairs)
    ("decode", Shapes(16, 64, 3, 3, 6, jnp.float32), [(1, 1), (1, 16), (1, 17), (1, 96), (1, 40)]),
    ("decode", Shapes(8, 128, 4, 2, 8, jnp.bfloat16), [(1, 64), (1, 9)]),
    ("ragged", Shapes(16, 64, 3, 3, 4, jnp.float32), [(1, 1), (7, 7), (0, 0), (16, 40), (1, 33), (5, 64)]),
]


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] in INT8_KV_KERNELS])
@pytest.mark.parametrize("case", range(len(INT8_CASES)))
def test_int8_kv_reads_as_its_dequantized_values_and_stays_within_the_quantization_bound(case, backend):
    kind, shapes, pairs = INT8_CASES[case]
    q_lens, kv_lens = zip(*pairs)
    batch = make_batch(shapes, q_lens, kv_lens, seed=300 + case, extra_rows=2 * (kind == "ragged"))
    k_int8, v_int8, dequantized = int8_pools(batch, seed=case)
    sm_scale = shapes.head_dim**-0.5
    q, kv_lens, page_table = (jnp.asarray(a) for a in (batch.q, batch.kv_lens, batch.page_table))
    if kind == "decode":
        out = paged_decode_attention(q, k_int8, v_int8, kv_lens, page_table, sm_scale=sm_scale,
                                     **backend_kwargs(backend))
        expected, float_pool = decode_oracle(dequantized, sm_scale), decode_oracle(batch, sm_scale)
    else:
        out = ragged_paged_attention(q, k_int8, v_int8, kv_lens, page_table, jnp.asarray(batch.cu_q_lens),
                                     max_q_len=max(q_lens), sm_scale=sm_scale, **backend_kwargs(backend))
        expected, float_pool = oracle(dequantized, sm_scale), oracle(batch, sm_scale)
    assert out.dtype == shapes.dtype
    assert_matches(out, expected, shapes.dtype)
    error = np.abs(np.asarray(out.astype(jnp.float32)) - float_pool)
    bound = quantization_bound(batch, np.asarray(k_int8.scales), np.asarray(v_int8.scales), sm_scale)
    assert np.all(error <= bound + TOLERANCE[shapes.dtype]["atol"])


def cpu_kernel_args(batch: Batch) -> dict:
    return dict(q=jnp.asarray(batch.q), k_pages=jnp.asarray(batch.k_pages), v_pages=jnp.asarray(batch.v_pages),
                kv_lens=jnp.asarray(batch.kv_lens), page_table=jnp.asarray(batch.page_table),
                cu_q_lens=jnp.asarray(batch.cu_q_lens))


@needs_cpu_kernel
@pytest.mark.parametrize("shapes", [Shapes(1, 128, 3, 2, 70, jnp.float32), Shapes(64, 64, 4, 2, 3, jnp.float32)],
                         ids=["page-size-1", "page-size-64"])
@pytest.mark.parametrize("pool", ["float32", "int8"])
def test_cpu_kernel_matches_the_oracle_with_pages_of_1_and_64_tokens(shapes, pool):
    """Pages of one token (each 8-token score block re-reads it) and of 64 (a page of 8 blocks), contexts of 1, 2,
    a page, a page + 1 and the maximum, in decode rows and prefills."""
    ps, mx = shapes.page_size, shapes.max_context
    pairs = [(1, 1), (2, 2), (1, 2), (0, 0), (ps, ps), (2, ps + 1), (1, mx), (9, mx)]
    batch = make_batch(shapes, *zip(*pairs), seed=ps, extra_rows=2)
    k_pages, v_pages, expected = jnp.asarray(batch.k_pages), jnp.asarray(batch.v_pages), batch
    if pool == "int8":
        k_pages, v_pages, expected = int8_pools(batch, seed=ps)
    args = {**cpu_kernel_args(batch), "k_pages": k_pages, "v_pages": v_pages}
    out = ragged_paged_attention_cpu(**args, sm_scale=shapes.head_dim**-0.5)
    assert_matches(out, oracle(expected, shapes.head_dim**-0.5), shapes.dtype)


@needs_cpu_kernel
@pytest.mark.parametrize("page", [-1, "pool size"])
def test_cpu_kernel_refuses_a_page_id_outside_the_pool_within_a_context(page):
    batch = make_batch(Shapes(8, 64, 1, 1, 3, jnp.float32), [1, 2], [3, 12], seed=1)
    batch.page_table[1, 1] = batch.k_pages.shape[0] if page == "pool size" else page
    with pytest.raises(Exception, match="page id outside the pool"):
        jax.block_until_ready(ragged_paged_attention_cpu(**cpu_kernel_args(batch), sm_scale=0.125))


def changed(name: str, change):
    """The kernel's arguments with argument `name` changed by `change` (of its NumPy value)."""
    return lambda args: {**args, name: jnp.asarray(change(np.asarray(args[name])))}


@needs_cpu_kernel
@pytest.mark.parametrize("change", [
    changed("cu_q_lens", lambda cu: cu - 1),  # the first sequence's rows from -1
    changed("kv_lens", lambda kv: kv[:1]),  # fewer kv_lens than page-table rows
    changed("cu_q_lens", lambda cu: cu[:2]),
    changed("q", lambda q: q[..., :32]),  # another head_dim than the pool's
    changed("q", lambda q: q[:, :5]),  # q heads not a multiple of kv heads
    changed("v_pages", lambda v: v[:3]),  # V's pool smaller than K's
], ids=["negative-row", "short-kv-lens", "short-cu-q-lens", "head-dim", "group", "v-pool"])
def test_cpu_kernel_refuses_arguments_that_disagree_instead_of_reading_past_them(change):
    batch = make_batch(Shapes(8, 64, 3, 2, 3, jnp.float32), [2, 1], [9, 3], seed=2)
    with pytest.raises(Exception, match="cpu_ragged_paged_attention: "):
        jax.block_until_ready(ragged_paged_attention_cpu(**change(cpu_kernel_args(batch)), sm_scale=0.125))


@needs_cpu_kernel
def test_cpu_kernel_refuses_int8_scales_of_another_shape_than_the_pool():
    batch = make_batch(Shapes(8, 64, 1, 1, 2, jnp.float32), [1], [9], seed=3)
    k_int8, v_int8, _ = int8_pools(batch, seed=3)
    args = {**cpu_kernel_args(batch), "k_pages": k_int8, "v_pages": QuantizedPages(v_int8.values, v_int8.scales[:2])}
    with pytest.raises(Exception, match="cpu_ragged_paged_attention: "):
        jax.block_until_ready(ragged_paged_attention_cpu(**args, sm_scale=0.125))


def test_mosaic_backend_refuses_an_int8_kv_cache_naming_the_backends_that_read_it():
    batch = make_batch(Shapes(16, 64, 1, 1, 1, jnp.bfloat16), [1], [3], seed=1)
    k_int8, v_int8, _ = int8_pools(batch, seed=1)
    q, _, _, kv_lens, page_table = batch.device_args()
    with pytest.raises(ValueError, match="do not read an int8 KV cache; backends that do: pallas-triton, cpu"):
        paged_decode_attention(q, k_int8, v_int8, kv_lens, page_table, sm_scale=0.125, backend="pallas-mosaic")


def test_auto_backend_is_the_cpu_kernel_on_cpu_and_mosaic_on_hopper():
    on_gpu = "pallas-mosaic" if runs_on(jax.devices()[0]) else "pallas-triton"
    assert resolve_backend("auto") == (on_gpu if ON_GPU else "cpu")
    shapes = Shapes(16, 64, 3, 3, 4, jnp.float32)
    args = make_batch(shapes, [1, 1], [5, 33], seed=9).device_args()
    auto = paged_decode_attention(*args, sm_scale=0.125)
    # For these inputs: a float32 pool, which Mosaic cannot run (the first H200 check caught the test asking
    # without them).
    chosen = paged_decode_attention(*args, sm_scale=0.125, backend=resolve_backend("auto", args[0], args[1]))
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(chosen))


def test_auto_on_a_hopper_gpu_takes_mosaic_only_for_inputs_it_runs(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(mosaic_attention, "runs_on", lambda device: True)
    q = jnp.zeros((2, 8, 64), jnp.bfloat16)
    pages = lambda page_size=16, head_dim=64, dtype=jnp.bfloat16: jnp.zeros((4, 2, page_size, head_dim), dtype)
    assert resolve_backend("auto") == "pallas-mosaic"
    assert resolve_backend("auto", q, pages()) == "pallas-mosaic"
    int8 = QuantizedPages(jnp.zeros((4, 2, 16, 64), jnp.int8), jnp.ones((4, 2, 16), jnp.float32))
    assert resolve_backend("auto", q, int8) == "pallas-triton"
    assert resolve_backend("auto", q, pages(dtype=jnp.float32)) == "pallas-triton"
    assert resolve_backend("auto", q, pages(head_dim=96)) == "pallas-triton"
    assert resolve_backend("auto", q, pages(page_size=12)) == "pallas-triton"
    monkeypatch.setattr(mosaic_attention, "runs_on", lambda device: False)  # an Ampere GPU
    assert resolve_backend("auto", q, pages()) == "pallas-triton"


def test_pallas_is_another_name_for_the_triton_kernels():
    assert resolve_backend("pallas") == "pallas-triton"


def test_unknown_backend_is_rejected():
    shapes = Shapes(16, 64, 1, 1, 1, jnp.float32)
    batch = make_batch(shapes, [1], [3], seed=1)
    with pytest.raises(ValueError, match="backend"):
        paged_decode_attention(*batch.device_args(), sm_scale=0.125, backend="triton")


def test_interpret_mode_poisons_kernel_outputs():
    def writes_first_row_only(o_ref):
        o_ref[0, :] = jnp.ones((8,), jnp.float32)

    out = pl.pallas_call(writes_first_row_only, out_shape=jax.ShapeDtypeStruct((2, 8), jnp.float32), interpret=True)()
    assert np.isnan(np.asarray(out)[1]).all()


def test_triton_backend_rejects_a_head_dim_it_cannot_tile():
    shapes = Shapes(16, 48, 1, 1, 1, jnp.float32)
    batch = make_batch(shapes, [1], [3], seed=1)
    with pytest.raises(ValueError, match="power-of-2 head_dim"):
        paged_decode_attention(*batch.device_args(), sm_scale=0.125, backend="pallas-triton", interpret=True)


@pytest.mark.parametrize("shapes, message", [
    (Shapes(16, 64, 1, 1, 1, jnp.float32), "16-bit dtype"),
    (Shapes(16, 96, 1, 1, 1, jnp.bfloat16), "head_dim a multiple of 64"),
    (Shapes(12, 64, 1, 1, 1, jnp.bfloat16), "page_size"),
])
def test_mosaic_backend_rejects_shapes_it_cannot_tile(shapes, message):
    batch = make_batch(shapes, [1], [3], seed=1)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(*batch.device_args(), sm_scale=0.125, backend="pallas-mosaic")


def test_mosaic_backend_has_no_interpret_mode():
    batch = make_batch(Shapes(16, 64, 1, 1, 1, jnp.bfloat16), [1], [3], seed=1)
    with pytest.raises(ValueError, match="no interpret mode"):
        paged_decode_attention(*batch.device_args(), sm_scale=0.125, backend="pallas-mosaic", interpret=True)


def test_mosaic_ragged_wrapper_gives_each_token_its_own_tiles_rows(monkeypatch):
    """The layout around the Mosaic kernel, on a CPU: with the kernel replaced by the identity (its output is its
    query tiles), the wrapper must hand each real token its own q back, head by head, and zeros past the last
    sequence's tokens, whatever the sequences' lengths (empty ones, several tiles, a partial tile)."""
    monkeypatch.setattr(mosaic_attention, "_attend_tiles", lambda q_tiles, *args, **kwargs: (q_tiles,))
    q_lens = [3, 0, 37, 1, 16]
    num_tokens = sum(q_lens) + 5  # a padded bucket
    q = jax.random.normal(jax.random.key(3), (num_tokens, 8, 64), jnp.bfloat16)
    cu_q_lens = jnp.array(np.cumsum([0, *q_lens]), jnp.int32)
    pages = jnp.zeros((4, 2, 16, 64), jnp.bfloat16)
    out = mosaic_attention.ragged_paged_attention_mosaic(
        q, pages, pages, jnp.array(q_lens, jnp.int32) + 4, jnp.zeros((len(q_lens), 4), jnp.int32), cu_q_lens,
        max_q_len=40, sm_scale=0.125)
    np.testing.assert_array_equal(np.asarray(out[:sum(q_lens)]), np.asarray(q[:sum(q_lens)]))
    assert not np.asarray(out[sum(q_lens):]).any()
