// Work splitting for the CPU kernels: chunks claimed from a shared counter by the calling thread and by
// helpers scheduled on XLA's intra-op thread pool (the FFI `ThreadPool` context).
#ifndef SLUICE_CPU_PARALLEL_H_
#define SLUICE_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace sluice {

// Runs chunk(c) for c in [0, chunks) on the calling thread and on XLA's intra-op thread pool. Chunks are
// claimed from a shared counter, so the caller never waits for a helper to start: on a busy machine, where a
// woken helper may not run for milliseconds, the caller simply does more chunks itself (it waits only for
// chunks a helper has already claimed). A helper that starts after every chunk is claimed touches nothing
// but the shared counters, which it co-owns. Helpers number one less than the pool's threads: with the caller
// they fill the cores, and one more thread would only be descheduled.
struct ChunkCounters {
  explicit ChunkCounters(int64_t total) : total(total) {}
  const int64_t total;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <typename Chunk>
void Drain(ChunkCounters& counters, const Chunk& chunk) {
  for (int64_t c; (c = counters.next.fetch_add(1, std::memory_order_relaxed)) < counters.total;) {
    chunk(c);
    counters.done.fetch_add(1, std::memory_order_release);
  }
}

template <typename Chunk>
void ParallelChunks(xla::ffi::ThreadPool& pool, int64_t chunks, int64_t work, const Chunk& chunk) {
  constexpr int64_t kMinWorkPerHelper = 1 << 16;
  const int64_t helpers = std::min({pool.num_threads() - 1, chunks - 1, work / kMinWorkPerHelper});
  if (helpers <= 0) {
    for (int64_t c = 0; c < chunks; ++c) chunk(c);
    return;
  }
  auto counters = std::make_shared<ChunkCounters>(chunks);
  const Chunk* shared_chunk = &chunk;  // alive until every claimed chunk is done (the wait below)
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([counters, shared_chunk] { Drain(*counters, *shared_chunk); });
  Drain(*counters, chunk);
  for (int spins = 0; counters->done.load(std::memory_order_acquire) < chunks; ++spins) {
    if (spins < 4096) _mm_pause(); else std::this_thread::yield();
  }
}

}  // namespace sluice

#endif  // SLUICE_CPU_PARALLEL_H_
