// Software prefetch for the 8-bit decode kernel's two streams (keys and values of one sequence and head).
//
// Per byte read it does more arithmetic than the bfloat16 kernel (each 8-bit value is widened to 16 bits before
// its multiply-add), and the hardware prefetcher alone fell behind: in its three passes without these requests
// the kernel took ~1.1x as long at 8 x 2048 positions. The bfloat16 and float32 kernels ran faster without.
#pragma once

#include <cstdint>

namespace smolserve {

// How far ahead of what is being read the lines are asked for (into L2: locality 2).
constexpr int64_t kPrefetchBytes = 4096;

// Prefetches the `bytes` (whole 64-byte lines) that start kPrefetchBytes past `from`. Past the end of the
// cache this only wastes a request: a prefetch never faults.
inline void prefetch_ahead(const void* from, int64_t bytes) {
  const char* ahead = static_cast<const char*>(from) + kPrefetchBytes;
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(ahead + line, 0, 2);
}

}  // namespace smolserve
