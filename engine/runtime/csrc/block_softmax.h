// The decode-attention kernels' softmax: over whole rows of scores, held per thread (`score_rows`), or, in the
// 8-bit kernel's portable path, the online softmax's step over one block of scores, where the scores become
// exp(s - max), the running max and total are updated, and the factor that rescales what was accumulated
// before is returned.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace smolserve {

// 2^f for f in [-0.5, 0.5]: its Taylor polynomial's coefficients, highest power first (exp8 and exp16 below).
constexpr float kExp2Taylor[7] = {1.540353e-4f, 1.333355e-3f, 9.618129e-3f, 5.550411e-2f,
                                  2.402265e-1f, 6.931472e-1f, 1.0f};

// Per-thread room for `floats` scores, 64-byte aligned, kept between calls.
inline float* score_rows(int64_t floats) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats + 16) buffer.resize(floats + 16);
  return buffer.data() + ((-reinterpret_cast<uintptr_t>(buffer.data()) / sizeof(float)) & 15);
}

// `Groups` rows for `length` scores each in that per-thread room, padded to whole blocks of 64 floats (as
// softmax_row_avx512 takes them). Returns the padded width.
template <int Groups>
inline int64_t score_rows(int64_t length, float* (&rows)[Groups]) {
  const int64_t width = (length + 63) / 64 * 64;
  rows[0] = score_rows(Groups * width);
  for (int g = 1; g < Groups; ++g) rows[g] = rows[g - 1] + width;
  return width;
}

// A sliding window's first tile: its `skip` positions before the window out of the softmax. Before it, their
// scores become -inf; after it, their numerators exactly 0 (the vector exps floor at e^-87, not 0).
inline void mask_leading(float* scores, int64_t skip) {
  std::fill(scores, scores + skip, -std::numeric_limits<float>::infinity());
}
inline void zero_leading(float* numerators, int64_t skip) { std::fill(numerators, numerators + skip, 0.0f); }

// An attention sink's share of a softmax's denominator (gpt-oss: a learned logit per head that takes weight but
// adds no value): exp(sink - max) beside numerators exp(s - max); 0 without sinks.
inline float sink_term(const float* sinks, int64_t head, float max) {
  return sinks == nullptr ? 0.0f : std::exp(sinks[head] - max);
}

// Any count, plain loops.
inline float softmax_block(float* scores, int64_t count, float& running_max, float& total) {
  float block_max = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < count; ++t) block_max = std::max(block_max, scores[t]);
  const float new_max = std::max(running_max, block_max);
  const float correction = std::exp(running_max - new_max);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < count; ++t) {
    scores[t] = std::exp(scores[t] - new_max);
    sum += scores[t];
  }
  total = total * correction + sum;
  running_max = new_max;
  return correction;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp(x) for 8 floats, x <= 0, as exp16 below: 2^(x log2 e), the whole power put into the exponent bits, the
// fraction in [-0.5, 0.5] by its Taylor polynomial (relative error ~1e-7). Below -87 the result is ~0.
inline __m256 exp8(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(1.44269504f));
  const __m256 whole = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, whole);
  __m256 p = _mm256_set1_ps(kExp2Taylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Taylor[i]));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(whole), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}
#endif

// The softmax's numerators over a whole row of `count` scores: exp(s - max) in place. Returns their sum; the max
// in `max_out` where given.
inline float softmax_row(float* scores, int64_t count, float* max_out = nullptr) {
  const float row_max = *std::max_element(scores, scores + count);
  if (max_out != nullptr) *max_out = row_max;
  float sum = 0.0f;
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 shift = _mm256_set1_ps(row_max);
  __m256 sums = _mm256_setzero_ps();
  for (; t + 8 <= count; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift));
    _mm256_storeu_ps(scores + t, e);
    sums = _mm256_add_ps(sums, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sums);
  for (const float lane : lanes) sum += lane;
#endif
  for (; t < count; ++t) {
    scores[t] = std::exp(scores[t] - row_max);
    sum += scores[t];
  }
  return sum;
}

#if defined(__AVX512F__)
// exp(x) for 16 floats, x <= 0: 2^(x log2 e) split into a whole power (applied by scalef) and a fraction in
// [-0.5, 0.5] taken by its Taylor polynomial (relative error ~1e-7). Below -87 the result is ~0.
inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504f));
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, whole);
  __m512 p = _mm512_set1_ps(kExp2Taylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Taylor[i]));
  return _mm512_scalef_ps(p, whole);
}

// The softmax's numerators over a whole row of `count` scores in `width` floats (a multiple of 64, 64-byte
// aligned): exp(s - max) in place, zero from `count` on. Returns their sum; the max in `max_out` where given.
inline float softmax_row_avx512(float* scores, int64_t count, int64_t width, float* max_out = nullptr) {
  const auto used = [count](int64_t at) {
    return static_cast<__mmask16>((1u << std::clamp<int64_t>(count - at, 0, 16)) - 1u);
  };
  __m512 most[4];
  for (auto& m : most) m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < width; t += 64) {
    for (int i = 0; i < 4; ++i) {
      most[i] = _mm512_mask_max_ps(most[i], used(t + 16 * i), most[i], _mm512_load_ps(scores + t + 16 * i));
    }
  }
  const float row_max =
      _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(most[0], most[1]), _mm512_max_ps(most[2], most[3])));
  if (max_out != nullptr) *max_out = row_max;
  const __m512 shift = _mm512_set1_ps(row_max);
  __m512 sum[4];
  for (auto& s : sum) s = _mm512_setzero_ps();
  for (int64_t t = 0; t < width; t += 64) {
    for (int i = 0; i < 4; ++i) {
      float* at = scores + t + 16 * i;
      const __m512 e = _mm512_maskz_mov_ps(used(t + 16 * i), exp16(_mm512_sub_ps(_mm512_load_ps(at), shift)));
      _mm512_store_ps(at, e);
      sum[i] = _mm512_add_ps(sum[i], e);
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3])));
}
#endif

}  // namespace smolserve
