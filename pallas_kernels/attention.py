"""Paged attention over the KV page pool: the one entry point the model calls, backend chosen here.

Layout (see `kv_cache.py`): k_pages, v_pages `[num_pages, num_kv_heads, page_size, head_dim]`, one
flat pool (the model folds layers into num_pages), each an array or int8 `QuantizedPages` of that shape
(`--kv-cache-dtype int8`: values with a float32 scale per (page, head, token)); page_table
`[num_seqs, max_pages_per_seq]` int32.
Entries past a sequence's last used page (cdiv(kv_len, page_size)) may hold anything, and K/V slots
at positions >= kv_len are never read into a result, even if they hold NaN.

Semantics of `ragged_paged_attention`: sequence s owns query rows cu_q_lens[s]:cu_q_lens[s+1]
(q_len_s <= max_q_len); its i-th query sits at position kv_lens[s] - q_len_s + i (kv_lens counts
this step's tokens, already written) and attends causally to kv positions 0..that position. Padding
sequences have q_len 0 and kv_len 0; rows at or past cu_q_lens[-1] come back as zeros. GQA: q head
j reads kv head j // (num_q_heads // num_kv_heads). Softmax in float32, output in q's dtype.
max_q_len == 1 (a decode-only step) takes the decode path: one query per sequence, split-K.

Backends (the choice lives here only):
- "pallas-triton": the Pallas kernels lowered through Triton (`triton_decode.py`, `triton_ragged.py`);
  power-of-2 page_size and head_dim, pages of at most a few dozen tokens; `interpret=True` runs them on
  the CPU for tests. Triton lowering is deprecated from jax 0.11.
- "pallas-mosaic": the Pallas kernels on Mosaic GPU (`mosaic_attention.py`, Hopper or newer): TMA page
  copies and warpgroup MMAs; 16-bit dtypes, head_dim a multiple of 64. They lower on any host but run
  only on a GPU (no interpret mode). They do not read an int8 KV cache (INT8_KV_KERNELS do).
- "cpu": the C++ kernel for the CPU (`cpu_attention.cc`, an XLA FFI custom call): reads each sequence's pages
  in place, ragged rows natively (a decode row is one query, never padded to a prefill piece).
- "reference": the jnp implementation (`paged_attention_ref.py`), the oracle, and the CPU path where the C++
  kernel cannot be built.
- "pallas": the same as "pallas-triton" (the name the CLI and tests have used).
- "auto": on a GPU, "pallas-mosaic" where it runs (Hopper or newer) and takes the inputs (a 16-bit pool it can
  tile, not int8), else "pallas-triton": on an H200 Mosaic passed the kernel tests and decoded 1.1-2.3x faster
  than Triton from batch 8 up (84% of the measured bandwidth at batch 64 x 2048, against 46%; bench/RESULTS.md).
  On a CPU "cpu", or "reference" (said once) where the C++ kernel is unavailable: no compiler, another ISA, a
  failed build (`cpu_library.py`).

What only a real GPU run can show: the tests lower the kernels for "cuda" with `jax.export` on a
CPU host, which checks that every operation has a GPU lowering rule, but lowering is not compiling:
the backend compile (register and shared-memory limits of the tile sizes, layouts), the numerics of
the tensor-core dots, and speed are known only after running on a GPU (`python -m sluice.bench.gpu_check`
runs the correctness suite compiled, the kernel benchmark and the engine there).
"""

import functools
import logging

import jax
import jax.numpy as jnp

from sluice.pallas_kernels import cpu_attention, mosaic_attention
from sluice.pallas_kernels.kv_cache import Pages, QuantizedPages
from sluice.pallas_kernels.cpu_attention import ragged_paged_attention_cpu
from sluice.pallas_kernels.mosaic_attention import paged_decode_attention_mosaic, ragged_paged_attention_mosaic
from sluice.pallas_kernels.paged_attention_ref import paged_decode_attention_ref, ragged_paged_attention_ref
from sluice.pallas_kernels.triton_decode import paged_decode_attention_triton
from sluice.pallas_kernels.triton_ragged import ragged_paged_attention_triton

KERNELS = ("pallas-triton", "pallas-mosaic", "cpu", "reference")
ALIASES = {"pallas": "pallas-triton"}
BACKENDS = ("auto", *KERNELS, *ALIASES)
INT8_KV_KERNELS = ("pallas-triton", "cpu", "reference")

logger = logging.getLogger(__name__)


def resolve_backend(backend: str, q: jax.Array | None = None, k_pages: Pages | None = None) -> str:
    """The implementation `backend` names here (one of KERNELS), for these inputs when given: "auto" on a GPU
    takes Mosaic only for inputs it can run."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if jax.default_backend() == "gpu":
            return "pallas-mosaic" if _mosaic_takes(q, k_pages) else "pallas-triton"
        if cpu_attention.available():
            return "cpu"
        _say_auto_takes_the_reference()
        return "reference"
    return ALIASES.get(backend, backend)


def _mosaic_takes(q: jax.Array | None, k_pages: Pages | None) -> bool:
    """Whether the Mosaic kernels run on this device and can take these inputs (unknown inputs: a 16-bit pool
    of the shapes they tile, as the engine's bf16 models have)."""
    if not mosaic_attention.runs_on(jax.devices()[0]):
        return False
    if k_pages is None:
        return True
    if isinstance(k_pages, QuantizedPages):
        return False
    _, num_kv_heads, page_size, head_dim = k_pages.shape
    if q is not None and q.shape[1] // num_kv_heads > mosaic_attention.ROWS:
        return False
    try:
        mosaic_attention.check_shapes(page_size, head_dim, k_pages.dtype)
    except ValueError:
        return False
    return True


@functools.cache
def _say_auto_takes_the_reference() -> None:
    logger.warning("attention backend auto: the jnp reference, the CPU attention kernel being unavailable")


def reads_int8_kv(backend: str) -> bool:
    """Whether `backend` (one of BACKENDS) reads an int8 KV cache ("auto" always picks a kernel that does)."""
    return backend == "auto" or ALIASES.get(backend, backend) in INT8_KV_KERNELS


def _check(kernel: str, k_pages: Pages, interpret: bool) -> None:
    if interpret and kernel == "pallas-mosaic":
        raise ValueError("the Mosaic GPU kernels have no interpret mode: they run only on a GPU")
    if isinstance(k_pages, QuantizedPages) and kernel not in INT8_KV_KERNELS:
        raise ValueError(f"the {kernel} attention kernels do not read an int8 KV cache; "
                         f"backends that do: {', '.join(INT8_KV_KERNELS)}")


def paged_decode_attention(
    q: jax.Array,
    k_pages: Pages,
    v_pages: Pages,
    kv_lens: jax.Array,
    page_table: jax.Array,
    *,
    sm_scale: float,
    backend: str = "auto",
    interpret: bool = False,
) -> jax.Array:
    """One query per sequence, at position kv_lens[s] - 1.

    q: [num_seqs, num_q_heads, head_dim]; k_pages, v_pages: [num_pages, num_kv_heads, page_size,
    head_dim] (arrays or `QuantizedPages`); kv_lens: [num_seqs] int32; page_table: [num_seqs,
    max_pages_per_seq] int32.
    Returns [num_seqs, num_q_heads, head_dim] in q's dtype; rows with kv_len 0 are zeros.
    """
    kernel = resolve_backend(backend, q, k_pages)
    _check(kernel, k_pages, interpret)
    if kernel == "pallas-triton":
        return paged_decode_attention_triton(
            q, k_pages, v_pages, kv_lens, page_table, sm_scale=sm_scale, interpret=interpret
        )
    if kernel == "pallas-mosaic":
        return paged_decode_attention_mosaic(q, k_pages, v_pages, kv_lens, page_table, sm_scale=sm_scale)
    if kernel == "cpu":
        cu_q_lens = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
        return ragged_paged_attention_cpu(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, sm_scale=sm_scale)
    return paged_decode_attention_ref(q, k_pages, v_pages, kv_lens, page_table, sm_scale=sm_scale)


def ragged_paged_attention(
    q: jax.Array,
    k_pages: Pages,
    v_pages: Pages,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    *,
    max_q_len: int,
    sm_scale: float,
    backend: str = "auto",
    interpret: bool = False,
) -> jax.Array:
    """Mixed chunked-prefill and decode rows of many sequences (semantics in the module docstring).

    q: [num_tokens, num_q_heads, head_dim]; k_pages, v_pages: [num_pages, num_kv_heads, page_size,
    head_dim] (arrays or `QuantizedPages`); kv_lens: [num_seqs] int32; page_table: [num_seqs,
    max_pages_per_seq] int32; cu_q_lens: [num_seqs + 1] int32; max_q_len (static) bounds every q_len_s.
    Returns [num_tokens, num_q_heads, head_dim] in q's dtype.
    """
    kernel = resolve_backend(backend, q, k_pages)
    _check(kernel, k_pages, interpret)
    if kernel == "cpu":
        return ragged_paged_attention_cpu(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, sm_scale=sm_scale)
    if max_q_len == 1:
        return _decode_rows(
            q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
            sm_scale=sm_scale, backend=backend, interpret=interpret,
        )
    if kernel == "pallas-triton":
        return ragged_paged_attention_triton(
            q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
            max_q_len=max_q_len, sm_scale=sm_scale, interpret=interpret,
        )
    if kernel == "pallas-mosaic":
        return ragged_paged_attention_mosaic(
            q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q_len=max_q_len, sm_scale=sm_scale
        )
    return ragged_paged_attention_ref(
        q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q_len=max_q_len, sm_scale=sm_scale
    )


def _decode_rows(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, *, sm_scale, backend, interpret):
    """A ragged batch whose q_lens are all 0 or 1, through the decode path."""
    num_tokens = q.shape[0]
    q_starts = cu_q_lens[:-1]
    has_query = cu_q_lens[1:] > q_starts
    rows = jnp.where(has_query, q_starts, 0)
    out = paged_decode_attention(
        q[rows], k_pages, v_pages, jnp.where(has_query, kv_lens, 0), page_table,
        sm_scale=sm_scale, backend=backend, interpret=interpret,
    )
    return jnp.zeros_like(q).at[jnp.where(has_query, rows, num_tokens)].set(out, mode="drop")
