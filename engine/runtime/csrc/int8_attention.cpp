// Decode attention over an 8-bit KV cache, and the write that quantizes each new token into it.
//
// At long contexts a decode step is bound by reading the cache: 8 sequences x 2048 positions of SmolLM2 are
// 377 MB of bfloat16 K/V a step. Held in 8 bits, with one float scale per position and KV head (symmetric,
// absmax / 127), the same cache is 196 MB, and the scores run on 8-bit dot products (AVX512-VNNI `vpdpbusd`:
// 64 multiply-adds an instruction, twice bfloat16's `dpbf16`):
//
// - Keys are stored offset by 128 (uint8), in tiles of 16 positions laid out [dim / 4][16][4]: one 64-byte
//   row holds the same four dims of 16 positions, so a query's 16 scores accumulate lane-wise. The query is
//   quantized to int8 with a scale per 32 dims; sum (k + 128) q - 128 sum q is the exact integer dot
//   product, scaled back by the query's scales and each position's.
// - Values are stored as int8 in pairs of positions laid out [dim][2]: 32 bytes widen to 16 dims of two
//   positions in int16, multiplied by the two positions' probabilities (times each position's scale) as
//   int16 against the block's largest (`vpdpwssd`), so the weights keep 15 bits.
//
// The cache is in blocks (block_table.h): each head's positions are one run of whole blocks, read through each
// row's block table; a block is whole tiles, so a tile and a pair of positions never straddle two blocks.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "block_softmax.h"
#include "block_table.h"
#include "common.h"
#include "ops.h"
#include "prefetch.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define SMOLSERVE_VNNI 1
#endif

namespace {

using smolserve::kKeyTile;
using smolserve::kMaxGroups;
using smolserve::kMaxHeadDim;
constexpr int64_t kScoreBlock = 64;  // positions per block of scores and weights (whole tiles)
constexpr int64_t kQueryChunk = 32;  // dims per scale of the quantized query
constexpr float kWeightMax = 32767.0f;

using smolserve::widen;

// Symmetric 8-bit quantization of `dim` values: out[d] = round(x[d] / scale), scale = max |x| / 127 (1 for zeros).
template <typename T>
inline float quantize(const T* x, int64_t dim, int8_t* out) {
  float most = 0.0f;
  for (int64_t d = 0; d < dim; ++d) most = std::max(most, std::abs(widen(x[d])));
  const float scale = most > 0.0f ? most / 127.0f : 1.0f;
  const float inverse = 1.0f / scale;
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<int8_t>(std::nearbyint(widen(x[d]) * inverse));
  return scale;
}

// Byte offsets of (position, dim) inside one head's positions, in the two layouts above.
inline int64_t key_offset(int64_t position, int64_t dim_index, int64_t dim) {
  return (position / kKeyTile) * kKeyTile * dim + (dim_index / 4) * kKeyTile * 4 + (position % kKeyTile) * 4 + dim_index % 4;
}
inline int64_t value_offset(int64_t position, int64_t dim_index, int64_t dim) {
  return (position / 2) * 2 * dim + dim_index * 2 + position % 2;
}

// Probabilities times each position's value scale, as int16 against the block's largest (zero past `count`);
// returns the factor that turns the integer sums back into float.
inline float quantize_weights(const float* p, const float* value_scales, int64_t count, int16_t* weights) {
  float scaled[kScoreBlock];
  float most = 0.0f;
#pragma omp simd reduction(max : most)
  for (int64_t t = 0; t < count; ++t) {
    scaled[t] = p[t] * value_scales[t];
    most = std::max(most, scaled[t]);
  }
  const float inverse = most > 0.0f ? kWeightMax / most : 0.0f;
#pragma omp simd
  for (int64_t t = 0; t < count; ++t) weights[t] = static_cast<int16_t>(std::nearbyint(scaled[t] * inverse));
  std::fill(weights + count, weights + kScoreBlock, int16_t{0});
  return most / kWeightMax;
}

// Everything one (row, KV head) needs: its `groups` query rows and output rows, its head's run of the cache
// (keys, values and their scales, indexed by physical position) and where each of its tiles starts there.
template <typename T>
struct Item {
  const T* query;
  const uint8_t* keys;
  const int8_t* values;
  const float* key_scales;
  const float* value_scales;
  const int64_t* tiles;
  T* out;
  int64_t groups, dim, length;
  float scale;
  int64_t skip;  // positions of the first tile before a sliding window: no weight
  const float* sinks;  // the query rows' attention sinks (decode_attention's), or nullptr

  // The physical position of the row's position `p`.
  int64_t at(int64_t p) const { return tiles[p / kKeyTile] + p % kKeyTile; }

  // The value scales of positions start..start+count-1, gathered (they may lie in several blocks).
  void value_scales_of(int64_t start, int64_t count, float* out_scales) const {
    for (int64_t t = 0; t < count; t += kKeyTile) {
      const int64_t n = std::min(kKeyTile, count - t);
      std::memcpy(out_scales + t, value_scales + at(start + t), n * sizeof(float));
    }
  }
};

// The query rows in int8, a scale per 32 dims, with what turns a chunk's integer dot product with the offset
// keys back into a score: (sum - correction) * factor, times the position's scale.
template <typename T>
struct QuantizedQuery {
  static constexpr int64_t kChunks = kMaxHeadDim / kQueryChunk;
  alignas(64) int8_t q[kMaxGroups][kMaxHeadDim];
  int32_t correction[kMaxGroups][kChunks];
  float factor[kMaxGroups][kChunks];

  explicit QuantizedQuery(const Item<T>& item) {
    for (int64_t g = 0; g < item.groups; ++g) {
      for (int64_t c = 0; c * kQueryChunk < item.dim; ++c) {
        const int64_t first = c * kQueryChunk, size = std::min(kQueryChunk, item.dim - first);
        factor[g][c] = quantize(item.query + g * item.dim + first, size, &q[g][first]) * item.scale;
        int32_t sum = 0;
        for (int64_t d = first; d < first + size; ++d) sum += q[g][d];
        correction[g][c] = 128 * sum;
      }
    }
  }
};

// Any head size and CPU: plain loops over the same layouts and the same arithmetic, so the op works everywhere.
template <typename T>
void attend_portable(const Item<T>& item) {
  const int64_t dim = item.dim, groups = item.groups;
  const QuantizedQuery<T> query(item);
  float acc[kMaxGroups][kMaxHeadDim] = {};
  float scores[kScoreBlock];
  int16_t weights[kScoreBlock];
  float running_max[kMaxGroups], total[kMaxGroups];
  std::fill(running_max, running_max + groups, -std::numeric_limits<float>::infinity());
  std::fill(total, total + groups, 0.0f);
  for (int64_t start = 0; start < item.length; start += kScoreBlock) {
    const int64_t count = std::min(kScoreBlock, item.length - start);
    float value_scales[kScoreBlock];
    item.value_scales_of(start, count, value_scales);
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t t = 0; t < count; ++t) {
        float score = 0.0f;
        for (int64_t c = 0; c * kQueryChunk < dim; ++c) {
          int32_t sum = 0;
          for (int64_t d = c * kQueryChunk; d < std::min(dim, (c + 1) * kQueryChunk); ++d) {
            sum += item.keys[key_offset(item.at(start + t), d, dim)] * query.q[g][d];
          }
          score += static_cast<float>(sum - query.correction[g][c]) * query.factor[g][c];
        }
        scores[t] = score * item.key_scales[item.at(start + t)];
      }
      if (start == 0) smolserve::mask_leading(scores, item.skip);  // exp(-inf) is 0 in softmax_block
      const float correction = smolserve::softmax_block(scores, count, running_max[g], total[g]);
      const float factor = quantize_weights(scores, value_scales, count, weights);
      for (int64_t d = 0; d < dim; ++d) {
        int32_t sum = 0;
        for (int64_t t = 0; t < count; ++t) sum += weights[t] * item.values[value_offset(item.at(start + t), d, dim)];
        acc[g][d] = acc[g][d] * correction + static_cast<float>(sum) * factor;
      }
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    const float denominator = total[g] + smolserve::sink_term(item.sinks, g, running_max[g]);
    for (int64_t d = 0; d < dim; ++d) item.out[g * dim + d] = static_cast<T>(acc[g][d] / denominator);
  }
}

#if defined(SMOLSERVE_VNNI)
// quantize_weights for a whole block of probabilities, zero past `count` (as softmax_row_avx512 leaves them).
inline float quantize_weights_avx512(const float* p, const float* value_scales, int64_t count, int16_t* weights) {
  constexpr int64_t kRegisters = kScoreBlock / 16;
  __m512 scaled[kRegisters];
  __m512 most = _mm512_setzero_ps();
  for (int64_t i = 0; i < kRegisters; ++i) {
    const int64_t left = std::clamp<int64_t>(count - 16 * i, 0, 16);
    const __m512 scales = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1u), value_scales + 16 * i);
    scaled[i] = _mm512_mul_ps(_mm512_load_ps(p + 16 * i), scales);
    most = _mm512_max_ps(most, scaled[i]);
  }
  const float largest = _mm512_reduce_max_ps(most);
  const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? kWeightMax / largest : 0.0f);
  for (int64_t i = 0; i < kRegisters; ++i) {
    const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(scaled[i], inverse));
    _mm256_store_si256(reinterpret_cast<__m256i*>(weights + 16 * i), _mm512_cvtepi32_epi16(rounded));
  }
  return largest / kWeightMax;
}

// One tile's scores for `Groups` query rows: a vpdpbusd per four dims and row, one sum per 32 dims.
template <int64_t Dim, int Groups, typename T>
inline void score_tile(const uint32_t (*query_quads)[Dim / 4], const QuantizedQuery<T>& query, int64_t first,
                       const uint8_t* tile, const float* key_scales, float* const* scores, int64_t offset) {
  constexpr int64_t kChunks = Dim / kQueryChunk;
  __m512i sums[Groups][kChunks];
  for (int g = 0; g < Groups; ++g) {
    for (int64_t c = 0; c < kChunks; ++c) sums[g][c] = _mm512_setzero_si512();
  }
  for (int64_t j = 0; j < Dim / 4; ++j) {
    const __m512i keys = _mm512_loadu_si512(tile + 64 * j);
    for (int g = 0; g < Groups; ++g) {
      const __m512i quad = _mm512_set1_epi32(static_cast<int>(query_quads[g][j]));
      sums[g][j / 8] = _mm512_dpbusd_epi32(sums[g][j / 8], keys, quad);
    }
  }
  const __m512 scales = _mm512_loadu_ps(key_scales);
  for (int g = 0; g < Groups; ++g) {
    __m512 score = _mm512_setzero_ps();
    for (int64_t c = 0; c < kChunks; ++c) {
      const __m512i dot = _mm512_sub_epi32(sums[g][c], _mm512_set1_epi32(query.correction[first + g][c]));
      score = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(query.factor[first + g][c]), score);
    }
    _mm512_store_ps(scores[g] + offset, _mm512_mul_ps(score, scales));
  }
}

// `Groups` query rows of head size `Dim` at once, in three passes as the bfloat16 kernel takes them: every
// score from one stream of keys, the softmax over whole rows, then the weighted sum from one stream of values,
// whose probabilities are quantized per block of kScoreBlock positions. Each tile of keys and pair of values is
// loaded once for all rows, and their sums stay in registers.
template <typename T, int64_t Dim, int Groups>
void attend_vnni(const Item<T>& item, const QuantizedQuery<T>& query, int64_t first) {
  constexpr int64_t kRows = Dim / 16;  // 16 dims of a pair of positions widen to one register
  alignas(64) uint32_t query_quads[Groups][Dim / 4];
  alignas(64) int16_t weights[Groups][kScoreBlock];
  alignas(64) float acc[Groups][Dim] = {};
  for (int g = 0; g < Groups; ++g) std::memcpy(query_quads[g], query.q[first + g], Dim);
  float* scores[Groups];
  const int64_t width = smolserve::score_rows(item.length, scores);
  for (int64_t t = 0; t < item.length; t += kKeyTile) {
    const int64_t tile = item.tiles[t / kKeyTile];
    smolserve::prefetch_ahead(item.keys + tile * Dim, kKeyTile * Dim);
    score_tile<Dim, Groups>(query_quads, query, first, item.keys + tile * Dim, item.key_scales + tile, scores, t);
  }
  float total[Groups], factor[Groups];
  for (int g = 0; g < Groups; ++g) {
    smolserve::mask_leading(scores[g], item.skip);
    float row_max;
    total[g] = smolserve::softmax_row_avx512(scores[g], item.length, width, &row_max);
    total[g] += smolserve::sink_term(item.sinks, first + g, row_max);
    smolserve::zero_leading(scores[g], item.skip);
  }
  for (int64_t start = 0; start < item.length; start += kScoreBlock) {
    const int64_t count = std::min(kScoreBlock, item.length - start);
    float value_scales[kScoreBlock];
    item.value_scales_of(start, count, value_scales);
    for (int g = 0; g < Groups; ++g) {
      factor[g] = quantize_weights_avx512(scores[g] + start, value_scales, count, weights[g]);
    }
    __m512i sums[Groups][kRows];
    for (int g = 0; g < Groups; ++g) {
      for (int64_t r = 0; r < kRows; ++r) sums[g][r] = _mm512_setzero_si512();
    }
    for (int64_t t = 0; t < count; t += 2) {
      const int8_t* pair_values = item.values + item.at(start + t) * Dim;  // t even: a pair shares a tile
      smolserve::prefetch_ahead(pair_values, 2 * Dim);
      __m512i pair[Groups];
      for (int g = 0; g < Groups; ++g) {
        uint32_t packed;
        std::memcpy(&packed, &weights[g][t], sizeof(packed));
        pair[g] = _mm512_set1_epi32(static_cast<int>(packed));
      }
      for (int64_t r = 0; r < kRows; ++r) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair_values + 32 * r));
        const __m512i values = _mm512_cvtepi8_epi16(bytes);
        for (int g = 0; g < Groups; ++g) sums[g][r] = _mm512_dpwssd_epi32(sums[g][r], pair[g], values);
      }
    }
    for (int g = 0; g < Groups; ++g) {
      const __m512 scale = _mm512_set1_ps(factor[g]);
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512 sum = _mm512_cvtepi32_ps(sums[g][r]);
        _mm512_store_ps(&acc[g][16 * r], _mm512_fmadd_ps(sum, scale, _mm512_load_ps(&acc[g][16 * r])));
      }
    }
  }
  for (int g = 0; g < Groups; ++g) {
    const float inverse = 1.0f / total[g];
    T* out = item.out + (first + g) * Dim;
    for (int64_t d = 0; d < Dim; ++d) out[d] = static_cast<T>(acc[g][d] * inverse);
  }
}

// All query rows of one item, as many at a time as keep their sums in registers (4 at 64, 2 at 128).
template <typename T, int64_t Dim>
void attend_vnni_groups(const Item<T>& item) {
  constexpr int kMost = Dim == 64 ? 4 : 2;
  const QuantizedQuery<T> query(item);
  for (int64_t first = 0; first < item.groups; first += kMost) {
    const int64_t n = std::min<int64_t>(kMost, item.groups - first);
    if (n == 1) attend_vnni<T, Dim, 1>(item, query, first);
    if (n == 2) attend_vnni<T, Dim, 2>(item, query, first);
    if constexpr (kMost == 4) {
      if (n == 3) attend_vnni<T, Dim, 3>(item, query, first);
      if (n == 4) attend_vnni<T, Dim, 4>(item, query, first);
    }
  }
}
#endif

template <typename T>
void attend(const Item<T>& item) {
#if defined(SMOLSERVE_VNNI)
  if (item.dim == 64) return attend_vnni_groups<T, 64>(item);
  if (item.dim == 128) return attend_vnni_groups<T, 128>(item);
#endif
  attend_portable(item);
}

void check_cache(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& key_scales,
                 const at::Tensor& value_scales) {
  TORCH_CHECK(keys.dim() == 3 && values.dim() == 3, "expected 3-d keys and values [kv_heads, positions, dim]");
  TORCH_CHECK(keys.scalar_type() == at::kByte && values.scalar_type() == at::kByte, "an 8-bit cache is uint8");
  TORCH_CHECK(key_scales.scalar_type() == at::kFloat && value_scales.scalar_type() == at::kFloat,
              "scales are float32");
  TORCH_CHECK(keys.sizes() == values.sizes() && key_scales.sizes() == keys.sizes().slice(0, 2) &&
                  value_scales.sizes() == key_scales.sizes(),
              "keys, values and their scales disagree in shape");
  for (const at::Tensor* t : {&keys, &values}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "each head's positions must be contiguous");
  }
  TORCH_CHECK(key_scales.stride(1) == 1 && value_scales.stride(1) == 1, "each head's scales must be contiguous");
  TORCH_CHECK(keys.size(1) % kKeyTile == 0 && keys.size(2) % 4 == 0 && keys.size(2) <= kMaxHeadDim,
              "positions come in tiles of 16, dims in fours (at most 512)");
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& key_scales,
         const at::Tensor& value_scales, at::Tensor& out, const smolserve::BlockTables& tables, float scale,
         const float* sinks) {
  const int64_t heads = q.size(1), groups = q.size(2), dim = q.size(3);
  at::parallel_for(0, q.size(0) * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t i = index / heads, h = index % heads, first = tables.first_tile(i);
      const Item<T> item{
          q.const_data_ptr<T>() + index * groups * dim,
          keys.const_data_ptr<uint8_t>() + h * keys.stride(0),
          reinterpret_cast<const int8_t*>(values.const_data_ptr<uint8_t>()) + h * values.stride(0),
          key_scales.const_data_ptr<float>() + h * key_scales.stride(0),
          value_scales.const_data_ptr<float>() + h * value_scales.stride(0),
          tables.tile_starts(i) + first,
          out.mutable_data_ptr<T>() + index * groups * dim,
          groups,
          dim,
          tables.length(i) - first * kKeyTile,
          scale,
          tables.skip(i),
          sinks == nullptr ? nullptr : sinks + h * groups};
      attend(item);
    }
  });
}

}  // namespace

namespace smolserve {

// query [rows, kv_heads, groups, dim] (float32 or bfloat16); keys and values uint8 [kv_heads, positions, dim]
// in the layouts above, in blocks of `block_size` positions; key_scales and value_scales float32
// [kv_heads, positions]; block_tables [rows, width] int32 and lengths [rows]: row i attends its sequence's
// positions 0..lengths[i]-1 through its blocks (only the last `window` of them in a sliding-window layer; 0: all).
// sinks: as decode_attention's. Returns [rows, kv_heads, groups, dim] in the query's dtype.
at::Tensor decode_attention_int8(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                                 const at::Tensor& key_scales, const at::Tensor& value_scales,
                                 const at::Tensor& block_tables, const at::Tensor& lengths, int64_t block_size,
                                 double scale, int64_t window, const std::optional<at::Tensor>& sinks) {
  check_cache(keys, values, key_scales, value_scales);
  TORCH_CHECK(query.dim() == 4, "expected a 4-d query [rows, kv_heads, groups, dim]");
  const at::Tensor q = query.contiguous();
  TORCH_CHECK(keys.size(0) == q.size(1) && keys.size(2) == q.size(3), "keys shape mismatch");
  TORCH_CHECK(q.size(2) <= kMaxGroups, "too many query heads per KV head");
  const smolserve::BlockTables tables(block_tables, lengths, q.size(0), block_size, keys.size(1), window);
  at::Tensor out = at::empty_like(q);
  const at::Tensor sink_values = smolserve::checked_sinks(sinks, q.size(1) * q.size(2));
  const float* sink_data = sink_values.defined() ? sink_values.const_data_ptr<float>() : nullptr;
  if (q.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(q, keys, values, key_scales, value_scales, out, tables, static_cast<float>(scale), sink_data);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "the query must be float32 or bfloat16");
    run<float>(q, keys, values, key_scales, value_scales, out, tables, static_cast<float>(scale), sink_data);
  }
  return out;
}

template <typename T>
void write_rows(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& key_scales,
                const at::Tensor& value_scales, const int64_t* position, const at::Tensor& key,
                const at::Tensor& value) {
  const int64_t heads = key.size(1), dim = key.size(2);
  uint8_t* kp = keys.mutable_data_ptr<uint8_t>();
  uint8_t* vp = values.mutable_data_ptr<uint8_t>();
  float* ks = key_scales.mutable_data_ptr<float>();
  float* vs = value_scales.mutable_data_ptr<float>();
  int8_t quantized[kMaxHeadDim];
  for (int64_t row = 0; row < key.size(0); ++row) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t p = position[row];
      const int64_t head = h * keys.stride(0);
      const int64_t scale_at = h * key_scales.stride(0) + p;
      ks[scale_at] = quantize(key.const_data_ptr<T>() + (row * heads + h) * dim, dim, quantized);
      for (int64_t d = 0; d < dim; ++d) kp[head + key_offset(p, d, dim)] = static_cast<uint8_t>(quantized[d] + 128);
      vs[scale_at] = quantize(value.const_data_ptr<T>() + (row * heads + h) * dim, dim, quantized);
      for (int64_t d = 0; d < dim; ++d) vp[head + value_offset(p, d, dim)] = static_cast<uint8_t>(quantized[d]);
    }
  }
}

// Quantizes each row's key and value ([rows, kv_heads, dim]) and stores them, with their scales, at the row's
// physical position of the cache (the same tensors decode_attention_int8 reads).
void write_kv_int8(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& key_scales,
                   const at::Tensor& value_scales, const at::Tensor& positions, const at::Tensor& key,
                   const at::Tensor& value) {
  check_cache(keys, values, key_scales, value_scales);
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.scalar_type() == value.scalar_type(),
              "key and value must both be [rows, kv_heads, dim]");
  TORCH_CHECK(key.size(1) == keys.size(0) && key.size(2) == keys.size(2), "key shape mismatch");
  const at::Tensor k = key.contiguous(), v = value.contiguous();
  const at::Tensor position = positions.to(at::kLong).contiguous();
  TORCH_CHECK(position.numel() == k.size(0), "one position per row");
  for (int64_t row = 0; row < k.size(0); ++row) {
    const int64_t p = position.data_ptr<int64_t>()[row];
    TORCH_CHECK(p >= 0 && p < keys.size(1), "position out of range");
  }
  if (k.scalar_type() == at::kBFloat16) {
    write_rows<c10::BFloat16>(keys, values, key_scales, value_scales, position.data_ptr<int64_t>(), k, v);
  } else {
    TORCH_CHECK(k.scalar_type() == at::kFloat, "key and value must be float32 or bfloat16");
    write_rows<float>(keys, values, key_scales, value_scales, position.data_ptr<int64_t>(), k, v);
  }
}

}  // namespace smolserve

TORCH_LIBRARY_FRAGMENT(smolserve, m) {
  m.def(
      "decode_attention_int8(Tensor query, Tensor keys, Tensor values, Tensor key_scales, Tensor value_scales, "
      "Tensor block_tables, Tensor lengths, int block_size, float scale, int window=0, "
      "Tensor? sinks=None) -> Tensor");
  m.def(
      "write_kv_int8(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) key_scales, Tensor(d!) value_scales, "
      "Tensor positions, Tensor key, Tensor value) -> ()");
}

TORCH_LIBRARY_IMPL(smolserve, CPU, m) {
  m.impl("decode_attention_int8", &smolserve::decode_attention_int8);
  m.impl("write_kv_int8", &smolserve::write_kv_int8);
}
