// Matmuls on a GGUF's quantized weights: Q4_0, Q4_1 and Q8_0 blocks of 32 weights.
//
// GGML stores each weight row as a run of blocks along the input dimension:
//   Q4_0: fp16 d, 16 bytes of 4-bit q (byte j: weight j in the low nibble, weight 16 + j in the high); w = (q - 8) d
//   Q4_1: fp16 d, fp16 m, 16 bytes of 4-bit q as above;                                                 w = q d + m
//   Q8_0: fp16 d, 32 int8 q;                                                                            w = q d
// `quant_pack` regroups them once at load, as llama.cpp's repacked formats do: the blocks of 8 output rows side
// by side, so that one vector instruction works on 8 outputs and a block's scales are one vector load:
//   Q4 group block (Q4_0 and Q4_1): 8 fp16 d, 8 fp16 m (Q4_0: m = -8 d, exact in fp16), then 4 runs of 32 bytes,
//     run k holding bytes 4k..4k+3 of each of the 8 rows in turn (weights 4k..4k+3 and 16+4k..16+4k+3);
//   Q8 group block: 8 fp16 d, then 8 runs of 32 bytes, run k holding weights 4k..4k+3 of each row in turn.
// Each activation row is quantized per block of 32 to int8 with a scale a = max|x| / 127, and a block's dot
// product is an integer one: sum(w x) = d a sum(q qx) (+ m a sum(qx) for Q4). On AVX2, a run's 4 weights of each
// of 8 rows meet the row's 4 activations, broadcast, in one vpmaddubsw (unsigned 4-bit weights times signed
// 8-bit activations; Q8 through the sign trick), and the block's 8 integer dot products end in one vector.
// Up to 4 activation rows share each unpacked weight run. Elsewhere, plain loops over the same integers.
//
// Every output is one fixed sequence of floating-point operations over its row's blocks, whatever the number of
// rows in the call: a row's result does not depend on its batchmates (greedy decoding stays batch-invariant).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SMOLSERVE_QUANT_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kCols = 8;   // output rows whose blocks are packed side by side
constexpr int64_t kTile = 4;   // activation rows per pass over a group's weights
constexpr int64_t kChunk = 64;  // activation rows per sweep over a thread's groups (their int8 stays in cache)
enum QuantType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };  // GGML's type numbers

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    default: TORCH_CHECK(false, "unsupported quantized type ", type, " (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8)");
  }
}

inline bool is_q8(int64_t type) { return type == kQ8_0; }

// Bytes of one packed group block: scales, offsets (Q4), quants of 8 rows.
constexpr int64_t group_block_bytes(bool q8) { return q8 ? 16 + kCols * kBlock : 32 + kCols * kBlock / 2; }

inline float half_to_float(uint16_t bits) {
#if defined(SMOLSERVE_QUANT_AVX2)
  return _cvtsh_ss(bits);  // one instruction (F16C), where c10::Half converts in software
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline uint16_t load_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bits;
}

// One GGML block's d and m as fp16 bits (Q4_0: m = -8 d; Q8_0: none) and its quant bytes.
void read_block(const uint8_t* block, int64_t type, uint16_t& d, uint16_t& m, const uint8_t*& quants) {
  d = load_half(block);
  m = 0;
  quants = block + 2;
  if (type == kQ4_1) {
    m = load_half(block + 2);
    quants = block + 4;
  } else if (type == kQ4_0) {
    m = c10::Half(-8.0f * static_cast<float>(c10::Half(d, c10::Half::from_bits()))).x;  // a power of 2: exact
  }
}

// The activations of one row, per block of 32: int8 values, their scale, and scale * sum (what m multiplies).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> scaled_sum;
};

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t rows, int64_t in) {
  const int64_t blocks = in / kBlock;
  QuantizedRows out{std::vector<int8_t>(rows * in), std::vector<float>(rows * blocks), std::vector<float>(rows * blocks)};
  at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* block = x + i * kBlock;  // rows are contiguous, so block i of the flattened rows
      float most = 0.0f;
      for (int64_t j = 0; j < kBlock; ++j) most = std::max(most, std::abs(static_cast<float>(block[j])));
      const float scale = most / 127.0f;
      const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
      int32_t total = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        const auto value = static_cast<int8_t>(std::nearbyint(static_cast<float>(block[j]) * inverse));
        out.q[i * kBlock + j] = value;
        total += value;
      }
      out.scale[i] = scale;
      out.scaled_sum[i] = scale * static_cast<float>(total);
    }
  });
  return out;
}

// Where the activations of rows [first, first + count) meet a group: a tile's arguments.
struct Tile {
  const uint8_t* group;  // the group's packed blocks
  int64_t blocks;
  const QuantizedRows* x;
  int64_t first;
  float* out;  // the group's 8 outputs of row `first`
  int64_t out_stride;
};

// Portable loops: for each row and each of the group's 8 outputs, block by block, as the AVX2 path does.
template <bool Q8>
void tile_portable(const Tile& t, int64_t count) {
  constexpr int64_t bytes = group_block_bytes(Q8);
  for (int64_t r = t.first; r < t.first + count; ++r) {
    for (int64_t c = 0; c < kCols; ++c) {
      float acc = 0.0f;
      for (int64_t b = 0; b < t.blocks; ++b) {
        const uint8_t* g = t.group + b * bytes;
        const int8_t* qx = &t.x->q[(r * t.blocks + b) * kBlock];
        int32_t dot = 0;
        for (int64_t j = 0; j < kBlock; ++j) {
          const int64_t run = j % (kBlock / (Q8 ? 1 : 2)) / 4, at = run * 32 + c * 4 + j % 4;
          const int32_t q = Q8 ? static_cast<int8_t>(g[16 + at]) : (g[32 + at] >> (j < 16 ? 0 : 4)) & 0x0F;
          dot += q * qx[j];
        }
        const int64_t at = r * t.blocks + b;
        acc = std::fma(half_to_float(load_half(g + 2 * c)) * t.x->scale[at], static_cast<float>(dot), acc);
        if (!Q8) acc = std::fma(half_to_float(load_half(g + 16 + 2 * c)), t.x->scaled_sum[at], acc);
      }
      t.out[(r - t.first) * t.out_stride + c] = acc;
    }
  }
}

#if defined(SMOLSERVE_QUANT_AVX2)
inline __m256i broadcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm256_set1_epi32(four);
}

// Rows [first, first + R) against one group of a Q4 matrix: a block's 8 integer dot products per row in one
// vector, accumulated in int16 (at most 8 * 2 * 15 * 127 = 30480), then scaled and summed in float.
template <int64_t R>
void tile_q4_avx2(const Tile& t) {
  constexpr int64_t bytes = group_block_bytes(false);
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < t.blocks; ++b) {
    const uint8_t* g = t.group + b * bytes;
    const int8_t* qx[R];
    __m256i sums[R];
    for (int64_t r = 0; r < R; ++r) {
      qx[r] = &t.x->q[((t.first + r) * t.blocks + b) * kBlock];
      sums[r] = _mm256_setzero_si256();
    }
    for (int64_t k = 0; k < 4; ++k) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 32 + 32 * k));
      const __m256i low = _mm256_and_si256(w, nibble), high = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
      for (int64_t r = 0; r < R; ++r) {
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(low, broadcast4(qx[r] + 4 * k)),
                                           _mm256_maddubs_epi16(high, broadcast4(qx[r] + 16 + 4 * k)));
        sums[r] = _mm256_add_epi16(sums[r], p);
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 16)));
    for (int64_t r = 0; r < R; ++r) {
      const int64_t at = (t.first + r) * t.blocks + b;
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r], ones));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(t.x->scale[at])), dot, acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(t.x->scaled_sum[at]), acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) _mm256_storeu_ps(t.out + r * t.out_stride, acc[r]);
}

// The same for Q8: signed weights, so |q| times qx with q's sign; pairs reach 2 * 128 * 127, so int32 per run.
template <int64_t R>
void tile_q8_avx2(const Tile& t) {
  constexpr int64_t bytes = group_block_bytes(true);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < t.blocks; ++b) {
    const uint8_t* g = t.group + b * bytes;
    const int8_t* qx[R];
    __m256i sums[R];
    for (int64_t r = 0; r < R; ++r) {
      qx[r] = &t.x->q[((t.first + r) * t.blocks + b) * kBlock];
      sums[r] = _mm256_setzero_si256();
    }
    for (int64_t k = 0; k < 8; ++k) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 16 + 32 * k));
      const __m256i magnitude = _mm256_sign_epi8(w, w);
      for (int64_t r = 0; r < R; ++r) {
        const __m256i p = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(broadcast4(qx[r] + 4 * k), w));
        sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(p, ones));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
    for (int64_t r = 0; r < R; ++r) {
      const int64_t at = (t.first + r) * t.blocks + b;
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(t.x->scale[at])), _mm256_cvtepi32_ps(sums[r]), acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) _mm256_storeu_ps(t.out + r * t.out_stride, acc[r]);
}

template <bool Q8>
void tile_avx2(const Tile& t, int64_t count) {
  auto run = [&](auto rows) {
    if constexpr (Q8) tile_q8_avx2<decltype(rows)::value>(t);
    else tile_q4_avx2<decltype(rows)::value>(t);
  };
  switch (count) {
    case 1: return run(std::integral_constant<int64_t, 1>{});
    case 2: return run(std::integral_constant<int64_t, 2>{});
    case 3: return run(std::integral_constant<int64_t, 3>{});
    default: return run(std::integral_constant<int64_t, 4>{});
  }
}
#endif

using TileFn = void (*)(const Tile&, int64_t);

TileFn tile_function(bool q8, bool portable) {
#if defined(SMOLSERVE_QUANT_AVX2)
  if (!portable) return q8 ? tile_avx2<true> : tile_avx2<false>;
#endif
  return q8 ? tile_portable<true> : tile_portable<false>;
}

}  // namespace

namespace smolserve {

// weight uint8 [out, in / 32 * block bytes] in GGML's layout of `type` -> uint8 [ceil(out / 8), in / 32 * group
// block bytes], the layout `quant_linear` reads (outputs past `out` in the last group: zero scales).
at::Tensor quant_pack(const at::Tensor& weight, int64_t type) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte, "expected weight uint8 [out, bytes]");
  const int64_t bytes = block_bytes(type), out = weight.size(0);
  TORCH_CHECK(weight.size(1) % bytes == 0, "weight bytes per row are not whole blocks of this type");
  const int64_t blocks = weight.size(1) / bytes, groups = (out + kCols - 1) / kCols;
  const bool q8 = is_q8(type);
  const int64_t packed_bytes = group_block_bytes(q8);
  const at::Tensor source = weight.contiguous();
  at::Tensor packed = at::zeros({groups, blocks * packed_bytes}, weight.options());
  const uint8_t* w = source.const_data_ptr<uint8_t>();
  uint8_t* p = packed.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t c = 0; c < kCols && g * kCols + c < out; ++c) {
        for (int64_t b = 0; b < blocks; ++b) {
          uint16_t d, m;
          const uint8_t* quants;
          read_block(w + (g * kCols + c) * blocks * bytes + b * bytes, type, d, m, quants);
          uint8_t* to = p + (g * blocks + b) * packed_bytes;
          std::memcpy(to + 2 * c, &d, 2);
          if (!q8) std::memcpy(to + 16 + 2 * c, &m, 2);
          uint8_t* runs = to + (q8 ? 16 : 32);
          for (int64_t k = 0; k < (q8 ? 8 : 4); ++k) std::memcpy(runs + 32 * k + 4 * c, quants + 4 * k, 4);
        }
      }
    }
  });
  return packed;
}

// x [rows, in] float32 or bfloat16 (contiguous rows); packed: `quant_pack(weight, type)` of a weight with
// `out_features` rows; returns x @ W.T, [rows, out_features], in x's dtype. `portable` forces the plain loops.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t type, int64_t out_features,
                        bool portable) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2, "expected x [rows, in] and packed weight [groups, bytes]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed weight must be contiguous uint8");
  block_bytes(type);  // refuses unsupported types
  const bool q8 = is_q8(type);
  const int64_t rows = x.size(0), in = x.size(1), blocks = in / kBlock, groups = packed.size(0);
  TORCH_CHECK(in % kBlock == 0, "the input size must be a multiple of 32");
  TORCH_CHECK(packed.size(1) == blocks * group_block_bytes(q8), "packed weight bytes do not match the input size");
  TORCH_CHECK(out_features > (groups - 1) * kCols && out_features <= groups * kCols,
              "out_features does not match the packed weight's groups");
  const at::Tensor input = x.contiguous();
  QuantizedRows quantized;
  if (input.scalar_type() == at::kBFloat16) {
    quantized = quantize_rows(input.const_data_ptr<c10::BFloat16>(), rows, in);
  } else {
    TORCH_CHECK(input.scalar_type() == at::kFloat, "x must be float32 or bfloat16");
    quantized = quantize_rows(input.const_data_ptr<float>(), rows, in);
  }
  const int64_t width = groups * kCols;
  at::Tensor result = at::empty({rows, width}, input.options().dtype(at::kFloat));
  float* out = result.mutable_data_ptr<float>();
  const uint8_t* w = packed.const_data_ptr<uint8_t>();
  const int64_t group_bytes = packed.size(1);
  const TileFn tile = tile_function(q8, portable);
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = 0; chunk < rows; chunk += kChunk) {
      const int64_t chunk_end = std::min(rows, chunk + kChunk);
      for (int64_t g = begin; g < end; ++g) {
        for (int64_t first = chunk; first < chunk_end; first += kTile) {
          const Tile t{w + g * group_bytes, blocks, &quantized, first, out + first * width + g * kCols, width};
          tile(t, std::min(kTile, chunk_end - first));
        }
      }
    }
  });
  if (width != out_features) result = result.narrow(1, 0, out_features).contiguous();
  return input.scalar_type() == at::kFloat ? result : result.to(input.scalar_type());
}

}  // namespace smolserve

TORCH_LIBRARY_FRAGMENT(smolserve, m) {
  m.def("quant_pack(Tensor weight, int type) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor packed, int type, int out_features, bool portable=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(smolserve, CPU, m) {
  m.impl("quant_pack", &smolserve::quant_pack);
  m.impl("quant_linear", &smolserve::quant_linear);
}
