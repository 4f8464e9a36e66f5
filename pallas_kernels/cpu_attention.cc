// Ragged paged attention for the CPU, an XLA FFI custom call: the CPU counterpart of the Pallas kernels.
//
// Semantics are those of `ragged_paged_attention` (pallas_kernels/attention.py): sequence s owns query rows
// cu_q_lens[s]:cu_q_lens[s+1]; its i-th query sits at position kv_lens[s] - q_len + i and attends causally to
// kv positions 0..that position of its pages. Rows no sequence owns, and rows of a sequence with kv_len 0
// (padding), come back as zeros.
//
// Layout: q [T, Hq, D] f32; k_pages, v_pages [P, Hkv, S, D] (f32, or int8 with per-token-per-head scales
// [P, Hkv, S] f32); page_table [N, M] i32; kv_lens [N] i32; cu_q_lens [N + 1] i32. Only the pages a sequence's
// context covers are read (page-table entries past them may hold anything), and no K/V slot at a position
// >= kv_len reaches the result even if it holds NaN.
//
// Work is split by (sequence, kv head): each item reads its context's K/V once for all the q heads of its
// GQA group and all its query rows, page by page with an online softmax. Items are claimed by the calling
// thread and by helpers on XLA's intra-op thread pool (cpu_parallel.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// K/V rows of the pool: f32 as they are, or int8 times a per-(page, head, token) scale.
template <typename T>
struct PagePool {
  const T* values;          // [P, Hkv, S, D]
  const float* scales;      // [P, Hkv, S] or nullptr for f32
  int64_t num_kv_heads, page_size, head_dim;

  // Pointer to token t of (page, head), and its scale (1 for f32).
  const T* Row(int64_t page, int64_t head, int64_t t) const {
    return values + ((page * num_kv_heads + head) * page_size + t) * head_dim;
  }
  float Scale(int64_t page, int64_t head, int64_t t) const {
    return scales == nullptr ? 1.0f : scales[(page * num_kv_heads + head) * page_size + t];
  }
};

struct Shape {
  int64_t num_tokens, num_q_heads, head_dim, num_kv_heads, page_size, num_seqs, max_pages;
};

float Dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) s += a[j] * b[j];
  return s;
}

void Axpy(float w, const float* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] += w * x[j];
}

// e^x for x <= 0 (and -inf -> 0), in plain arithmetic the compiler vectorizes (libm's expf is a scalar call):
// x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error ~2e-7), 2^n in
// the exponent bits.
inline float ExpNonPositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::nearbyint(clamped * 1.44269504f);
  const float r = clamped - n * 0.693145752f - n * 1.42860677e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// Token t of (page, head) as f32: the pool's own row for f32, else dequantized into `scratch`.
template <typename T>
const float* RowF32(const PagePool<T>& pool, int64_t page, int64_t head, int64_t t, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return pool.Row(page, head, t);
  } else {
    const T* row = pool.Row(page, head, t);
    const float scale = pool.Scale(page, head, t);
#pragma omp simd
    for (int64_t j = 0; j < pool.head_dim; ++j) scratch[j] = static_cast<float>(row[j]) * scale;
    return scratch;
  }
}

// One (sequence, kv head): every query row of the group's q heads, over the sequence's pages.
template <typename T>
void AttendItem(int64_t seq, int64_t kv_head, const Shape& sh, const float* q, const PagePool<T>& k,
                const PagePool<T>& v, const int32_t* kv_lens, const int32_t* page_table, const int32_t* cu_q_lens,
                float sm_scale, float* out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t group = sh.num_q_heads / sh.num_kv_heads, d = sh.head_dim, ps = sh.page_size;
  const int64_t q_start = cu_q_lens[seq], q_len = cu_q_lens[seq + 1] - q_start, kv_len = kv_lens[seq];
  if (q_len <= 0 || kv_len <= 0) return;  // padding: its rows stay zero
  const int64_t rows = q_len * group;
  // Per-thread scratch, reused across calls: items are many and small.
  thread_local std::vector<float> m, l, acc, qs, scores, row_scratch;
  m.assign(rows, kNegInf);
  l.assign(rows, 0.0f);
  acc.assign(rows * d, 0.0f);
  qs.resize(rows * d);
  scores.resize(rows * ps);
  row_scratch.resize(d);
  // Row r = (i, g): query i of q head kv_head * group + g, at position kv_len - q_len + i.
  for (int64_t i = 0; i < q_len; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const float* src = q + ((q_start + i) * sh.num_q_heads + kv_head * group + g) * d;
      for (int64_t j = 0; j < d; ++j) qs[(i * group + g) * d + j] = src[j] * sm_scale;
    }
  const int64_t num_pages = (kv_len + ps - 1) / ps;
  const int64_t page_bytes = ps * d * static_cast<int64_t>(sizeof(T));
  for (int64_t p = 0; p < num_pages; ++p) {
    const int64_t page = page_table[seq * sh.max_pages + p];
    const int64_t tokens = std::min(ps, kv_len - p * ps);
    if (p + 1 < num_pages) {  // pages are scattered: start fetching the next one while this one is computed
      const int64_t next = page_table[seq * sh.max_pages + p + 1];
      const char* next_k = reinterpret_cast<const char*>(k.Row(next, kv_head, 0));
      const char* next_v = reinterpret_cast<const char*>(v.Row(next, kv_head, 0));
      for (int64_t offset = 0; offset < page_bytes; offset += 64) {
        __builtin_prefetch(next_k + offset);
        __builtin_prefetch(next_v + offset);
      }
    }
    // Rows whose query sees every token of this page, then the rest of the rows (a prefill's early queries).
    for (int64_t t = 0; t < tokens; ++t) {
      const float* kt = RowF32(k, page, kv_head, t, row_scratch.data());
      const int64_t pos = p * ps + t;
      for (int64_t r = 0; r < rows; ++r) {
        const bool visible = pos <= kv_len - q_len + r / group;
        scores[r * ps + t] = visible ? Dot(&qs[r * d], kt, d) : kNegInf;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = &scores[r * ps];
      float block_max = m[r];
      for (int64_t t = 0; t < tokens; ++t) block_max = std::max(block_max, sr[t]);
      if (block_max == kNegInf) continue;  // nothing visible to this row yet
      const float alpha = ExpNonPositive(m[r] - block_max);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < tokens; ++t) {
        sr[t] = ExpNonPositive(sr[t] - block_max);
        sum += sr[t];
      }
      m[r] = block_max;
      l[r] = l[r] * alpha + sum;
      float* ar = &acc[r * d];
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) ar[j] *= alpha;
    }
    for (int64_t t = 0; t < tokens; ++t) {
      const float* vt = RowF32(v, page, kv_head, t, row_scratch.data());
      for (int64_t r = 0; r < rows; ++r) {
        const float w = scores[r * ps + t];
        if (w > 0.0f) Axpy(w, vt, &acc[r * d], d);  // 0 for masked tokens, and for rows not started
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / group, g = r % group;
    float* dst = out + ((q_start + i) * sh.num_q_heads + kv_head * group + g) * d;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int64_t j = 0; j < d; ++j) dst[j] = acc[r * d + j] * inv;
  }
}

template <typename T>
ffi::Error Attend(ffi::ThreadPool& pool, const Shape& sh, const float* q, const PagePool<T>& k, const PagePool<T>& v,
                  const int32_t* kv_lens, const int32_t* page_table, const int32_t* cu_q_lens, float sm_scale,
                  float* out) {
  std::fill(out, out + sh.num_tokens * sh.num_q_heads * sh.head_dim, 0.0f);
  for (int64_t s = 0; s < sh.num_seqs; ++s) {
    const int64_t q_len = cu_q_lens[s + 1] - cu_q_lens[s];
    if (q_len < 0 || cu_q_lens[s + 1] > sh.num_tokens || (kv_lens[s] > 0 && q_len > kv_lens[s]) ||
        (kv_lens[s] + sh.page_size - 1) / sh.page_size > sh.max_pages)
      return ffi::Error::InvalidArgument("cpu_ragged_paged_attention: inconsistent cu_q_lens / kv_lens");
  }
  const int64_t items = sh.num_seqs * sh.num_kv_heads;
  int64_t work = 0;  // query rows x context: about what an item costs
  for (int64_t s = 0; s < sh.num_seqs; ++s) work += (cu_q_lens[s + 1] - cu_q_lens[s]) * kv_lens[s];
  sluice::ParallelChunks(pool, items, work * sh.num_q_heads * sh.head_dim, [&](int64_t item) {
    AttendItem<T>(item / sh.num_kv_heads, item % sh.num_kv_heads, sh, q, k, v, kv_lens, page_table, cu_q_lens,
                  sm_scale, out);
  });
  return ffi::Error::Success();
}

Shape ShapeOf(ffi::Buffer<ffi::F32>& q, int64_t page_size, int64_t num_kv_heads, ffi::Buffer<ffi::S32>& page_table) {
  auto qd = q.dimensions();
  auto pt = page_table.dimensions();
  return Shape{qd[0], qd[1], qd[2], num_kv_heads, page_size, pt[0], pt[1]};
}

ffi::Error AttendF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                     ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> cu_q_lens,
                     float sm_scale, ffi::ResultBuffer<ffi::F32> out) {
  auto kd = k_pages.dimensions();
  Shape sh = ShapeOf(q, kd[2], kd[1], page_table);
  PagePool<float> k{k_pages.typed_data(), nullptr, kd[1], kd[2], kd[3]};
  PagePool<float> v{v_pages.typed_data(), nullptr, kd[1], kd[2], kd[3]};
  return Attend<float>(pool, sh, q.typed_data(), k, v, kv_lens.typed_data(), page_table.typed_data(),
                       cu_q_lens.typed_data(), sm_scale, out->typed_data());
}

ffi::Error AttendInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k_pages, ffi::Buffer<ffi::F32> k_scales,
                      ffi::Buffer<ffi::S8> v_pages, ffi::Buffer<ffi::F32> v_scales, ffi::Buffer<ffi::S32> kv_lens,
                      ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> cu_q_lens, float sm_scale,
                      ffi::ResultBuffer<ffi::F32> out) {
  auto kd = k_pages.dimensions();
  Shape sh = ShapeOf(q, kd[2], kd[1], page_table);
  PagePool<int8_t> k{k_pages.typed_data(), k_scales.typed_data(), kd[1], kd[2], kd[3]};
  PagePool<int8_t> v{v_pages.typed_data(), v_scales.typed_data(), kd[1], kd[2], kd[3]};
  return Attend<int8_t>(pool, sh, q.typed_data(), k, v, kv_lens.typed_data(), page_table.typed_data(),
                        cu_q_lens.typed_data(), sm_scale, out->typed_data());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SluiceCpuRaggedPagedAttentionF32, AttendF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SluiceCpuRaggedPagedAttentionInt8, AttendInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
