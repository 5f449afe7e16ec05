// What the native ops share, defined once: the KV cache's tile of keys, the largest head and group sizes the
// attention kernels hold on the stack, and the widening of bfloat16 to float32 and the rounding back.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace smolserve {

// Positions per tile of keys in the KV cache's layout (engine/runtime/kv_cache.py KEY_TILE); a block of the
// cache (engine/core/config.py BLOCK_SIZE) is whole tiles.
constexpr int64_t kKeyTile = 16;
// The largest head dimension, and query heads per KV head, the attention kernels take.
constexpr int64_t kMaxHeadDim = 512;  // (Gemma 4's global layers)
constexpr int64_t kMaxGroups = 16;

// bfloat16 is the top half of a float32: widening is a shift, which vectorizes (c10's conversion does not).
// Exact, as c10's is.
inline float widen(c10::BFloat16 value) {
  uint32_t bits = static_cast<uint32_t>(value.x) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(float));
  return result;
}

inline float widen(float value) { return value; }

// To a row's dtype: float32 as it is; bfloat16 rounded to nearest even, as c10::BFloat16 does for finite values, in
// a form that vectorizes.
template <typename T>
inline T narrow(float value);

template <>
inline float narrow<float>(float value) {
  return value;
}

template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(float));
  bits += 0x7FFF + ((bits >> 16) & 1);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

}  // namespace smolserve
