// Ragged paged attention for the CPU, an XLA FFI custom call: the CPU counterpart of the Pallas kernels.
//
// Semantics are those of `ragged_paged_attention` (pallas_kernels/attention.py): sequence s owns query rows
// cu_q_lens[s]:cu_q_lens[s+1]; its i-th query sits at position kv_lens[s] - q_len + i and attends causally to
// kv positions 0..that position of its pages. Rows no sequence owns, and rows of a sequence with kv_len 0
// (padding), come back as zeros.
//
// Layout: q [T, Hq, D] f32; k_pages, v_pages [P, Hkv, S, D] (f32, or int8 with per-token-per-head scales
// [P, Hkv, S] f32); page_table [N, M] i32; kv_lens [N] i32; cu_q_lens [N + 1] i32. Only the pages a sequence's
// context covers are read (page-table entries past them may hold anything; an id outside the pool within them
// is an error, not a read past the pool), and no K/V slot at a position >= kv_len reaches the result even if it
// holds NaN.
//
// Work is split by (sequence, kv head): each item reads its context's K/V once for all the q heads of its
// GQA group and all its query rows, page by page with an online softmax. Items are claimed by the calling
// thread and by helpers on XLA's intra-op thread pool (cpu_parallel.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_simd.h"
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
  int64_t num_tokens, num_q_heads, head_dim, num_pages, num_kv_heads, page_size, num_seqs, max_pages;
};

// e^x lane by lane for x <= 0 (-inf -> 0): x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor
// polynomial (relative error ~2e-7), 2^n in the exponent bits.
inline __m256 ExpNonPositive(__m256 x) {
  const __m256 clamped = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), clamped);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  for (const float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
  return _mm256_and_ps(result, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}

inline float HorizontalMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float HorizontalSum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// 8 consecutive elements (chunk c) of token t's row of (page, head), as f32: an int8 row unscaled (the caller
// applies the row's scale once per token, to its score or its softmax weight, not to each element).
template <typename T>
inline __m256 Load8(const PagePool<T>& pool, int64_t page, int64_t head, int64_t t, int64_t c) {
  const T* row = pool.Row(page, head, t) + 8 * c;
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(row);
  } else {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row))));
  }
}

// The scales of tokens t0..t0+7 of (page, head), each index clamped to last (an int8 pool only).
template <typename T>
inline __m256 Scales8(const PagePool<T>& pool, int64_t page, int64_t head, int64_t t0, int64_t last) {
  alignas(32) float out[8];
  for (int j = 0; j < 8; ++j) out[j] = pool.Scale(page, head, std::min(t0 + j, last));
  return _mm256_load_ps(out);
}

// Lane t of the result is the sum of the lanes of a[t].
inline __m256 Sum8x8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxPageSize = 256;

// R query rows of one (sequence, kv head) over the sequence's pages, with an online softmax. Rows are
// (query i, q head g) pairs; `visible[r]` is how many positions row r attends to. Each 8-token block of a
// page is scored against all R rows at once (R x 8 independent accumulator chains, one horizontal reduction
// per 8 scores), and each V row is read once for all R rows.
template <typename T, int R>
void AttendRows(const float* const* q, const int64_t* visible, const PagePool<T>& k, const PagePool<T>& v,
                const int32_t* pages, int64_t kv_head, float* const* out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t d8 = k.head_dim / 8, ps = k.page_size;
  alignas(32) float o[R][kMaxHeadDim] = {};
  alignas(32) float s[R][kMaxPageSize];
  float m[R], l[R];
  int64_t span = 0;
  for (int r = 0; r < R; ++r) {
    m[r] = kNegInf;
    l[r] = 0.0f;
    span = std::max(span, visible[r]);
  }
  const int64_t num_pages = (span + ps - 1) / ps;
  for (int64_t p = 0; p < num_pages; ++p) {
    const int64_t page = pages[p], tokens = std::min(ps, span - p * ps);
    // Scores, 8 tokens at a time (a short last block re-reads a valid row and is masked below).
    for (int64_t t0 = 0; t0 < tokens; t0 += 8) {
      __m256 acc[R][8];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 8; ++j) acc[r][j] = _mm256_setzero_ps();
      for (int64_t c = 0; c < d8; ++c) {
        __m256 qc[R];
        for (int r = 0; r < R; ++r) qc[r] = _mm256_loadu_ps(q[r] + 8 * c);
        for (int j = 0; j < 8; ++j) {
          const __m256 kc = Load8(k, page, kv_head, std::min(t0 + j, tokens - 1), c);
          for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(qc[r], kc, acc[r][j]);
        }
      }
      if constexpr (std::is_same_v<T, float>) {
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(&s[r][t0], Sum8x8(acc[r]));
      } else {
        const __m256 scale = Scales8(k, page, kv_head, t0, tokens - 1);
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(&s[r][t0], _mm256_mul_ps(Sum8x8(acc[r]), scale));
      }
    }
    // Online softmax over this page's tokens (8 lanes at a time): the ones beyond a row's visible span weigh 0.
    float alpha[R];  // how much of the earlier pages' weight row r keeps
    for (int r = 0; r < R; ++r) {
      const float seen = static_cast<float>(std::clamp<int64_t>(visible[r] - p * ps, 0, tokens));
      __m256 valid[kMaxPageSize / 8];
      __m256 block_max = _mm256_set1_ps(m[r]);
      for (int64_t t0 = 0; t0 < tokens; t0 += 8) {
        const __m256 position = _mm256_add_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps(t0));
        valid[t0 / 8] = _mm256_cmp_ps(position, _mm256_set1_ps(seen), _CMP_LT_OQ);
        block_max = _mm256_max_ps(block_max, _mm256_blendv_ps(_mm256_set1_ps(kNegInf), _mm256_loadu_ps(&s[r][t0]),
                                                              valid[t0 / 8]));
      }
      const float new_max = HorizontalMax(block_max);
      if (new_max == kNegInf) {  // nothing visible to this row yet
        alpha[r] = 1.0f;
        for (int64_t t = 0; t < tokens; ++t) s[r][t] = 0.0f;
        continue;
      }
      alpha[r] = _mm256_cvtss_f32(ExpNonPositive(_mm256_set1_ps(m[r] - new_max)));
      __m256 sum = _mm256_setzero_ps();
      for (int64_t t0 = 0; t0 < tokens; t0 += 8) {
        const __m256 e = ExpNonPositive(_mm256_sub_ps(_mm256_loadu_ps(&s[r][t0]), _mm256_set1_ps(new_max)));
        const __m256 weight = _mm256_and_ps(e, valid[t0 / 8]);
        _mm256_storeu_ps(&s[r][t0], weight);
        sum = _mm256_add_ps(sum, weight);
      }
      m[r] = new_max;
      l[r] = l[r] * alpha[r] + HorizontalSum(sum);
    }
    // o += s V, 4 column chunks (32 elements) of V at a time for all rows: R x 4 independent chains. An int8
    // V row's scale goes into its weights (l has summed them already).
    if constexpr (!std::is_same_v<T, float>) {
      for (int64_t t0 = 0; t0 < tokens; t0 += 8) {
        const __m256 scale = Scales8(v, page, kv_head, t0, tokens - 1);
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(&s[r][t0], _mm256_mul_ps(_mm256_loadu_ps(&s[r][t0]), scale));
      }
    }
    for (int64_t c0 = 0; c0 < d8; c0 += 4) {
      __m256 oc[R][4];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c)
          oc[r][c] = _mm256_mul_ps(_mm256_load_ps(&o[r][8 * (c0 + c)]), _mm256_set1_ps(alpha[r]));
      for (int64_t t = 0; t < tokens; ++t) {
        __m256 vc[4];
        for (int c = 0; c < 4; ++c) vc[c] = Load8(v, page, kv_head, t, std::min(c0 + c, d8 - 1));
        for (int r = 0; r < R; ++r) {
          const __m256 weight = _mm256_set1_ps(s[r][t]);
          for (int c = 0; c < 4; ++c) oc[r][c] = _mm256_fmadd_ps(weight, vc[c], oc[r][c]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4 && c0 + c < d8; ++c) _mm256_store_ps(&o[r][8 * (c0 + c)], oc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int64_t j = 0; j < k.head_dim; ++j) out[r][j] = o[r][j] * inv;
  }
}

// One (sequence, kv head): every query row of the group's q heads, in tiles of up to 4 rows.
template <typename T>
void AttendItem(int64_t seq, int64_t kv_head, const Shape& sh, const float* q, const PagePool<T>& k,
                const PagePool<T>& v, const int32_t* kv_lens, const int32_t* page_table, const int32_t* cu_q_lens,
                float sm_scale, float* out) {
  const int64_t group = sh.num_q_heads / sh.num_kv_heads, d = sh.head_dim;
  const int64_t q_start = cu_q_lens[seq], q_len = cu_q_lens[seq + 1] - q_start, kv_len = kv_lens[seq];
  if (q_len <= 0 || kv_len <= 0) return;  // padding: its rows stay zero
  const int64_t rows = q_len * group;
  thread_local std::vector<float> qs;  // the item's query rows, scaled by sm_scale
  qs.resize(rows * d);
  // Row r = (i, g): query i of q head kv_head * group + g, at position kv_len - q_len + i.
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = q + ((q_start + r / group) * sh.num_q_heads + kv_head * group + r % group) * d;
    for (int64_t j = 0; j < d; ++j) qs[r * d + j] = src[j] * sm_scale;
  }
  const int32_t* pages = page_table + seq * sh.max_pages;
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    const int tile = static_cast<int>(std::min<int64_t>(4, rows - r0));
    const float* qr[4];
    float* outr[4];
    int64_t visible[4];
    for (int i = 0; i < tile; ++i) {
      const int64_t r = r0 + i;
      qr[i] = &qs[r * d];
      outr[i] = out + ((q_start + r / group) * sh.num_q_heads + kv_head * group + r % group) * d;
      visible[i] = kv_len - q_len + r / group + 1;
    }
    switch (tile) {
      case 4: AttendRows<T, 4>(qr, visible, k, v, pages, kv_head, outr); break;
      case 3: AttendRows<T, 3>(qr, visible, k, v, pages, kv_head, outr); break;
      case 2: AttendRows<T, 2>(qr, visible, k, v, pages, kv_head, outr); break;
      default: AttendRows<T, 1>(qr, visible, k, v, pages, kv_head, outr); break;
    }
  }
}

template <typename T>
ffi::Error Attend(ffi::ThreadPool& pool, const Shape& sh, const float* q, const PagePool<T>& k, const PagePool<T>& v,
                  const int32_t* kv_lens, const int32_t* page_table, const int32_t* cu_q_lens, float sm_scale,
                  float* out) {
  std::fill(out, out + sh.num_tokens * sh.num_q_heads * sh.head_dim, 0.0f);
  for (int64_t s = 0; s < sh.num_seqs; ++s) {
    const int64_t q_len = cu_q_lens[s + 1] - cu_q_lens[s];
    const int64_t used_pages = (kv_lens[s] + sh.page_size - 1) / sh.page_size;
    if (cu_q_lens[s] < 0 || q_len < 0 || cu_q_lens[s + 1] > sh.num_tokens ||
        (kv_lens[s] > 0 && q_len > kv_lens[s]) || used_pages > sh.max_pages)
      return ffi::Error::InvalidArgument("cpu_ragged_paged_attention: inconsistent cu_q_lens / kv_lens");
    const int32_t* pages = page_table + s * sh.max_pages;
    if (std::any_of(pages, pages + std::max<int64_t>(used_pages, 0),
                    [&](int32_t page) { return page < 0 || page >= sh.num_pages; }))
      return ffi::Error::InvalidArgument("cpu_ragged_paged_attention: a page id outside the pool within a context");
  }
  if (sh.head_dim % 8 || sh.head_dim > kMaxHeadDim || sh.page_size > kMaxPageSize)
    return ffi::Error::InvalidArgument("cpu_ragged_paged_attention: head_dim must be a multiple of 8 up to 256, "
                                       "page_size at most 256");
  const int64_t items = sh.num_seqs * sh.num_kv_heads;
  int64_t work = 0;  // query rows x context: about what an item costs
  for (int64_t s = 0; s < sh.num_seqs; ++s) work += (cu_q_lens[s + 1] - cu_q_lens[s]) * kv_lens[s];
  sluice::ParallelChunks(pool, items, work * sh.num_q_heads * sh.head_dim, [&](int64_t item) {
    AttendItem<T>(item / sh.num_kv_heads, item % sh.num_kv_heads, sh, q, k, v, kv_lens, page_table, cu_q_lens,
                  sm_scale, out);
  });
  return ffi::Error::Success();
}

using Dims = ffi::Span<const int64_t>;

bool Same(Dims a, Dims b) { return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin()); }

// q [T, Hq, D]; k, v [P, Hkv, S, D]; kv_lens [N]; page_table [N, M]; cu_q_lens [N + 1]; an int8 pool's scales
// [P, Hkv, S] (`scales`: k's and v's, none for f32). The kernel indexes each argument by the others' shapes.
ffi::Error CheckShapes(Dims q, Dims k, Dims v, Dims kv_lens, Dims page_table, Dims cu_q_lens,
                       std::initializer_list<Dims> scales) {
  if (q.size() != 3 || k.size() != 4 || page_table.size() != 2 || kv_lens.size() != 1 || cu_q_lens.size() != 1)
    return ffi::Error::InvalidArgument("cpu_ragged_paged_attention: q [T, Hq, D], k/v pages [P, Hkv, S, D], "
                                       "kv_lens [N], page_table [N, M], cu_q_lens [N + 1] expected");
  const bool scales_fit = std::all_of(scales.begin(), scales.end(), [&](Dims s) {
    return s.size() == 3 && std::equal(s.begin(), s.end(), k.begin());
  });
  if (!Same(k, v) || !scales_fit || q[2] != k[3] || k[1] <= 0 || k[2] <= 0 || q[1] % k[1] ||
      kv_lens[0] != page_table[0] || cu_q_lens[0] != page_table[0] + 1)
    return ffi::Error::InvalidArgument("cpu_ragged_paged_attention: shapes disagree (k and v pages, their scales, "
                                       "head_dim, q heads a multiple of kv heads, page size, N)");
  return ffi::Error::Success();
}

Shape ShapeOf(ffi::Buffer<ffi::F32>& q, Dims pool, ffi::Buffer<ffi::S32>& page_table) {
  auto qd = q.dimensions();
  auto pt = page_table.dimensions();
  return Shape{qd[0], qd[1], qd[2], pool[0], pool[1], pool[2], pt[0], pt[1]};
}

ffi::Error AttendF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                     ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> cu_q_lens,
                     float sm_scale, ffi::ResultBuffer<ffi::F32> out) {
  auto kd = k_pages.dimensions();
  if (auto e = CheckShapes(q.dimensions(), kd, v_pages.dimensions(), kv_lens.dimensions(), page_table.dimensions(),
                           cu_q_lens.dimensions(), {});
      e.failure())
    return e;
  Shape sh = ShapeOf(q, kd, page_table);
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
  if (auto e = CheckShapes(q.dimensions(), kd, v_pages.dimensions(), kv_lens.dimensions(), page_table.dimensions(),
                           cu_q_lens.dimensions(), {k_scales.dimensions(), v_scales.dimensions()});
      e.failure())
    return e;
  Shape sh = ShapeOf(q, kd, page_table);
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
