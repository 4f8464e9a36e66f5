// Quantized matmuls for the CPU, XLA FFI custom calls; `cpu_qmatmul.py` holds their jnp references.
//
// Weights stay in GGUF's block formats (Q8_0, Q4_1: one scale, and for Q4_1 one min, per 32 inputs of each
// output column). The float32 activations are quantized inside the call like llama.cpp's Q8 activations, per
// row in blocks of 32 inputs: xq = round(x * 127 / max|x|), d = max|x| / 127. Weights and activations then
// meet in integer dot products (vpdpbusd with AVX-512 VNNI: unsigned byte x signed byte, 4 products summed
// per int32 lane; AVX2's vpmaddubsw + vpmaddwd otherwise), turned into float once per block.
//
// Layouts (row-major). The output columns come in panels of 16 whose weights are contiguous over all of K
// (one sequential stream per panel), and within a panel one 64-byte lane holds 4 (Q8_0) or 8 (Q4_1)
// consecutive inputs of each of the 16 columns, a VNNI operand as it is (two 32-byte halves without AVX-512). Column n = 16 p + c:
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
// computes tiles of up to 8 rows (4 without AVX-512) x one panel over the whole of K, the last tile of a call
// exactly as tall as the rows left, the tile's accumulators in registers: integer within a block, float across
// blocks.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_simd.h"
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

// ---- A panel's 16 columns as SIMD values: `Ints` (16 int32 lanes, or the 64 bytes of 4 inputs of each column)
// and `Floats` (16 float32). One 512-bit register each with AVX-512 (F, BW, VNNI); two 256-bit halves otherwise,
// where vpdpbusd exists only with AVX-512 VL or AVX-VNNI and is otherwise emulated by vpmaddubsw + vpmaddwd.
// Zen 4 runs a 512-bit vpdpbusd as two 256-bit halves, so the wide form multiplies no faster; it issues half the
// instructions, and folds each row's broadcast into the vpdpbusd, which is what frees the pipes for the
// multiplies.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SLUICE_VNNI 1
constexpr int kMaxTileRows = 8;  // 8 float + 8 int accumulators, of 32 registers

struct Ints { __m512i v; };
struct Floats { __m512 v; };

inline Ints LoadInts(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline Ints SplatInts(int32_t v) { return {_mm512_set1_epi32(v)}; }
inline Ints ZeroInts() { return {_mm512_setzero_si512()}; }
inline Ints And(Ints a, Ints b) { return {_mm512_and_si512(a.v, b.v)}; }
inline Ints Xor(Ints a, Ints b) { return {_mm512_xor_si512(a.v, b.v)}; }
inline Ints ShiftRight4(Ints a) { return {_mm512_srli_epi16(a.v, 4)}; }
inline Ints DotU8S8(Ints acc, Ints u, Ints s) { return {_mm512_dpbusd_epi32(acc.v, u.v, s.v)}; }

inline Floats ZeroFloats() { return {_mm512_setzero_ps()}; }
inline Floats SplatFloats(float v) { return {_mm512_set1_ps(v)}; }
inline Floats ToFloats(Ints a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline Floats LoadHalves(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline Floats Mul(Floats a, Floats b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Floats Fma(Floats a, Floats b, Floats c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline void Store(float* p, Floats a) { _mm512_storeu_ps(p, a.v); }

#else
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define SLUICE_VNNI 1
#else
#define SLUICE_VNNI 0
#endif
constexpr int kMaxTileRows = 4;  // 16 registers: wider tiles spill

struct Ints { __m256i lo, hi; };
struct Floats { __m256 lo, hi; };

inline Ints LoadInts(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline Ints SplatInts(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline Ints ZeroInts() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline Ints And(Ints a, Ints b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
inline Ints Xor(Ints a, Ints b) { return {_mm256_xor_si256(a.lo, b.lo), _mm256_xor_si256(a.hi, b.hi)}; }
inline Ints ShiftRight4(Ints a) { return {_mm256_srli_epi16(a.lo, 4), _mm256_srli_epi16(a.hi, 4)}; }
inline __m256i DotU8S8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  // Pairs of u8 x s8 products summed to int16: no overflow while u <= 128 (4-bit values, |q| of Q8_0).
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
inline Ints DotU8S8(Ints acc, Ints u, Ints s) { return {DotU8S8(acc.lo, u.lo, s.lo), DotU8S8(acc.hi, u.hi, s.hi)}; }
// The pairs' int16 sums added to int16 lanes, and those lanes' pairs widened to int32 once: one vpmaddwd for many
// vpmaddubsw, where the sums stay below 2^15.
inline Ints AddPairs16(Ints acc, Ints u, Ints s) {
  return {_mm256_add_epi16(acc.lo, _mm256_maddubs_epi16(u.lo, s.lo)),
          _mm256_add_epi16(acc.hi, _mm256_maddubs_epi16(u.hi, s.hi))};
}
inline Ints Widen16(Ints a) {
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_madd_epi16(a.lo, ones), _mm256_madd_epi16(a.hi, ones)};
}
// |w| against x with w's sign moved onto x: the signed x signed product without VNNI.
inline Ints DotS8S8(Ints acc, Ints w, Ints x) {
  return {DotU8S8(acc.lo, _mm256_abs_epi8(w.lo), _mm256_sign_epi8(x.lo, w.lo)),
          DotU8S8(acc.hi, _mm256_abs_epi8(w.hi), _mm256_sign_epi8(x.hi, w.hi))};
}

inline Floats ZeroFloats() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Floats SplatFloats(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline Floats ToFloats(Ints a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline Floats LoadHalves(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline Floats Mul(Floats a, Floats b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Floats Fma(Floats a, Floats b, Floats c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline void Store(float* p, Floats a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
#endif

inline Ints Splat4Bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return SplatInts(v);
}

// ---- The two weight formats: how a 64-byte lane of a panel (4 bytes per column) becomes dot-product operands,
// and how a block's integer sums become float.

constexpr int64_t kPanel = 16;  // output columns whose packed weights are contiguous over K

struct Weights {
  const uint8_t* values;  // the layer's panels: [P, K/pack, 16, 4]
  const uint16_t* scale;  // [P, K/32, 16] f16
  const uint16_t* min;    // [P, K/32, 16] f16, Q4_1 only
  int64_t panels;
};

// Signed weights against signed activations. With VNNI: q + 128 (the sign bit flipped) as the unsigned side,
// and 128 * sum(xq) taken off per block (x.sum holds d * sum(xq)). Without: `DotS8S8`.
struct Q8_0 {
  static constexpr int kInputsPerLane = 4;  // a lane holds inputs 4j..4j+3 of its column
  static constexpr int kOperands = 1;
  static void Operands(Ints raw, Ints* out) {
    out[0] = SLUICE_VNNI ? Xor(raw, SplatInts(static_cast<int32_t>(0x80808080u))) : raw;
  }
  static Ints Dot(Ints acc, Ints w, Ints x) {
#if SLUICE_VNNI
    return DotU8S8(acc, w, x);
#else
    return DotS8S8(acc, w, x);
#endif
  }
  static Ints Widen(Ints dot) { return dot; }
  static Floats Flush(Floats acc, Ints dot, Floats scale, Floats /*min*/, float d, float sum) {
    acc = Fma(ToFloats(dot), Mul(scale, SplatFloats(d)), acc);
    return SLUICE_VNNI ? Fma(scale, SplatFloats(-128.0f * sum), acc) : acc;
  }
};

struct Q4_1 {
  static constexpr int kInputsPerLane = 8;  // inputs 8j..8j+3 in the low nibbles, 8j+4..8j+7 in the high ones
  static constexpr int kOperands = 2;
  static void Operands(Ints raw, Ints* out) {
    const Ints low_nibbles = SplatInts(0x0F0F0F0F);
    out[0] = And(raw, low_nibbles);
    out[1] = And(ShiftRight4(raw), low_nibbles);
  }
  // Without VNNI a block's products stay int16 until its end: 8 pair sums a lane, each at most 2 * 15 * 127, so at
  // most 30,480 (activations are within +-127). Exact, with one vpmaddwd a block instead of one per vpmaddubsw.
#if SLUICE_VNNI
  static Ints Dot(Ints acc, Ints w, Ints x) { return DotU8S8(acc, w, x); }
  static Ints Widen(Ints dot) { return dot; }
#else
  static Ints Dot(Ints acc, Ints w, Ints x) { return AddPairs16(acc, w, x); }
  static Ints Widen(Ints dot) { return Widen16(dot); }
#endif
  static Floats Flush(Floats acc, Ints dot, Floats scale, Floats min, float d, float sum) {
    acc = Fma(ToFloats(dot), Mul(scale, SplatFloats(d)), acc);
    return Fma(min, SplatFloats(sum), acc);
  }
};

// ---- A tile: R rows x one panel over all of K, its accumulators in registers.

// How far ahead of its loads a tile asks for the weights (into the next panel at a panel's end, which the next tile
// reads; a prefetch past the end of the weights is harmless). At a few rows a step streams every weight from
// memory once, faster with this prefetch than with the hardware prefetcher alone (bench/RESULTS.md).
constexpr int64_t kPrefetchBytes = 4096;

template <class F, int R>
void Tile(const QuantizedRows& x, int64_t m, const Weights& w, int64_t p, float* y) {
  constexpr int64_t kLanesPerBlock = kBlock / F::kInputsPerLane;
  constexpr int64_t kLaneBytes = 4 * kPanel;
  const int64_t blocks = x.Blocks(), N = w.panels * kPanel;
  const uint8_t* panel = w.values + p * (x.cols / F::kInputsPerLane) * kLaneBytes;
  Floats acc[R];
  for (int r = 0; r < R; ++r) acc[r] = ZeroFloats();
  for (int64_t b = 0; b < blocks; ++b) {
    Ints dot[R];
    for (int r = 0; r < R; ++r) dot[r] = ZeroInts();
    for (int64_t j = b * kLanesPerBlock; j < (b + 1) * kLanesPerBlock; ++j) {
      Ints ops[F::kOperands];
      _mm_prefetch(reinterpret_cast<const char*>(panel + j * kLaneBytes + kPrefetchBytes), _MM_HINT_T0);
      F::Operands(LoadInts(panel + j * kLaneBytes), ops);
      for (int o = 0; o < F::kOperands; ++o)
        for (int r = 0; r < R; ++r)
          dot[r] = F::Dot(dot[r], ops[o], Splat4Bytes(x.Row(m + r) + F::kInputsPerLane * j + 4 * o));
    }
    const int64_t at = (p * blocks + b) * kPanel;
    const Floats scale = LoadHalves(w.scale + at);
    const Floats min = w.min != nullptr ? LoadHalves(w.min + at) : ZeroFloats();
    for (int r = 0; r < R; ++r) {
      const int64_t row_block = (m + r) * blocks + b;
      acc[r] = F::Flush(acc[r], F::Widen(dot[r]), scale, min, x.d[row_block], x.sum[row_block]);
    }
  }
  for (int r = 0; r < R; ++r) Store(y + (m + r) * N + p * kPanel, acc[r]);
}

// The last `rows` (< kMaxTileRows) rows from m, as one tile.
template <class F, int R = kMaxTileRows - 1>
void LastTile(int64_t rows, const QuantizedRows& x, int64_t m, const Weights& w, int64_t p, float* y) {
  if constexpr (R > 0) {
    if (rows == R) return Tile<F, R>(x, m, w, p, y);
    LastTile<F, R - 1>(rows, x, m, w, p, y);
  }
}

// Panels [p_begin, p_end) of every row: a panel's weights come from memory for the first row tile and from
// cache for the others.
template <class F>
void Panels(const QuantizedRows& x, const Weights& w, int64_t p_begin, int64_t p_end, float* y) {
  const int64_t full = x.rows - x.rows % kMaxTileRows;
  for (int64_t p = p_begin; p < p_end; ++p) {
    for (int64_t m = 0; m < full; m += kMaxTileRows) Tile<F, kMaxTileRows>(x, m, w, p, y);
    LastTile<F>(x.rows - full, x, full, w, p, y);
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

// Whether this CPU runs the instructions the library was compiled for (checked before registering): those the
// compiler was allowed (the variant's flags in cpu_build.py, and $SLUICE_CXXFLAGS), none on the portable build
// at the default -march. This one function is compiled for any x86 CPU, so that a CPU lacking them gets an answer.
#if defined(__x86_64__)
extern "C" __attribute__((target("default"))) int SluiceCpuSupported() {
  __builtin_cpu_init();
  int supported = 1;
#if defined(__AVX2__)
  supported = supported && __builtin_cpu_supports("avx2");
#endif
#if defined(__FMA__)
  supported = supported && __builtin_cpu_supports("fma");
#endif
#if defined(__F16C__)
  supported = supported && __builtin_cpu_supports("f16c");
#endif
#if defined(__AVX512F__)
  supported = supported && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512vl");
#endif
#if defined(__AVX512VNNI__)
  supported = supported && __builtin_cpu_supports("avx512vnni");
#endif
#if defined(__AVXVNNI__)
  supported = supported && __builtin_cpu_supports("avxvnni");
#endif
  return supported;
}
#else
// The portable build, elsewhere: it needs only the architecture's baseline (NEON on ARM64).
extern "C" int SluiceCpuSupported() { return 1; }
#endif
