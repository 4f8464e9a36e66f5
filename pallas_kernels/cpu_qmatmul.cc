// Quantized matmuls for the CPU, XLA FFI custom calls; `cpu_qmatmul.py` holds their jnp references.
//
// Weights stay in GGUF's block formats (Q8_0, Q4_1: one scale, and for Q4_1 one min, per 32 inputs of each
// output column). The float32 activations are quantized inside the call like llama.cpp's Q8 activations, per
// row in blocks of 32 inputs: xq = round(x * 127 / max|x|), d = max|x| / 127. Weights and activations then
// meet in integer dot products (vpdpbusd with AVX-512 VNNI: unsigned byte x signed byte, 4 products summed
// per int32 lane; AVX2's vpmaddubsw + vpmaddwd otherwise), turned into float once per block.
//
// Layouts (row-major). The output columns come in panels of 16 whose weights are contiguous over all of K
// (one sequential stream per panel), and within a panel one 32-byte load holds 4 (Q8_0) or 8 (Q4_1)
// consecutive inputs of 8 columns, a VNNI operand as it is. Column n = 16 p + c:
//   q8_q8: x f32 [M, K], w s8 [L, N/16, K/4, 16, 4], scale f16 [L, N/16, K/32, 16], layer s32 [], rows s32 []
//          -> y f32 [M, N]
//          byte (p, j, c, i) is q[4j + i, n];   w[k, n] = q[k, n] * scale[p, k / 32, c]
//   q4_q8: x f32 [M, K], w u8 [L, N/16, K/8, 16, 4], scale, min f16 [L, N/16, K/32, 16], layer s32 [],
//          rows s32 [] -> y f32 [M, N]
//          byte (p, j, c, i) holds q[8j + i, n] in its low nibble and q[8j + 4 + i, n] in its high one;
//          w[k, n] = q[k, n] * scale[p, k / 32, c] + min[p, k / 32, c]
//   y[m, n] = sum over blocks b of d[m, b] * (scale[b, n] * sum_{k in b} xq[m, k] q[k, n]
//                                            + min[b, n] * sum_{k in b} xq[m, k])
// The stacked [L, ...] weights are passed whole with the layer index, so a layer scan never copies a layer.
// Only the first `rows` rows of x are multiplied; the others (a step's padding up to its compiled size) are
// zeros in y and cost nothing.
//
// Each call quantizes its rows once, then splits the panels into chunks over XLA's intra-op threads. A thread
// computes tiles of up to 4 rows x one panel over the whole of K, the tile's accumulators in registers:
// integer within a block, float across blocks.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;  // inputs per scale, for weights and activations alike

// ---- Activation quantization.

struct QuantizedRows {
  int64_t rows = 0, cols = 0;
  std::vector<int8_t> q;    // [rows, cols]
  std::vector<float> d;     // [rows, cols / kBlock]: the block's scale
  std::vector<float> sum;   // [rows, cols / kBlock]: d * sum of the block's xq
  const int8_t* Row(int64_t m) const { return q.data() + m * cols; }
  int64_t Blocks() const { return cols / kBlock; }
};

inline float HorizontalMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int32_t HorizontalSum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// One block of 32 floats -> 32 int8 (in order), its scale and d * sum(xq). Rounds half to even, as the
// reference's jnp.round does.
inline void QuantizeBlock(const float* x, int8_t* q, float* d, float* sum) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
  }
  const float max_abs = HorizontalMax(amax);
  const float inv = max_abs > 0.0f ? 127.0f / max_abs : 0.0f;
  __m256i n[4];
  for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
  const int32_t total = HorizontalSum(_mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3])));
  // packs work within 128-bit lanes: the bytes come out as dwords (0,4)(1,5)(2,6)(3,7) of the four vectors.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *d = max_abs / 127.0f;
  *sum = *d * static_cast<float>(total);
}

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// x [rows, cols] -> quantized rows; with `norm` (a [cols] RMSNorm weight), each row is first normalized:
// x * (1 / sqrt(mean(x^2) + eps)) * norm, its sum of squares taken in one fixed order, so a row's numbers never
// depend on which other rows share the call (XLA's own reductions change order with the batch size, and a
// one-ulp change can move a value across a rounding boundary of the quantization).
// Reused across calls of the same thread: a fresh allocation per call would fault its pages in every time.
const QuantizedRows& Quantize(const float* x, int64_t rows, int64_t cols, const float* norm, float eps) {
  thread_local QuantizedRows out;
  thread_local std::vector<float> normalized;
  out.rows = rows;
  out.cols = cols;
  out.q.resize(rows * cols);
  out.d.resize(rows * cols / kBlock);
  out.sum.resize(rows * cols / kBlock);
  normalized.resize(norm != nullptr ? cols : 0);
  for (int64_t m = 0; m < rows; ++m) {
    const float* row = x + m * cols;
    if (norm != nullptr) {
      __m256 squares = _mm256_setzero_ps();
      for (int64_t k = 0; k < cols; k += 8) {
        const __m256 v = _mm256_loadu_ps(row + k);
        squares = _mm256_fmadd_ps(v, v, squares);
      }
      const float inv_rms = 1.0f / std::sqrt(HorizontalSum(squares) / static_cast<float>(cols) + eps);
      for (int64_t k = 0; k < cols; ++k) normalized[k] = row[k] * inv_rms * norm[k];
      row = normalized.data();
    }
    for (int64_t b = 0; b < cols / kBlock; ++b) {
      const int64_t at = m * (cols / kBlock) + b;
      QuantizeBlock(row + b * kBlock, out.q.data() + at * kBlock, &out.d[at], &out.sum[at]);
    }
  }
  return out;
}

// ---- Integer dot products: acc += 4-byte dot products of unsigned w and signed x, per int32 lane.

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

inline __m256i DotU8S8(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
  // Pairs of u8 x s8 products summed to int16: no overflow while w <= 128 (4-bit values, |q| of Q8_0).
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

inline __m256 LoadHalf8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i Broadcast4Bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// ---- The two weight formats: how a 32-byte load of a panel (4-byte lanes, 8 columns) becomes VNNI operands,
// and how a block's integer sums become float.

constexpr int64_t kPanel = 16;  // output columns whose packed weights are contiguous over K

struct Weights {
  const uint8_t* values;  // the layer's panels: [P, K/pack, 16, 4]
  const uint16_t* scale;  // [P, K/32, 16] f16
  const uint16_t* min;    // [P, K/32, 16] f16, Q4_1 only
  int64_t panels;
};

// Signed weights against signed activations. With VNNI: q + 128 (the sign bit flipped) as the unsigned side,
// and 128 * sum(xq) taken off per block (x.sum holds d * sum(xq)). Without: |q| against x with q's sign moved
// onto x, which keeps vpmaddubsw's int16 pair sums from saturating.
struct Q8_0 {
  static constexpr int kInputsPerLane = 4;  // a load's lane holds inputs 4j..4j+3 of its column
  static constexpr int kOperands = 1;
  static void Operands(__m256i raw, __m256i* out) {
    out[0] = kVnni ? _mm256_xor_si256(raw, _mm256_set1_epi8(static_cast<char>(0x80))) : raw;
  }
  static __m256i Dot(__m256i acc, __m256i w, __m256i x) {
    return kVnni ? DotU8S8(acc, w, x) : DotU8S8(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  }
  static __m256 Flush(__m256 acc, __m256i dot, __m256 scale, __m256 /*min*/, float d, float sum) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(d)), acc);
    return kVnni ? _mm256_fmadd_ps(scale, _mm256_set1_ps(-128.0f * sum), acc) : acc;
  }
};

struct Q4_1 {
  static constexpr int kInputsPerLane = 8;  // inputs 8j..8j+3 in the low nibbles, 8j+4..8j+7 in the high ones
  static constexpr int kOperands = 2;
  static void Operands(__m256i raw, __m256i* out) {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    out[0] = _mm256_and_si256(raw, low_nibbles);
    out[1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low_nibbles);
  }
  static __m256i Dot(__m256i acc, __m256i w, __m256i x) { return DotU8S8(acc, w, x); }
  static __m256 Flush(__m256 acc, __m256i dot, __m256 scale, __m256 min, float d, float sum) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(d)), acc);
    return _mm256_fmadd_ps(min, _mm256_set1_ps(sum), acc);
  }
};

// ---- A tile: R rows x one panel over all of K, its accumulators in registers.

template <class F, int R>
void Tile(const QuantizedRows& x, int64_t m, const Weights& w, int64_t p, float* y) {
  constexpr int64_t kLanesPerBlock = kBlock / F::kInputsPerLane;
  const int64_t blocks = x.Blocks(), N = w.panels * kPanel;
  const uint8_t* panel = w.values + p * (x.cols / F::kInputsPerLane) * 4 * kPanel;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int64_t j = b * kLanesPerBlock; j < (b + 1) * kLanesPerBlock; ++j) {
      __m256i ops[2][F::kOperands];  // the panel's two 8-column halves
      for (int v = 0; v < 2; ++v)
        F::Operands(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + (j * 2 + v) * 32)), ops[v]);
      for (int r = 0; r < R; ++r)
        for (int o = 0; o < F::kOperands; ++o) {
          const __m256i xr = Broadcast4Bytes(x.Row(m + r) + F::kInputsPerLane * j + 4 * o);
          for (int v = 0; v < 2; ++v) dot[r][v] = F::Dot(dot[r][v], ops[v][o], xr);
        }
    }
    for (int v = 0; v < 2; ++v) {
      const int64_t at = (p * blocks + b) * kPanel + 8 * v;
      const __m256 scale = LoadHalf8(w.scale + at);
      const __m256 min = w.min != nullptr ? LoadHalf8(w.min + at) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const int64_t row_block = (m + r) * blocks + b;
        acc[r][v] = F::Flush(acc[r][v], dot[r][v], scale, min, x.d[row_block], x.sum[row_block]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) _mm256_storeu_ps(y + (m + r) * N + p * kPanel + 8 * v, acc[r][v]);
}

// Panels [p_begin, p_end) of every row: a panel's weights come from memory for the first row tile and from
// cache for the others.
template <class F>
void Panels(const QuantizedRows& x, const Weights& w, int64_t p_begin, int64_t p_end, float* y) {
  for (int64_t p = p_begin; p < p_end; ++p) {
    int64_t m = 0;
    for (; m + 4 <= x.rows; m += 4) Tile<F, 4>(x, m, w, p, y);
    for (; m + 2 <= x.rows; m += 2) Tile<F, 2>(x, m, w, p, y);
    for (; m < x.rows; ++m) Tile<F, 1>(x, m, w, p, y);
  }
}

// Panels in chunks, about kChunksPerThread per thread, so a thread that starts late (a busy machine) leaves
// its share to the others.
constexpr int64_t kChunksPerThread = 4;

template <class F>
void Matmul(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t rows, int64_t K, const float* norm, float eps,
            const Weights& w, float* y) {
  const int64_t N = w.panels * kPanel;
  std::memset(y + rows * N, 0, (M - rows) * N * sizeof(float));
  if (rows == 0) return;
  const QuantizedRows& xq = Quantize(x, rows, K, norm, eps);
  const int64_t threads = pool.num_threads() + 1;
  const int64_t per_chunk = std::max<int64_t>(1, w.panels / (threads * kChunksPerThread));
  sluice::ParallelChunks(pool, (w.panels + per_chunk - 1) / per_chunk, rows * K * N, [&](int64_t c) {
    Panels<F>(xq, w, c * per_chunk, std::min(w.panels, (c + 1) * per_chunk), y);
  });
}

// The layer's RMSNorm weight [K], or nullptr when `norm` is empty ([L, 0]: no normalization).
const float* NormOf(ffi::Buffer<ffi::F32>& norm, int32_t layer, int64_t K) {
  return norm.element_count() == 0 ? nullptr : norm.typed_data() + layer * K;
}

// The rows to multiply: the `rows` operand, clamped to [0, M].
int64_t ValidRows(ffi::Buffer<ffi::S32>& rows, int64_t M) {
  return std::clamp<int64_t>(*rows.typed_data(), 0, M);
}

// x [M, K]; w [L, P, K/pack, 16, 4]; scale (and min) [L, P, K/32, 16]; norm [L, K] or [L, 0].
ffi::Error CheckShapes(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd, ffi::Span<const int64_t> sd,
                       ffi::Span<const int64_t> nd, int64_t pack, int32_t layer) {
  if (xd.size() != 2 || wd.size() != 5 || sd.size() != 4)
    return ffi::Error::InvalidArgument("x [M, K], w [L, P, K/pack, 16, 4], scale [L, P, K/32, 16] expected");
  const int64_t K = xd[1];
  if (K % kBlock || wd[2] * pack != K || wd[3] != kPanel || wd[4] != 4 || sd[0] != wd[0] || sd[1] != wd[1] ||
      sd[2] * kBlock != K || sd[3] != kPanel)
    return ffi::Error::InvalidArgument("shapes disagree (K must be a multiple of 32)");
  if (nd.size() != 2 || nd[0] != wd[0] || (nd[1] != 0 && nd[1] != K))
    return ffi::Error::InvalidArgument("norm must be [L, K] or [L, 0]");
  if (layer < 0 || layer >= wd[0]) return ffi::Error::InvalidArgument("layer index out of range");
  return ffi::Error::Success();
}

ffi::Error Q8Q8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                    ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows,
                    ffi::Buffer<ffi::F32> norm, float eps, ffi::ResultBuffer<ffi::F32> y) {
  const int32_t l = *layer.typed_data();
  if (auto e = CheckShapes(x.dimensions(), w.dimensions(), scale.dimensions(), norm.dimensions(), 4, l); e.failure())
    return e;
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], P = w.dimensions()[1];
  const Weights weights{reinterpret_cast<const uint8_t*>(w.typed_data()) + l * P * K * kPanel,
                        reinterpret_cast<const uint16_t*>(scale.untyped_data()) + l * P * (K / kBlock) * kPanel,
                        nullptr, P};
  Matmul<Q8_0>(pool, x.typed_data(), M, ValidRows(rows, M), K, NormOf(norm, l, K), eps, weights, y->typed_data());
  return ffi::Error::Success();
}

ffi::Error Q4Q8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                    ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> min, ffi::Buffer<ffi::S32> layer,
                    ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> norm, float eps,
                    ffi::ResultBuffer<ffi::F32> y) {
  const int32_t l = *layer.typed_data();
  if (auto e = CheckShapes(x.dimensions(), w.dimensions(), scale.dimensions(), norm.dimensions(), 8, l); e.failure())
    return e;
  const auto md = min.dimensions(), sd = scale.dimensions();
  if (md.size() != sd.size() || !std::equal(md.begin(), md.end(), sd.begin()))
    return ffi::Error::InvalidArgument("min must have scale's shape");
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], P = w.dimensions()[1];
  const int64_t scale_offset = l * P * (K / kBlock) * kPanel;
  const Weights weights{w.typed_data() + l * P * (K / 2) * kPanel,
                        reinterpret_cast<const uint16_t*>(scale.untyped_data()) + scale_offset,
                        reinterpret_cast<const uint16_t*>(min.untyped_data()) + scale_offset, P};
  Matmul<Q4_1>(pool, x.typed_data(), M, ValidRows(rows, M), K, NormOf(norm, l, K), eps, weights, y->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SluiceQ8Q8, Q8Q8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SluiceQ4Q8, Q4Q8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Whether this CPU runs the instructions the library was compiled for (checked before registering).
extern "C" __attribute__((target("default"))) int SluiceCpuSupported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
