// Float32 matmuls whose rows do not depend on each other, bit for bit: an XLA FFI custom call,
// `cpu_rows_matmul.py` holds its jnp reference.
//
//   x f32 [T, K], w f32 [G, K, N], first s32 [] -> y f32 [T, C, N]:  y[t, c] = x[t] @ w[first + c]
//
// XLA's dot picks its GEMM kernel and blocking by the number of rows, and with them the order in which each output
// sums over K: a row's last bits then depend on how many rows share the call. Here every output starts at zero and
// adds x[t, k] * w[k, n] for k = 0, 1, ..., K - 1 in order, one fused multiply-add each, whatever T, the tiling, the
// thread or the vector width: the AVX-512 and AVX2 builds give the same bits. (The portable build keeps the order;
// SIMDe's plain-C forms, as the x86 tests build it, multiply then add, with roundings of their own.)
//
// The w stack is passed whole with the index of its first matrix, so a layer scan never copies a layer. The work
// is split into tiles of up to 4 rows x 4 (AVX-512) or 2 (AVX2) vectors of columns, their accumulators in registers
// over the whole of K; the tiles go in chunks to XLA's intra-op threads.

#include <algorithm>
#include <cstdint>

#include "cpu_parallel.h"
#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---- A vector of kWidth columns: one register. The last vector of a row of w may be partial (`Lanes`: its first
// columns), loaded with zeros past them and stored only up to them.

#if defined(__AVX512F__)
constexpr int64_t kWidth = 16;
constexpr int kTileVectors = 4;  // 4 x 4 accumulators, of 32 registers

struct Floats { __m512 v; };
struct Lanes { __mmask16 m; };

inline Lanes FirstLanes(int64_t n) { return {static_cast<__mmask16>((1u << std::min<int64_t>(n, kWidth)) - 1)}; }
inline Floats ZeroFloats() { return {_mm512_setzero_ps()}; }
inline Floats Splat(const float* p) { return {_mm512_set1_ps(*p)}; }
inline Floats Load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Floats Load(const float* p, Lanes lanes) { return {_mm512_maskz_loadu_ps(lanes.m, p)}; }
inline Floats Fma(Floats a, Floats b, Floats c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline void Store(float* p, Floats a) { _mm512_storeu_ps(p, a.v); }
inline void Store(float* p, Floats a, Lanes lanes) { _mm512_mask_storeu_ps(p, lanes.m, a.v); }

#else
constexpr int64_t kWidth = 8;
constexpr int kTileVectors = 2;  // 4 x 2 accumulators, of 16 registers

struct Floats { __m256 v; };
struct Lanes { __m256i m; };

inline Lanes FirstLanes(int64_t n) {
  return {_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(n, kWidth))),
                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))};
}
inline Floats ZeroFloats() { return {_mm256_setzero_ps()}; }
inline Floats Splat(const float* p) { return {_mm256_broadcast_ss(p)}; }
inline Floats Load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline Floats Load(const float* p, Lanes lanes) { return {_mm256_maskload_ps(p, lanes.m)}; }
inline Floats Fma(Floats a, Floats b, Floats c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline void Store(float* p, Floats a) { _mm256_storeu_ps(p, a.v); }
inline void Store(float* p, Floats a, Lanes lanes) { _mm256_maskstore_ps(p, lanes.m, a.v); }
#endif

constexpr int kTileRows = 4;

// One matrix of the stack against the rows it multiplies: x [T, K] (row stride K), w [K, N], y [T, N] with row
// stride `y_stride` (C N: the matrices' outputs interleave per row).
struct Operands {
  const float* x;
  const float* w;
  float* y;
  int64_t K, N, y_stride;
};

// Rows [t, t + R) x columns [n, n + V kWidth) clipped to N: each output's sum over K in order, one FMA per input.
// Only the last vector can be partial; the others are loaded whole.
template <int R, int V>
void Tile(const Operands& o, int64_t t, int64_t n) {
  const Lanes last = FirstLanes(o.N - n - (V - 1) * kWidth);
  Floats acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = ZeroFloats();
  for (int64_t k = 0; k < o.K; ++k) {
    const float* w = o.w + k * o.N + n;
    Floats wv[V];
    for (int v = 0; v < V - 1; ++v) wv[v] = Load(w + v * kWidth);
    wv[V - 1] = Load(w + (V - 1) * kWidth, last);
    for (int r = 0; r < R; ++r) {
      const Floats xv = Splat(o.x + (t + r) * o.K + k);
      for (int v = 0; v < V; ++v) acc[r][v] = Fma(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* y = o.y + (t + r) * o.y_stride + n;
    for (int v = 0; v < V - 1; ++v) Store(y + v * kWidth, acc[r][v]);
    Store(y + (V - 1) * kWidth, acc[r][V - 1], last);
  }
}

// A tile of `rows` (<= kTileRows) x `vectors` (<= kTileVectors): the template instance of its size.
template <int R = kTileRows, int V = kTileVectors>
void TileOf(int64_t rows, int64_t vectors, const Operands& o, int64_t t, int64_t n) {
  if constexpr (R > 0 && V > 0) {
    if (rows < R) return TileOf<R - 1, V>(rows, vectors, o, t, n);
    if (vectors < V) return TileOf<R, V - 1>(rows, vectors, o, t, n);
    Tile<R, V>(o, t, n);
  }
}

// Tiles in chunks, about kChunksPerThread per thread, so a thread that starts late (a busy machine) leaves its
// share to the others. A chunk runs down the row tiles of one band of columns, whose weights then come from cache
// after the first tile.
constexpr int64_t kChunksPerThread = 4;
constexpr int64_t kBandColumns = kTileVectors * kWidth;

void Matmul(ffi::ThreadPool& pool, const float* x, const float* w, int64_t T, int64_t K, int64_t N, int64_t C,
            float* y) {
  const int64_t row_tiles = (T + kTileRows - 1) / kTileRows, bands = (N + kBandColumns - 1) / kBandColumns;
  const int64_t tiles = C * bands * row_tiles;
  const int64_t threads = pool.num_threads() + 1;
  const int64_t per_chunk = std::max<int64_t>(1, tiles / (threads * kChunksPerThread));
  sluice::ParallelChunks(pool, (tiles + per_chunk - 1) / per_chunk, T * K * N * C, [&](int64_t chunk) {
    for (int64_t tile = chunk * per_chunk; tile < std::min(tiles, (chunk + 1) * per_chunk); ++tile) {
      const int64_t c = tile / (bands * row_tiles), band = tile / row_tiles % bands, t = tile % row_tiles * kTileRows;
      const int64_t n = band * kBandColumns;
      const Operands o{x, w + c * K * N, y + c * N, K, N, C * N};
      TileOf(std::min<int64_t>(kTileRows, T - t), (std::min(kBandColumns, N - n) + kWidth - 1) / kWidth, o, t, n);
    }
  });
}

ffi::Error RowsMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                          ffi::Buffer<ffi::S32> first, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 3)
    return ffi::Error::InvalidArgument("x [T, K], w [G, K, N], y [T, C, N] expected");
  if (wd[1] != xd[1] || yd[0] != xd[0] || yd[2] != wd[2]) return ffi::Error::InvalidArgument("shapes disagree");
  const int64_t f = *first.typed_data(), C = yd[1];
  if (f < 0 || f + C > wd[0]) return ffi::Error::InvalidArgument("matrices [first, first + C) out of range");
  Matmul(pool, x.typed_data(), w.typed_data() + f * wd[1] * wd[2], xd[0], xd[1], wd[2], C, y->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SluiceRowsMatmul, RowsMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
