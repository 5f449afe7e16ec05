// Software prefetch for kernels that do much arithmetic per byte they stream, where the hardware prefetcher alone
// falls behind:
// - the 8-bit decode attention's two streams (keys and values of one sequence and head): each 8-bit value is
//   widened to 16 bits before its multiply-add; without these requests the kernel took ~1.1x as long at 8 x 2048
//   positions. The bfloat16 and float32 kernels ran faster without.
// - the quantized matmul's weight blocks (quant_matmul.cpp): one decoding row over the default model's 66 MB of
//   Q4_1 layers took ~100 us a layer without, ~84 with (2 threads; 168 -> 134 us on one).
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
