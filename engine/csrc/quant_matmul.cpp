// Matmuls on a GGUF's quantized weights as they are stored: Q4_0, Q4_1 and Q8_0 blocks of 32 weights.
//
// Each weight row is a run of blocks along the input dimension:
//   Q4_0: fp16 d, 16 bytes of 4-bit q (byte j: weight j in the low nibble, weight 16 + j in the high); w = (q - 8) d
//   Q4_1: fp16 d, fp16 m, 16 bytes of 4-bit q as above;                                                 w = q d + m
//   Q8_0: fp16 d, 32 int8 q;                                                                            w = q d
// As llama.cpp does, each activation row is quantized per block of 32 to int8 with a scale a = max|x| / 127, and
// a block's dot product is an integer one: sum(w x) = d a sum(q qx) (+ m a sum(qx) for Q4_1; Q4_0 is Q4_1 with
// m = -8 d). On AVX2, 32 products of a block take one vpmaddubsw (unsigned 4-bit weights times signed 8-bit
// activations; Q8_0 through the sign trick) and one vpmaddwd; elsewhere, plain loops over the same integers.
//
// Every output is one fixed sequence of operations over its row's blocks, whatever the number of rows: a row's
// result does not depend on its batchmates (greedy decoding stays batch-invariant).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SMOLSERVE_QUANT_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 32;
// Rows taken at once per output, each weight block loaded once for all of them.
constexpr int64_t kRows = 4;
enum QuantType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };  // GGML's type numbers

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    default: TORCH_CHECK(false, "unsupported quantized type ", type, " (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8)");
  }
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(SMOLSERVE_QUANT_AVX2)
  return _cvtsh_ss(bits);  // one instruction (F16C), where c10::Half converts in software
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// The activations of one row, per block of 32: int8 values, their scale and their sum.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum;
  std::vector<float> scaled_sum;  // scale * sum: what a block's offset m multiplies
};

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t rows, int64_t in) {
  const int64_t blocks = in / kBlock;
  QuantizedRows out{std::vector<int8_t>(rows * in), std::vector<float>(rows * blocks), std::vector<int32_t>(rows * blocks),
                    std::vector<float>(rows * blocks)};
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
      out.sum[i] = total;
      out.scaled_sum[i] = scale * static_cast<float>(total);
    }
  });
  return out;
}

// One block's scale d and offset m (0 for Q8_0; -8 d for Q4_0), and where its quants start.
inline void block_header(const uint8_t* block, int64_t type, float& d, float& m, const uint8_t*& quants) {
  d = half_to_float(block);
  if (type == kQ4_1) {
    m = half_to_float(block + 2);
    quants = block + 4;
  } else {
    m = type == kQ4_0 ? -8.0f * d : 0.0f;
    quants = block + 2;
  }
}

// sum(q qx) over one block, portable.
inline int32_t block_dot_portable(const uint8_t* quants, int64_t type, const int8_t* qx) {
  int32_t total = 0;
  if (type == kQ8_0) {
    const auto* q = reinterpret_cast<const int8_t*>(quants);
    for (int64_t j = 0; j < kBlock; ++j) total += q[j] * qx[j];
  } else {
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      total += (quants[j] & 0x0F) * qx[j] + (quants[j] >> 4) * qx[j + kBlock / 2];
    }
  }
  return total;
}

// Rows [first, first + count) of the output column `o`: plain loops.
void dot_rows_portable(const uint8_t* weight_row, int64_t type, int64_t blocks, const QuantizedRows& x,
                       int64_t first, int64_t count, float* out, int64_t out_stride) {
  const int64_t bytes = block_bytes(type);
  for (int64_t r = first; r < first + count; ++r) {
    float total = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      float d, m;
      const uint8_t* quants;
      block_header(weight_row + b * bytes, type, d, m, quants);
      const int64_t at = r * blocks + b;
      const int32_t dot = block_dot_portable(quants, type, &x.q[at * kBlock]);
      total += d * x.scale[at] * static_cast<float>(dot) + m * x.scaled_sum[at];
    }
    out[r * out_stride] = total;
  }
}

#if defined(SMOLSERVE_QUANT_AVX2)
inline float hsum(__m256 v) {
  const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quad = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_add_ss(quad, _mm_movehdup_ps(quad)));
}

// A block's 32 weights as bytes in element order: unsigned 4-bit values, or (Q8_0) signed 8-bit ones.
template <int64_t Type>
inline __m256i load_quants(const uint8_t* quants) {
  if constexpr (Type == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(quants));
    const __m128i low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
  }
}

// 8 partial sums of q qx as int32 lanes.
template <int64_t Type>
inline __m256i block_dot_avx2(__m256i q, const int8_t* qx) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
  __m256i pairs;
  if constexpr (Type == kQ8_0) {
    pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));  // |q| times x with q's sign
  } else {
    pairs = _mm256_maddubs_epi16(q, x);
  }
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// The type is a template parameter: no branch on it per block, and the compiler schedules each type's loop alone.
template <int64_t Type>
void dot_rows_avx2_of(const uint8_t* weight_row, int64_t blocks, const QuantizedRows& x, int64_t first,
                      int64_t count, float* out, int64_t out_stride) {
  constexpr int64_t bytes = Type == kQ4_0 ? 18 : Type == kQ4_1 ? 20 : 34;
  __m256 acc[kRows];
  float offsets[kRows] = {};
  for (int64_t i = 0; i < count; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    float d, m;
    const uint8_t* quants;
    block_header(weight_row + b * bytes, Type, d, m, quants);
    const __m256i q = load_quants<Type>(quants);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t at = (first + i) * blocks + b;
      const __m256 dot = _mm256_cvtepi32_ps(block_dot_avx2<Type>(q, &x.q[at * kBlock]));
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.scale[at]), dot, acc[i]);
      if constexpr (Type != kQ8_0) offsets[i] += m * x.scaled_sum[at];
    }
  }
  for (int64_t i = 0; i < count; ++i) out[(first + i) * out_stride] = hsum(acc[i]) + offsets[i];
}

void dot_rows_avx2(const uint8_t* weight_row, int64_t type, int64_t blocks, const QuantizedRows& x, int64_t first,
                   int64_t count, float* out, int64_t out_stride) {
  switch (type) {
    case kQ4_0: return dot_rows_avx2_of<kQ4_0>(weight_row, blocks, x, first, count, out, out_stride);
    case kQ4_1: return dot_rows_avx2_of<kQ4_1>(weight_row, blocks, x, first, count, out, out_stride);
    default: return dot_rows_avx2_of<kQ8_0>(weight_row, blocks, x, first, count, out, out_stride);
  }
}
#endif

}  // namespace

// x [rows, in] float32 or bfloat16 (contiguous rows); weight uint8 [out, in / 32 * block bytes] in GGML's layout
// of `type`; returns x @ W.T, [rows, out], in x's dtype. `portable` forces the plain loops (for tests).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, int64_t type, bool portable) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "expected x [rows, in] and weight [out, bytes]");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous(), "weight must be contiguous uint8");
  const int64_t rows = x.size(0), in = x.size(1), out_features = weight.size(0), blocks = in / kBlock;
  TORCH_CHECK(in % kBlock == 0, "the input size must be a multiple of 32");
  TORCH_CHECK(weight.size(1) == blocks * block_bytes(type), "weight bytes per row do not match the input size");
  const at::Tensor input = x.contiguous();
  QuantizedRows quantized;
  if (input.scalar_type() == at::kBFloat16) {
    quantized = quantize_rows(input.const_data_ptr<c10::BFloat16>(), rows, in);
  } else {
    TORCH_CHECK(input.scalar_type() == at::kFloat, "x must be float32 or bfloat16");
    quantized = quantize_rows(input.const_data_ptr<float>(), rows, in);
  }
  at::Tensor result = at::empty({rows, out_features}, input.options().dtype(at::kFloat));
  float* out = result.mutable_data_ptr<float>();
  const uint8_t* w = weight.const_data_ptr<uint8_t>();
  const int64_t row_bytes = weight.size(1);
  auto dot_rows = dot_rows_portable;
#if defined(SMOLSERVE_QUANT_AVX2)
  if (!portable) dot_rows = dot_rows_avx2;
#endif
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      for (int64_t first = 0; first < rows; first += kRows) {
        dot_rows(w + o * row_bytes, type, blocks, quantized, first, std::min(kRows, rows - first), out + o,
                 out_features);
      }
    }
  });
  return input.scalar_type() == at::kFloat ? result : result.to(input.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(smolserve, m) {
  m.def("quant_linear(Tensor x, Tensor weight, int type, bool portable=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(smolserve, CPU, m) { m.impl("quant_linear", &quant_linear); }
