// Decode attention over the block KV cache: one query token per row, grouped-query heads, each row reading its
// sequence's blocks through its block table (block_table.h).
//
// For each (sequence, KV head) the kernel streams that head's keys once into a row of scores per query head,
// takes the softmax over whole rows in float32, then streams the values once, serving every query head of the
// group from the same two streams. It has none of the per-call setup of a general attention kernel, which
// dominates when contexts are short.
//
// Keys are stored in tiles of 16 positions, each tile laid out [dim / 2][16 positions][2 dims]: one 64-byte
// row of a tile holds the same two dims of 16 positions, so a query's scores for 16 positions accumulate
// lane-wise (one dpbf16 per two dims on AVX512-BF16) with no horizontal sums. Values stay [positions][dim].
// A block holds a whole number of tiles, so a tile (and a pair of positions) never straddles two blocks.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "block_softmax.h"
#include "block_table.h"
#include "common.h"
#include "ops.h"

namespace {

using smolserve::kKeyTile;
using smolserve::kMaxGroups;
using smolserve::kMaxHeadDim;
using smolserve::widen;

// scores[i] = scaled_query . key[i] for the 16 positions of one tile (those past the length included).
template <typename T, int64_t Dim>
inline void score_tile(const float* scaled_query, const T* tile, int64_t dynamic_dim, float* scores) {
  const int64_t dim = Dim ? Dim : dynamic_dim;
  float sums[kKeyTile] = {};
  for (int64_t j = 0; j < dim / 2; ++j) {
    const T* row = tile + j * 2 * kKeyTile;
    const float even = scaled_query[2 * j], odd = scaled_query[2 * j + 1];
#pragma omp simd
    for (int64_t i = 0; i < kKeyTile; ++i) sums[i] += even * widen(row[2 * i]) + odd * widen(row[2 * i + 1]);
  }
  std::copy(sums, sums + kKeyTile, scores);
}

// One (sequence, KV head): `groups` query rows against `length` cached positions, in float32, in three passes:
// every score from one stream of keys, the softmax over whole rows, the weighted sum from one stream of values
// (each value row loaded once for all query rows). `Dim` is the head size when known at compile time (the
// loops over it then unroll and vectorize fully), or 0 for any size. The portable kernel: float32 rows of a known
// head size that is a multiple of 32 take attend_rows_avx2 below where the CPU has AVX2.
template <typename T, int64_t Dim>
void attend_one(const T* query, const T* keys, const T* values, T* out, int64_t groups, int64_t dynamic_dim,
                int64_t length, const int64_t* tiles, float scale, int64_t skip, const float* sinks) {
  const int64_t dim = Dim ? Dim : dynamic_dim;
  const int64_t width = (length + kKeyTile - 1) / kKeyTile * kKeyTile;
  alignas(64) float q[kMaxGroups * kMaxHeadDim];
  alignas(64) float acc[kMaxGroups * kMaxHeadDim];
  float* scores = smolserve::score_rows(groups * width);
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t d = 0; d < dim; ++d) q[g * dim + d] = widen(query[g * dim + d]) * scale;
    std::fill(&acc[g * dim], &acc[g * dim] + dim, 0.0f);
  }
  for (int64_t t = 0; t < length; t += kKeyTile) {
    for (int64_t g = 0; g < groups; ++g) {
      score_tile<T, Dim>(&q[g * dim], keys + tiles[t / kKeyTile] * dim, dim, scores + g * width + t);
    }
  }
  float total[kMaxGroups];
  for (int64_t g = 0; g < groups; ++g) {
    smolserve::mask_leading(scores + g * width, skip);
    float row_max;
    total[g] = smolserve::softmax_row(scores + g * width, length, &row_max);
    total[g] += smolserve::sink_term(sinks, g, row_max);
    smolserve::zero_leading(scores + g * width, skip);
  }
  for (int64_t t = 0; t < length; ++t) {
    const T* value = values + (tiles[t / kKeyTile] + t % kKeyTile) * dim;
    for (int64_t g = 0; g < groups; ++g) {
      const float p = scores[g * width + t];
      float* a = &acc[g * dim];
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] += p * widen(value[d]);
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    const float inverse = 1.0f / total[g];
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = static_cast<T>(acc[g * dim + d] * inverse);
  }
}

// Up to this many rows of one sequence (a prompt chunk's) attend together: each tile of keys and block of values is
// read once for all of them, from L1, instead of once a row from L3 (at 16k positions a row's keys and values are
// ~8 MB a KV head). The float32 kernel takes up to kFloatRows; the bfloat16 one up to kRowsAtOnce (query rows and
// heads together: 32 rows of heads of 256, 8 of four heads of 64, whose scores, 16k positions a row and head, would
// no longer stay in the core's cache). 32 rows rather than 8 at heads of 256: a 16k prompt's last 256-row chunk on
// Qwen3.5's 6 attention layers took 656 ms of attention against 820.
constexpr int kRowsAtOnce = 32;
constexpr int kFloatRows = 8;
// Positions of values weighed for every row before the next: 64 x 128 dims of float32 is 32 KB.
constexpr int64_t kValueBlock = 64;

// Rows of one sequence for attend_rows_avx2, their lengths ascending: each reads the tiles of the last (longest).
struct RowGroup {
  int count = 0;
  const float* query[kFloatRows];  // [groups][Dim] each
  float* out[kFloatRows];
  int64_t length[kFloatRows];
};

#if defined(__AVX2__) && defined(__FMA__)
// The scores of `Heads` query heads (their scaled queries one after another; their rows of scores `width` apart) for
// one tile. Row j of a key tile holds [position][dims 2j, 2j+1] for 16 positions, four vectors of 4 positions'
// pairs; a query's pair of dims, broadcast as one 64-bit lane, multiplies all four, even and odd dims summing in
// adjacent lanes until one horizontal add per pair of vectors. Two heads keep eight sums in flight, as the fused
// multiply-add's latency needs. (The portable loops left a short context's attention ~3x slower.)
template <int64_t Dim, int Heads>
inline void score_tile_avx2(const float* scaled_query, const float* tile, float* scores, int64_t width) {
  __m256 acc[Heads][4];
  for (int h = 0; h < Heads; ++h) {
    for (int k = 0; k < 4; ++k) acc[h][k] = _mm256_setzero_ps();
  }
  for (int64_t j = 0; j < Dim / 2; ++j) {
    const float* row = tile + j * 2 * kKeyTile;
    __m256 keys[4];
    for (int k = 0; k < 4; ++k) keys[k] = _mm256_loadu_ps(row + 8 * k);
    for (int h = 0; h < Heads; ++h) {
      const float* pair_of_dims = scaled_query + h * Dim + 2 * j;
      const __m256 pair = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(pair_of_dims)));
      for (int k = 0; k < 4; ++k) acc[h][k] = _mm256_fmadd_ps(keys[k], pair, acc[h][k]);
    }
  }
  // hadd of positions 0-3 and 4-7 gives [0, 1, 4, 5 | 2, 3, 6, 7]: 64-bit lanes 0, 2, 1, 3 put them in order.
  for (int h = 0; h < Heads; ++h) {
    for (int half = 0; half < 2; ++half) {
      const __m256 sums = _mm256_hadd_ps(acc[h][2 * half], acc[h][2 * half + 1]);
      _mm256_storeu_ps(scores + h * width + 8 * half,
                       _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(sums), 0xD8)));
    }
  }
}

// acc[r][0..Dim) += sum over positions t in [begin, end), in order, of probabilities[r][t] * value[t], for `Rows`
// rows: up to 2 rows x 32 dims of sums in registers per pass over the positions. Each sum is one chain of fused
// multiply-adds in position order, however the positions are split into calls.
template <int64_t Dim, int Rows>
inline void weigh_values_avx2(const float* const* probabilities, const float* values, int64_t begin, int64_t end,
                              const int64_t* tiles, float* const* acc) {
  for (int64_t c = 0; c < Dim; c += 32) {
    __m256 sums[Rows][4];
    for (int r = 0; r < Rows; ++r) {
      for (int k = 0; k < 4; ++k) sums[r][k] = _mm256_loadu_ps(acc[r] + c + 8 * k);
    }
    for (int64_t t = begin; t < end; ++t) {
      const float* value = values + (tiles[t / kKeyTile] + t % kKeyTile) * Dim + c;
      __m256 v[4];
      for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(value + 8 * k);
      for (int r = 0; r < Rows; ++r) {
        const __m256 p = _mm256_broadcast_ss(probabilities[r] + t);
        for (int k = 0; k < 4; ++k) sums[r][k] = _mm256_fmadd_ps(p, v[k], sums[r][k]);
      }
    }
    for (int r = 0; r < Rows; ++r) {
      for (int k = 0; k < 4; ++k) _mm256_storeu_ps(acc[r] + c + 8 * k, sums[r][k]);
    }
  }
}

// Every (row, query head) of `rows` against one KV head, float32 of head size `Dim` (a multiple of 32), in
// attend_one's three passes: scores tile by tile for every row that reaches the tile, the softmax over each
// row, values block by block for every row that reaches the block. Each row's arithmetic is the same whatever rows
// share its call (a decoding row comes alone), so a prompt position's output does not depend on how its prompt
// was cut into chunks or what else the step holds.
template <int64_t Dim>
void attend_rows_avx2(const RowGroup& rows, int64_t groups, const float* keys, const float* values,
                      const int64_t* tiles, float scale, int64_t skip, const float* sinks) {
  const int64_t longest = rows.length[rows.count - 1], heads = rows.count * groups;
  int64_t width = (longest + kKeyTile - 1) / kKeyTile * kKeyTile;
  if (width % 256 == 0) width += kKeyTile;  // rows of scores 1 KB apart or a multiple would share L1's sets
  float* q = smolserve::score_rows(heads * (2 * Dim + width));
  float* acc = q + heads * Dim;
  float* scores = acc + heads * Dim;
  for (int r = 0; r < rows.count; ++r) {
    for (int64_t d = 0; d < groups * Dim; ++d) q[r * groups * Dim + d] = rows.query[r][d] * scale;
  }
  std::fill(acc, acc + heads * Dim, 0.0f);
  for (int64_t t = 0; t < longest; t += kKeyTile) {
    const float* tile = keys + tiles[t / kKeyTile] * Dim;
    for (int r = 0; r < rows.count; ++r) {
      for (int64_t i = r * groups; t < rows.length[r] && i < (r + 1) * groups; i += 2) {  // two query heads' sums at once
        if (i + 1 < (r + 1) * groups) score_tile_avx2<Dim, 2>(q + i * Dim, tile, scores + i * width + t, width);
        else score_tile_avx2<Dim, 1>(q + i * Dim, tile, scores + i * width + t, width);
      }
    }
  }
  float total[kFloatRows * kMaxGroups];
  for (int64_t i = 0; i < heads; ++i) {
    smolserve::mask_leading(scores + i * width, skip);
    float row_max;
    total[i] = smolserve::softmax_row(scores + i * width, rows.length[i / groups], &row_max);
    total[i] += smolserve::sink_term(sinks, i % groups, row_max);
    smolserve::zero_leading(scores + i * width, skip);
  }
  for (int64_t begin = 0; begin < longest; begin += kValueBlock) {
    for (int r = 0; r < rows.count; ++r) {
      const int64_t end = std::min(begin + kValueBlock, rows.length[r]);
      for (int64_t i = r * groups; end > begin && i < (r + 1) * groups; i += 2) {  // a row's query heads in pairs
        const float* probabilities[2] = {scores + i * width, scores + (i + 1) * width};
        float* sums[2] = {acc + i * Dim, acc + (i + 1) * Dim};
        if (i + 1 < (r + 1) * groups) weigh_values_avx2<Dim, 2>(probabilities, values, begin, end, tiles, sums);
        else weigh_values_avx2<Dim, 1>(probabilities, values, begin, end, tiles, sums);
      }
    }
  }
  for (int64_t i = 0; i < heads; ++i) {
    const float inverse = 1.0f / total[i];
    float* out = rows.out[i / groups] + (i % groups) * Dim;
    for (int64_t d = 0; d < Dim; ++d) out[d] = acc[i * Dim + d] * inverse;
  }
}
#endif
#if defined(__AVX512BF16__)
using bf16 = c10::BFloat16;

// scores[n][offset + i] = scale * query[n] . key[i] for one tile of bfloat16 keys and `N` query rows (a row's
// query heads, or several rows'), whose bfloat16 dims are taken in pairs (`queries`: N rows of Dim / 2 pairs, one
// after another): one dpbf16 per pair of dims and query row, each key vector loaded once for the N rows, two
// independent sums per row so that consecutive dpbf16s do not wait on each other. A row's sums are the same whatever
// rows share the call.
template <int64_t Dim, int N>
inline void score_tile_paired(const uint32_t* queries, const bf16* tile, float scale, float* const* scores,
                              int64_t offset) {
  __m512 sums[N][2];
  for (int n = 0; n < N; ++n) sums[n][0] = sums[n][1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < Dim / 2; j += 2) {
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      const __m512bh keys = (__m512bh)_mm512_loadu_si512(tile + 2 * kKeyTile * (j + half));
#pragma GCC unroll 8
      for (int n = 0; n < N; ++n) {
        const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(queries[n * Dim / 2 + j + half]));
        sums[n][half] = _mm512_dpbf16_ps(sums[n][half], pair, keys);
      }
    }
  }
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int n = 0; n < N; ++n) {
    _mm512_store_ps(scores[n] + offset, _mm512_mul_ps(_mm512_add_ps(sums[n][0], sums[n][1]), scale16));
  }
}

// Rows of queries a pass over a key tile's vectors scores at once: 16 sums and a key in registers.
constexpr int kScoreRows = 8;

// score_tile_paired for `count` query rows (`queries`: their pairs one after another), kScoreRows at a time.
template <int64_t Dim>
inline void score_tile_rows(const uint32_t* queries, int count, const bf16* tile, float scale, float* const* scores,
                            int64_t offset) {
  int n = 0;
  for (; n + kScoreRows <= count; n += kScoreRows) {
    score_tile_paired<Dim, kScoreRows>(queries + n * Dim / 2, tile, scale, scores + n, offset);
  }
  const uint32_t* rest = queries + n * Dim / 2;
  switch (count - n) {
    case 1: return score_tile_paired<Dim, 1>(rest, tile, scale, scores + n, offset);
    case 2: return score_tile_paired<Dim, 2>(rest, tile, scale, scores + n, offset);
    case 3: return score_tile_paired<Dim, 3>(rest, tile, scale, scores + n, offset);
    case 4: return score_tile_paired<Dim, 4>(rest, tile, scale, scores + n, offset);
    case 5: return score_tile_paired<Dim, 5>(rest, tile, scale, scores + n, offset);
    case 6: return score_tile_paired<Dim, 6>(rest, tile, scale, scores + n, offset);
    case 7: return score_tile_paired<Dim, 7>(rest, tile, scale, scores + n, offset);
    default: return;
  }
}

// The paired path's order of dims: in 32-dim chunk c, unpacklo's lane 4j+k holds dim 32c+8j+k and
// unpackhi's lane 4j+k holds dim 32c+8j+4+k (j: the 128-bit lane, k: 0..3).
inline int64_t paired_dim(int64_t index) {
  const int64_t chunk = index / 32, high = (index / 16) % 2, lane = index % 16;
  return 32 * chunk + 8 * (lane / 4) + 4 * high + lane % 4;
}

// Rounds one query row's probabilities to bfloat16 pairs of positions, in place: weight pair t / 2 overwrites
// floats that have already been read.
inline void round_to_pairs(float* probabilities, int64_t width) {
  uint32_t* pairs = reinterpret_cast<uint32_t*>(probabilities);
  for (int64_t t = 0; t < width; t += 32) {
    const __m512 low = _mm512_load_ps(probabilities + t), high = _mm512_load_ps(probabilities + t + 16);
    _mm512_store_si512(pairs + t / 2, (__m512i)_mm512_cvtne2ps_pbh(high, low));
  }
}

// acc[n]'s chunks [c0, c0 + C) of 32 dims (in paired_dim's order) += the probabilities' bfloat16 pairs
// pairs[n][t / 2] times the values' pair at positions t, t + 1 (t's again where t + 1 is not below `length`: its
// probability is 0), for t in [begin, end) from `begin` even, for `N` query rows: each pair of value vectors is
// loaded and interleaved once for the N rows. Each sum is one chain of dpbf16s in position order, however the
// positions and rows are split into calls.
template <int64_t Dim, int N, int C>
inline void weigh_value_pairs(const uint32_t* const* pairs, float* const* acc, const bf16* values,
                              const int64_t* tiles, int64_t begin, int64_t end, int64_t length, int64_t c0) {
  __m512 sums[N][2 * C];
  for (int n = 0; n < N; ++n) {
    for (int i = 0; i < 2 * C; ++i) sums[n][i] = _mm512_load_ps(acc[n] + 32 * c0 + 16 * i);
  }
  for (int64_t t = begin; t < end; t += 2) {
    const bf16* first = values + (tiles[t / kKeyTile] + t % kKeyTile) * Dim;
    const bf16* second = t + 1 < length ? first + Dim : first;
    __m512bh pair[N];
    for (int n = 0; n < N; ++n) pair[n] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[n][t / 2]));
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512i a = _mm512_loadu_si512(first + 32 * (c0 + c)), b = _mm512_loadu_si512(second + 32 * (c0 + c));
      const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(a, b), high = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int n = 0; n < N; ++n) {
        sums[n][2 * c] = _mm512_dpbf16_ps(sums[n][2 * c], pair[n], low);
        sums[n][2 * c + 1] = _mm512_dpbf16_ps(sums[n][2 * c + 1], pair[n], high);
      }
    }
  }
  for (int n = 0; n < N; ++n) {
    for (int i = 0; i < 2 * C; ++i) _mm512_store_ps(acc[n] + 32 * c0 + 16 * i, sums[n][i]);
  }
}

// weigh_value_pairs over every chunk of the head, `N` rows (all of them of at least `length`) at a time.
template <int64_t Dim, int N>
inline void weigh_value_chunks(const uint32_t* const* pairs, float* const* acc, const bf16* values,
                               const int64_t* tiles, int64_t begin, int64_t end, int64_t length) {
  constexpr int kChunksAtOnce = Dim >= 64 ? 2 : 1;  // N x 4 sums in registers
  for (int64_t c0 = 0; c0 < Dim / 32; c0 += kChunksAtOnce) {
    weigh_value_pairs<Dim, N, kChunksAtOnce>(pairs, acc, values, tiles, begin, end, length, c0);
  }
}

// Rows weighed together over a block of values (each pair of value vectors loaded once for them).
constexpr int kValueRows = 4;  // (weigh_value_block calls 1 to 4)

// One block of kValueBlock positions from `block` for `count` query rows (their lengths ascending, each reaching
// the block): kValueRows rows at a time over the positions where each of them has whole pairs, then each row alone
// over the rest of its positions in the block. Every row's sums take the same chain of dpbf16s as it alone would.
template <int64_t Dim>
inline void weigh_value_block(const uint32_t* const* pairs, float* const* acc, const int64_t* length, int count,
                              const bf16* values, const int64_t* tiles, int64_t block) {
  const int64_t block_end = block + kValueBlock;
  for (int n = 0; n < count; n += kValueRows) {
    const int rows = std::min(kValueRows, count - n);
    const int64_t shared = std::min(block_end, length[n] / 2 * 2);  // below it every row has whole pairs
    switch (rows) {  // (a decoding row's query heads, kMost at most, are one call)
      case 1: weigh_value_chunks<Dim, 1>(pairs + n, acc + n, values, tiles, block, shared, length[n]); break;
      case 2: weigh_value_chunks<Dim, 2>(pairs + n, acc + n, values, tiles, block, shared, length[n]); break;
      case 3: weigh_value_chunks<Dim, 3>(pairs + n, acc + n, values, tiles, block, shared, length[n]); break;
      default: weigh_value_chunks<Dim, kValueRows>(pairs + n, acc + n, values, tiles, block, shared, length[n]);
    }
    for (int r = n; r < n + rows; ++r) {
      const int64_t end = std::min(block_end, length[r]);
      weigh_value_chunks<Dim, 1>(pairs + r, acc + r, values, tiles, std::max(block, shared), end, length[r]);
    }
  }
}

// attend_one for bfloat16 on AVX512-BF16: up to kRowsAtOnce rows of one sequence (a prompt chunk's, their lengths
// ascending; a decoding row alone) and `Groups` query heads each, in three passes: every score from one stream of
// keys, each tile read once for all the rows (from L1 after the first; each key vector loaded once for up to
// kScoreRows of them: 656 -> 443 ms in the chunk above); the softmax over whole rows; the weighted sum from one
// stream of values, block by block of kValueBlock positions for all the rows (two positions' rows interleaved and
// multiplied with their two probabilities, rounded to bfloat16, by one dpbf16 into float32 sums held in registers,
// stored between blocks; each interleaved pair for up to kValueRows rows: 443 -> 392 ms). Two long streams let the hardware prefetcher run ahead: at 8 x 2048 positions
// the kernel reads the cache about as fast as a plain loop of loads, in 0.73-0.89 of the time of an online softmax
// over alternating blocks of keys and values. Each row's arithmetic is the same whatever rows share its call: a
// prompt position's output does not depend on its batchmates or on how its prompt was cut into chunks. (Row by
// row, a 16k prompt's rows read its keys and values ~8 MB a row.)
template <int64_t Dim, int Groups>
void attend_paired_rows(const bf16* const* query, bf16* const* out, const int64_t* length, int count,
                        const bf16* keys, const bf16* values, const int64_t* tiles, float scale, int64_t skip,
                        const float* sinks) {
  constexpr int64_t kChunks = Dim / 32;
  alignas(64) uint32_t query_pairs[kRowsAtOnce][Groups][Dim / 2];
  int64_t width[kRowsAtOnce], at = 0;
  for (int r = 0; r < count; ++r) {
    std::memcpy(query_pairs[r], query[r], sizeof(query_pairs[r]));
    width[r] = (length[r] + 63) / 64 * 64;
    at += Groups * width[r];
  }
  float* buffer = smolserve::score_rows(at);
  float* scores[kRowsAtOnce][Groups];  // row-major, as query_pairs: the rows that reach a tile are a suffix
  for (int r = 0, offset = 0; r < count; offset += Groups * width[r], ++r) {
    for (int g = 0; g < Groups; ++g) scores[r][g] = buffer + offset + g * width[r];
  }
  int first = 0;  // the first row that reaches the tile (their lengths ascend)
  for (int64_t t = 0; t < length[count - 1]; t += kKeyTile) {
    while (t >= length[first]) ++first;
    score_tile_rows<Dim>(query_pairs[first][0], (count - first) * Groups, keys + tiles[t / kKeyTile] * Dim, scale,
                         scores[first], t);
  }
  float total[kRowsAtOnce][Groups];
  for (int r = 0; r < count; ++r) {
    for (int g = 0; g < Groups; ++g) {
      smolserve::mask_leading(scores[r][g], skip);
      float row_max;
      total[r][g] = smolserve::softmax_row_avx512(scores[r][g], length[r], width[r], &row_max);
      total[r][g] += smolserve::sink_term(sinks, g, row_max);
      smolserve::zero_leading(scores[r][g], skip);
      round_to_pairs(scores[r][g], width[r]);
    }
  }
  alignas(64) float acc[kRowsAtOnce][Groups][Dim];
  std::memset(acc, 0, sizeof(acc[0]) * count);  // (the rows used: the whole array is 32 rows' worth)
  const uint32_t* pairs[kRowsAtOnce * Groups];  // row-major, as `queries`
  float* sums[kRowsAtOnce * Groups];
  int64_t lengths[kRowsAtOnce * Groups];
  for (int r = 0; r < count; ++r) {
    for (int g = 0; g < Groups; ++g) {
      pairs[r * Groups + g] = reinterpret_cast<const uint32_t*>(scores[r][g]);
      sums[r * Groups + g] = acc[r][g];
      lengths[r * Groups + g] = length[r];
    }
  }
  first = 0;
  for (int64_t block = 0; block < length[count - 1]; block += kValueBlock) {
    while (block >= length[first]) ++first;
    weigh_value_block<Dim>(pairs + first * Groups, sums + first * Groups, lengths + first * Groups,
                           (count - first) * Groups, values, tiles, block);
  }
  for (int r = 0; r < count; ++r) {
    for (int g = 0; g < Groups; ++g) {
      const float inverse = 1.0f / total[r][g];
      for (int64_t i = 0; i < Dim; ++i) out[r][g * Dim + paired_dim(i)] = static_cast<bf16>(acc[r][g][i] * inverse);
    }
  }
}

#endif

// The kernel for one (sequence, KV head) that suits this dtype and head size on this CPU.
template <typename T>
auto pick_kernel(int64_t dim) {
  using Kernel =
      void (*)(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t, const int64_t*, float, int64_t,
               const float*);
  return static_cast<Kernel>(dim == 64 ? attend_one<T, 64> : dim == 128 ? attend_one<T, 128> : attend_one<T, 0>);
}

// Under ~2,000 positions in all a second thread's start costs more than it saves (float32, AVX2: 3 heads x 200
// positions took 15 us on one thread, 20 on two; 3 x 1,000 took 60 on one, 46 on two).
inline int64_t grain(const smolserve::BlockTables& tables, int64_t rows, int64_t heads, int64_t items) {
  int64_t positions = 0;
  for (int64_t i = 0; i < rows; ++i) positions += tables.length(i) * heads;
  return positions < 2048 ? items : 1;
}

// Consecutive rows that read the same blocks (a prompt chunk's) in groups of up to `most`: each group's first row,
// then `rows`.
inline std::vector<int64_t> row_groups(const smolserve::BlockTables& tables, int64_t rows, int64_t most) {
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < rows; ++i) {
    if (starts.empty() || i - starts.back() == most || !tables.continues(i - 1, i)) starts.push_back(i);
  }
  starts.push_back(rows);
  return starts;
}

#if defined(__AVX512BF16__)
// run for bfloat16 of head size `Dim` on AVX512-BF16: consecutive rows that read the same blocks (a prompt chunk's)
// in groups of up to kRowsAtOnce / kMost (attend_paired_rows), a group and KV head an item; its query heads kMost at
// a time.
template <int64_t Dim>
void run_rows_paired(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, at::Tensor& out,
                     const smolserve::BlockTables& tables, float scale, const float* sinks) {
  constexpr int kMost = Dim == 64 ? 4 : Dim == 128 ? 2 : 1;
  const int64_t rows = q.size(0), heads = q.size(1), groups = q.size(2);
  const std::vector<int64_t> starts = row_groups(tables, rows, kRowsAtOnce / std::min<int64_t>(groups, kMost));
  const int64_t items = static_cast<int64_t>(starts.size() - 1) * heads;
  const bf16* qp = q.const_data_ptr<bf16>();
  bf16* op = out.mutable_data_ptr<bf16>();
  at::parallel_for(0, items, grain(tables, rows, heads, items), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first_row = starts[item / heads], last_row = starts[item / heads + 1] - 1, h = item % heads;
      const int64_t first = tables.first_tile(last_row);  // 0 unless the group is one row of a sliding window
      const int count = static_cast<int>(last_row - first_row + 1);
      int64_t length[kRowsAtOnce];
      for (int r = 0; r < count; ++r) length[r] = tables.length(first_row + r) - first * kKeyTile;
      const bf16* k = keys.const_data_ptr<bf16>() + h * keys.stride(0);
      const bf16* v = values.const_data_ptr<bf16>() + h * values.stride(0);
      const int64_t* tile_starts = tables.tile_starts(last_row) + first;
      for (int64_t g0 = 0; g0 < groups; g0 += kMost) {
        const bf16* query[kRowsAtOnce];
        bf16* output[kRowsAtOnce];
        for (int r = 0; r < count; ++r) {
          query[r] = qp + ((first_row + r) * heads + h) * groups * Dim + g0 * Dim;
          output[r] = op + ((first_row + r) * heads + h) * groups * Dim + g0 * Dim;
        }
        const float* s = sinks == nullptr ? nullptr : sinks + h * groups + g0;
        const int64_t n = std::min<int64_t>(kMost, groups - g0), skip = tables.skip(last_row);
        if (n == 1) attend_paired_rows<Dim, 1>(query, output, length, count, k, v, tile_starts, scale, skip, s);
        if constexpr (kMost >= 2) {
          if (n == 2) attend_paired_rows<Dim, 2>(query, output, length, count, k, v, tile_starts, scale, skip, s);
        }
        if constexpr (kMost == 4) {
          if (n == 3) attend_paired_rows<Dim, 3>(query, output, length, count, k, v, tile_starts, scale, skip, s);
          if (n == 4) attend_paired_rows<Dim, 4>(query, output, length, count, k, v, tile_starts, scale, skip, s);
        }
      }
    }
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// run for float32 of head size `Dim` on AVX2: consecutive rows that read the same blocks (a prompt chunk's) in
// groups of up to kRowsAtOnce, a group and KV head an item.
template <int64_t Dim>
void run_rows(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, at::Tensor& out,
              const smolserve::BlockTables& tables, float scale, const float* sinks) {
  const int64_t rows = q.size(0), heads = q.size(1), groups = q.size(2);
  const std::vector<int64_t> starts = row_groups(tables, rows, kFloatRows);
  const int64_t items = static_cast<int64_t>(starts.size() - 1) * heads;
  const float* qp = q.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, items, grain(tables, rows, heads, items), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first_row = starts[item / heads], last_row = starts[item / heads + 1] - 1, h = item % heads;
      const int64_t first = tables.first_tile(last_row);  // 0 unless the group is one row of a sliding window
      RowGroup group;
      for (int64_t i = first_row; i <= last_row; ++i) {
        group.query[group.count] = qp + (i * heads + h) * groups * Dim;
        group.out[group.count] = op + (i * heads + h) * groups * Dim;
        group.length[group.count++] = tables.length(i) - first * kKeyTile;
      }
      attend_rows_avx2<Dim>(group, groups, keys.const_data_ptr<float>() + h * keys.stride(0),
                            values.const_data_ptr<float>() + h * values.stride(0),
                            tables.tile_starts(last_row) + first, scale, tables.skip(last_row),
                            sinks == nullptr ? nullptr : sinks + h * groups);
    }
  });
}
#endif

template <typename T>
void run(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, at::Tensor& out,
         const smolserve::BlockTables& tables, float scale, const float* sinks) {
  const int64_t heads = q.size(1), groups = q.size(2), dim = q.size(3);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    if (dim == 64) return run_rows_paired<64>(q, keys, values, out, tables, scale, sinks);
    if (dim == 128) return run_rows_paired<128>(q, keys, values, out, tables, scale, sinks);
    if (dim == 256) return run_rows_paired<256>(q, keys, values, out, tables, scale, sinks);
    if (dim == 512) return run_rows_paired<512>(q, keys, values, out, tables, scale, sinks);  // Gemma 4's global
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    if (dim == 64) return run_rows<64>(q, keys, values, out, tables, scale, sinks);
    if (dim == 128) return run_rows<128>(q, keys, values, out, tables, scale, sinks);
  }
#endif
  const T* qp = q.const_data_ptr<T>();
  const T* kp = keys.const_data_ptr<T>();
  const T* vp = values.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const auto attend = pick_kernel<T>(dim);
  const int64_t items = q.size(0) * heads;
  at::parallel_for(0, items, grain(tables, q.size(0), heads, items), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / heads, h = item % heads, first = tables.first_tile(i);
      attend(qp + item * groups * dim, kp + h * keys.stride(0), vp + h * values.stride(0), op + item * groups * dim,
             groups, dim, tables.length(i) - first * kKeyTile, tables.tile_starts(i) + first, scale, tables.skip(i),
             sinks == nullptr ? nullptr : sinks + h * groups);
    }
  });
}

// Each row's key and value ([rows, heads, dim]) stored at its physical position: keys into their tiles, values
// as they are. One call per layer instead of a dozen small torch ops (index arithmetic, views, two index_puts),
// which at one decoding row cost ~1 ms of a ~12 ms step.
template <typename T>
void write_rows(const at::Tensor& keys, const at::Tensor& values, const int64_t* slots, const at::Tensor& key,
                const at::Tensor& value) {
  const int64_t rows = key.size(0), heads = key.size(1), dim = key.size(2);
  const int64_t head_stride = keys.stride(0);
  T* k_out = keys.data_ptr<T>();
  T* v_out = values.data_ptr<T>();
  const T* k_in = key.data_ptr<T>();
  const T* v_in = value.data_ptr<T>();
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t p = slots[row];
    const int64_t tile = (p / kKeyTile) * kKeyTile * dim, lane = (p % kKeyTile) * 2;
    for (int64_t h = 0; h < heads; ++h) {
      const T* k = k_in + (row * heads + h) * dim;
      T* tiled = k_out + h * head_stride + tile + lane;
      for (int64_t d = 0; d < dim; d += 2) {  // dims d, d + 1 of position p: row d / 2 of its tile
        tiled[(d / 2) * kKeyTile * 2] = k[d];
        tiled[(d / 2) * kKeyTile * 2 + 1] = k[d + 1];
      }
      std::memcpy(v_out + h * head_stride + p * dim, v_in + (row * heads + h) * dim, dim * sizeof(T));
    }
  }
}

}  // namespace

namespace smolserve {

// query [rows, kv_heads, groups, dim]; keys [kv_heads, positions, dim], the pool's blocks of `block_size`
// positions one after another, holding tiles of 16 positions laid out [dim / 2][16][2]; values
// [kv_heads, positions, dim]; block_tables [rows, width] int32 (any row stride): row i's blocks in order;
// lengths [rows] int64: row i attends its sequence's positions 0..lengths[i]-1, or only the last `window` of them
// (a sliding-window layer; 0: all); sinks: float32 [kv_heads * groups], each query head's attention sink (a logit
// in the softmax's denominator only), or none. Returns [rows, kv_heads, groups, dim].
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& block_tables, const at::Tensor& lengths, int64_t block_size,
                            double scale, int64_t window, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 4 && keys.dim() == 3 && values.dim() == 3, "expected a 4-d query, 3-d keys and values");
  TORCH_CHECK(keys.stride(2) == 1 && keys.stride(1) == keys.size(2), "each head's keys must be contiguous");
  TORCH_CHECK(values.stride(2) == 1 && values.stride(1) == values.size(2), "each head's values must be contiguous");
  TORCH_CHECK(keys.scalar_type() == query.scalar_type() && values.scalar_type() == query.scalar_type(),
              "query, keys and values must share a dtype");
  const at::Tensor q = query.contiguous();
  const int64_t heads = q.size(1), groups = q.size(2), dim = q.size(3);
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.size(0) == heads && keys.size(2) == dim, "cache shape mismatch");
  TORCH_CHECK(dim % 2 == 0, "keys come in pairs of dims");
  TORCH_CHECK(dim <= kMaxHeadDim && groups <= kMaxGroups, "head_dim or query heads per KV head too large");
  const smolserve::BlockTables tables(block_tables, lengths, q.size(0), block_size, keys.size(1), window);
  at::Tensor out = at::empty_like(q);
  const at::Tensor sink_values = smolserve::checked_sinks(sinks, heads * groups);
  const float* sink_data = sink_values.defined() ? sink_values.const_data_ptr<float>() : nullptr;
  if (q.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(q, keys, values, out, tables, static_cast<float>(scale), sink_data);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_attention supports float32 and bfloat16");
    run<float>(q, keys, values, out, tables, static_cast<float>(scale), sink_data);
  }
  return out;
}

void write_kv(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slots, const at::Tensor& key,
              const at::Tensor& value) {
  TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes() && keys.strides() == values.strides(),
              "keys and values must be [kv_heads, positions, dim] alike");
  TORCH_CHECK(keys.stride(2) == 1 && keys.stride(1) == keys.size(2) && keys.size(1) % kKeyTile == 0,
              "each head's positions must be contiguous, in whole tiles");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == keys.size(0) &&
                  key.size(2) == keys.size(2) && key.size(2) % 2 == 0,
              "key and value must both be [rows, kv_heads, dim] of the cache's heads and dim");
  TORCH_CHECK(key.scalar_type() == keys.scalar_type() && value.scalar_type() == keys.scalar_type() &&
                  values.scalar_type() == keys.scalar_type(),
              "key, value and the cache must share a dtype");
  const at::Tensor k = key.contiguous(), v = value.contiguous();
  const at::Tensor where = slots.to(at::kLong).contiguous();
  TORCH_CHECK(where.numel() == k.size(0), "one slot per row");
  const int64_t* p = where.data_ptr<int64_t>();
  for (int64_t row = 0; row < k.size(0); ++row) {
    TORCH_CHECK(p[row] >= 0 && p[row] < keys.size(1), "slot out of range");
  }
  if (k.scalar_type() == at::kBFloat16) {
    write_rows<c10::BFloat16>(keys, values, p, k, v);
  } else {
    TORCH_CHECK(k.scalar_type() == at::kFloat, "write_kv supports float32 and bfloat16");
    write_rows<float>(keys, values, p, k, v);
  }
}

}  // namespace smolserve

TORCH_LIBRARY(smolserve, m) {
  m.def(
      "decode_attention(Tensor query, Tensor keys, Tensor values, Tensor block_tables, Tensor lengths, "
      "int block_size, float scale, int window=0, Tensor? sinks=None) -> Tensor");
  m.def("write_kv(Tensor(a!) keys, Tensor(b!) values, Tensor slots, Tensor key, Tensor value) -> ()");
}

TORCH_LIBRARY_IMPL(smolserve, CPU, m) {
  m.impl("decode_attention", &smolserve::decode_attention);
  m.impl("write_kv", &smolserve::write_kv);
}
