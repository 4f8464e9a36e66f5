// Quantized-weight matmuls for the CPU (AVX2 + FMA + F16C, split over XLA's intra-op threads), registered with XLA
// through the typed FFI; `cpu_qmatmul.py` holds the jnp references with the same semantics.
//
// Weights stay quantized in memory and are widened to float32 in registers, a vector at a time, right
// before the FMA with float32 activations (weight-only quantization: no activation rounding). At batch 1
// the step is bound by reading the weights, so fewer weight bytes are the whole gain; at a few rows each
// widened weight vector is reused for every row of the tile.
//
// Layouts (row-major):
//   q8_kn: x f32 [M, K], w s8 [L, K, N], scale f32 [L, N], layer s32 []  ->  y f32 [M, N]
//          y[m, n] = scale[layer, n] * sum_k x[m, k] * w[layer, k, n]
//   q8_nk: x f32 [M, K], w s8 [N, K], scale f32 [N]                         ->  y f32 [M, N]
//          y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]          (an embedding table used as LM head)
//   q4_kn: x f32 [M, K], w u8 [L, K/2, N], gscale, gmin f16 [L, K/32, N], layer s32 [] -> y f32 [M, N]
//          w[k, n] = q * gscale[k/32, n] + gmin[k/32, n], q = 4-bit value of k at byte (k/2, n):
//          low nibble for even k, high nibble for odd k.
// The stacked [L, ...] weights are passed whole with the layer index, so a layer scan never copies a
// layer's slice out of the stack before the call.

#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kGroup = 32;  // q4 scale/min group along K

inline __m256 Widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 LoadHalf8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Column ranges handed out as chunks: multiples of kColumnUnit, about kChunksPerThread per thread.
constexpr int64_t kColumnUnit = 64;
constexpr int64_t kChunksPerThread = 4;

int64_t ChunkColumns(ffi::ThreadPool& pool, int64_t N) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads() + 1);
  const int64_t per_chunk = (N + threads * kChunksPerThread - 1) / (threads * kChunksPerThread);
  return std::max(kColumnUnit, (per_chunk + kColumnUnit - 1) / kColumnUnit * kColumnUnit);
}

// ---- q8_kn: R rows x 8*NV columns per tile (R * NV = 8 accumulators), K walked in blocks of kKBlock rows.
// Walking all of K for one narrow column tile would read each weight row's cache line with a stride of N
// bytes, a new page every row or two, which the hardware prefetcher does not follow; a block of rows read
// across all columns is kKBlock sequential streams. The partial sums live in y between blocks.

constexpr int64_t kKBlock = 16;

template <int R, int NV>
void Q8KnTile(const float* x, int64_t K, int64_t k0, int64_t k1, const int8_t* w, int64_t N,
              const float* scale, float* y) {
  __m256 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * N + 8 * v);
  for (int64_t k = k0; k < k1; ++k) {
    const int8_t* wk = w + k * N;
    __m256 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = Widen8(wk + 8 * v);
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * K + k);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(xr, wv[v], acc[r][v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const __m256 s = k1 == K ? _mm256_loadu_ps(scale + 8 * v) : _mm256_set1_ps(1.0f);
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N + 8 * v, _mm256_mul_ps(acc[r][v], s));
  }
}

template <int R>
struct Q8KnRowTile {
  static void Run(const float* x, float* y, int64_t K, int64_t k0, int64_t k1, const int8_t* w, int64_t N,
                  const float* scale, int64_t n_begin, int64_t n_end) {
    constexpr int NV = 8 / R;
    int64_t n = n_begin;
    for (; n + 8 * NV <= n_end; n += 8 * NV) Q8KnTile<R, NV>(x, K, k0, k1, w + n, N, scale + n, y + n);
    for (; n < n_end; n += 8) Q8KnTile<R, 1>(x, K, k0, k1, w + n, N, scale + n, y + n);
  }
};

// Calls Rows<R>::Run over the M rows in tiles of 4, then 2, then 1.
template <template <int> class Rows, typename... Args>
void OverRowTiles(int64_t M, int64_t K, int64_t N, const float* x, float* y, Args... args) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) Rows<4>::Run(x + m * K, y + m * N, args...);
  for (; m + 2 <= M; m += 2) Rows<2>::Run(x + m * K, y + m * N, args...);
  for (; m < M; ++m) Rows<1>::Run(x + m * K, y + m * N, args...);
}

// ---- q8_nk: R rows x NN weight rows per tile, dot products along K.

template <int R, int NN>
void Q8NkTile(const float* x, int64_t K, const int8_t* w, const float* scale, float* y, int64_t N) {
  __m256 acc[R][NN];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NN; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NN];
    for (int j = 0; j < NN; ++j) wv[j] = Widen8(w + j * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_loadu_ps(x + r * K + k);
      for (int j = 0; j < NN; ++j) acc[r][j] = _mm256_fmadd_ps(xr, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NN; ++j) y[r * N + j] = scale[j] * HorizontalSum(acc[r][j]);
}

template <int R>
struct Q8NkRowTile {
  static void Run(const float* x, float* y, int64_t K, const int8_t* w, int64_t N, const float* scale,
                  int64_t n_begin, int64_t n_end) {
    constexpr int NN = 8 / R;
    int64_t n = n_begin;
    for (; n + NN <= n_end; n += NN) Q8NkTile<R, NN>(x, K, w + n * K, scale + n, y + n, N);
    for (; n < n_end; ++n) Q8NkTile<R, 1>(x, K, w + n * K, scale + n, y + n, N);
  }
};

// ---- q4_kn: R rows x 8*NV columns per tile, one group of 32 k (16 byte rows) per pass over the columns
// (the same streaming argument as q8_kn); the group's scale and min stay in registers.

template <int R, int NV>
void Q4KnTile(const float* x, int64_t K, int64_t g, const uint8_t* w, const uint16_t* gscale,
              const uint16_t* gmin, int64_t N, float* y) {
  const __m256i low_nibble = _mm256_set1_epi32(0xF);
  __m256 acc[R][NV], d[NV], mn[NV];
  for (int v = 0; v < NV; ++v) {
    d[v] = LoadHalf8(gscale + g * N + 8 * v);
    mn[v] = LoadHalf8(gmin + g * N + 8 * v);
    for (int r = 0; r < R; ++r) acc[r][v] = g == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * N + 8 * v);
  }
  for (int64_t pair = g * kGroup / 2; pair < (g + 1) * kGroup / 2; ++pair) {
    const uint8_t* wp = w + pair * N;
    for (int v = 0; v < NV; ++v) {
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wp + 8 * v)));
      const __m256 w_even = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, low_nibble)), d[v], mn[v]);
      const __m256 w_odd = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)), d[v], mn[v]);
      for (int r = 0; r < R; ++r) {
        acc[r][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * K + 2 * pair), w_even, acc[r][v]);
        acc[r][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * K + 2 * pair + 1), w_odd, acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(y + r * N + 8 * v, acc[r][v]);
}

template <int R>
struct Q4KnRowTile {
  static void Run(const float* x, float* y, int64_t K, int64_t g, const uint8_t* w, const uint16_t* gscale,
                  const uint16_t* gmin, int64_t N, int64_t n_begin, int64_t n_end) {
    constexpr int NV = R == 1 ? 4 : 2;
    int64_t n = n_begin;
    for (; n + 8 * NV <= n_end; n += 8 * NV) Q4KnTile<R, NV>(x, K, g, w + n, gscale + n, gmin + n, N, y + n);
    for (; n < n_end; n += 8) Q4KnTile<R, 1>(x, K, g, w + n, gscale + n, gmin + n, N, y + n);
  }
};

ffi::Error CheckLayer(int32_t layer, int64_t num_layers) {
  if (layer < 0 || layer >= num_layers) return ffi::Error::InvalidArgument("layer index out of range");
  return ffi::Error::Success();
}

ffi::Error Q8KnImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                    ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || scale.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("q8_kn: x [M, K], w [L, K, N], scale [L, N]");
  const int64_t M = xd[0], K = xd[1], L = wd[0], N = wd[2];
  if (wd[1] != K || N % 8 || scale.dimensions()[1] != N)
    return ffi::Error::InvalidArgument("q8_kn: shapes disagree (N must be a multiple of 8)");
  const int32_t l = *layer.typed_data();
  if (auto e = CheckLayer(l, L); e.failure()) return e;
  const int8_t* wl = w.typed_data() + l * K * N;
  const float* sl = scale.typed_data() + l * N;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const int64_t cols = ChunkColumns(pool, N);
  sluice::ParallelChunks(pool, (N + cols - 1) / cols, M * K * N, [&](int64_t c) {
    for (int64_t k0 = 0; k0 < K; k0 += kKBlock)
      OverRowTiles<Q8KnRowTile>(M, K, N, xp, yp, K, k0, std::min(K, k0 + kKBlock), wl, N, sl, c * cols,
                                std::min(N, (c + 1) * cols));
  });
  return ffi::Error::Success();
}

ffi::Error Q8NkImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                    ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || scale.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("q8_nk: x [M, K], w [N, K], scale [N]");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (wd[1] != K || K % 8 || scale.dimensions()[0] != N)
    return ffi::Error::InvalidArgument("q8_nk: shapes disagree (K must be a multiple of 8)");
  const int8_t* wp = w.typed_data();
  const float* sp = scale.typed_data();
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const int64_t cols = ChunkColumns(pool, N);
  sluice::ParallelChunks(pool, (N + cols - 1) / cols, M * K * N, [&](int64_t c) {
    OverRowTiles<Q8NkRowTile>(M, K, N, xp, yp, K, wp, N, sp, c * cols, std::min(N, (c + 1) * cols));
  });
  return ffi::Error::Success();
}

ffi::Error Q4KnImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                    ffi::Buffer<ffi::F16> gscale, ffi::Buffer<ffi::F16> gmin, ffi::Buffer<ffi::S32> layer,
                    ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = gscale.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3 || gmin.dimensions().size() != 3)
    return ffi::Error::InvalidArgument("q4_kn: x [M, K], w [L, K/2, N], gscale and gmin [L, K/32, N]");
  const int64_t M = xd[0], K = xd[1], L = wd[0], N = wd[2];
  if (K % kGroup || wd[1] * 2 != K || N % 8 || sd[1] * kGroup != K || sd[2] != N ||
      gmin.dimensions()[1] != sd[1] || gmin.dimensions()[2] != N)
    return ffi::Error::InvalidArgument("q4_kn: shapes disagree (K a multiple of 32, N of 8)");
  const int32_t l = *layer.typed_data();
  if (auto e = CheckLayer(l, L); e.failure()) return e;
  const uint8_t* wl = w.typed_data() + l * (K / 2) * N;
  const auto* gs = reinterpret_cast<const uint16_t*>(gscale.untyped_data()) + l * (K / kGroup) * N;
  const auto* gm = reinterpret_cast<const uint16_t*>(gmin.untyped_data()) + l * (K / kGroup) * N;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const int64_t cols = ChunkColumns(pool, N);
  sluice::ParallelChunks(pool, (N + cols - 1) / cols, M * K * N, [&](int64_t c) {
    for (int64_t g = 0; g < K / kGroup; ++g)
      OverRowTiles<Q4KnRowTile>(M, K, N, xp, yp, K, g, wl, gs, gm, N, c * cols, std::min(N, (c + 1) * cols));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SluiceQ8Kn, Q8KnImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SluiceQ8Nk, Q8NkImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SluiceQ4Kn, Q4KnImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Whether this CPU runs the instructions the library was compiled for (checked before registering).
extern "C" __attribute__((target("default"))) int SluiceCpuSupported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
