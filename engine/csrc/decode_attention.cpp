// Decode attention over the slot KV cache: one new query token per sequence, grouped-query heads.
//
// For each (sequence, KV head) the kernel streams that head's keys and values once, in blocks, with an
// online softmax in float32, and serves every query head of the group from the same pass. It has none of
// the per-call setup of a general attention kernel, which dominates when contexts are short; on this
// project's 2-core CPU it ran 2-3x faster than torch's scaled_dot_product_attention at 25 to 2048 positions.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr int64_t kBlock = 64;  // positions per block of scores

// bfloat16 is the top half of a float32: widening is a shift, which vectorizes (c10's conversion does not).
inline float widen(c10::BFloat16 value) {
  uint32_t bits = static_cast<uint32_t>(value.x) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(float));
  return result;
}

inline float widen(float value) { return value; }

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = widen(src[i]);
}

constexpr int64_t kMaxDim = 256;
constexpr int64_t kMaxGroups = 16;

// One (sequence, KV head): `groups` query rows against `length` cached positions. `Dim` is the head size
// when known at compile time (the loops over it then unroll and vectorize fully), or 0 for any size.
template <typename T, int64_t Dim>
void attend_one(const T* query, const T* keys, const T* values, T* out, int64_t groups, int64_t dynamic_dim,
                int64_t length, int64_t key_stride, int64_t value_stride, float scale) {
  const int64_t dim = Dim ? Dim : dynamic_dim;
  alignas(64) float q[kMaxGroups * kMaxDim];
  alignas(64) float acc[kMaxGroups * kMaxDim];
  alignas(64) float row[kMaxDim];
  alignas(64) float scores[kMaxGroups * kBlock];
  float running_max[kMaxGroups], total[kMaxGroups];
  for (int64_t g = 0; g < groups; ++g) {
    to_float(query + g * dim, &q[g * dim], dim);
    for (int64_t d = 0; d < dim; ++d) q[g * dim + d] *= scale;
    std::fill(&acc[g * dim], &acc[g * dim] + dim, 0.0f);
    running_max[g] = -std::numeric_limits<float>::infinity();
    total[g] = 0.0f;
  }
  for (int64_t start = 0; start < length; start += kBlock) {
    const int64_t count = std::min(kBlock, length - start);
    for (int64_t t = 0; t < count; ++t) {
      const T* key = keys + (start + t) * key_stride;
      for (int64_t g = 0; g < groups; ++g) {
        const float* qg = &q[g * dim];
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += qg[d] * widen(key[d]);
        scores[g * kBlock + t] = dot;
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      float* s = &scores[g * kBlock];
      float block_max = *std::max_element(s, s + count);
      float new_max = std::max(running_max[g], block_max);
      float correction = std::exp(running_max[g] - new_max);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < count; ++t) {
        s[t] = std::exp(s[t] - new_max);
        sum += s[t];
      }
      total[g] = total[g] * correction + sum;
      running_max[g] = new_max;
      float* a = &acc[g * dim];
      for (int64_t d = 0; d < dim; ++d) a[d] *= correction;
    }
    for (int64_t t = 0; t < count; ++t) {
      to_float(values + (start + t) * value_stride, row, dim);
      for (int64_t g = 0; g < groups; ++g) {
        const float p = scores[g * kBlock + t];
        float* a = &acc[g * dim];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] += p * row[d];
      }
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    const float inverse = 1.0f / total[g];
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = static_cast<T>(acc[g * dim + d] * inverse);
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, at::Tensor& out,
         const int64_t* len, float scale) {
  const int64_t heads = q.size(1), groups = q.size(2), dim = q.size(3);
  const T* qp = q.const_data_ptr<T>();
  const T* kp = keys.const_data_ptr<T>();
  const T* vp = values.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const auto attend = dim == 64 ? attend_one<T, 64> : dim == 128 ? attend_one<T, 128> : attend_one<T, 0>;
  at::parallel_for(0, q.size(0) * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / heads, h = item % heads;
      attend(qp + item * groups * dim, kp + i * keys.stride(0) + h * keys.stride(1),
             vp + i * values.stride(0) + h * values.stride(1), op + item * groups * dim, groups, dim, len[i],
             keys.stride(2), values.stride(2), scale);
    }
  });
}

// query [n, kv_heads, groups, dim]; keys, values [n, kv_heads, positions, dim] (any strides, innermost 1);
// lengths [n] int64: sequence i attends positions 0..lengths[i]-1. Returns [n, kv_heads, groups, dim].
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& lengths, double scale) {
  TORCH_CHECK(query.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "expected 4-d query, keys, values");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "keys and values need a contiguous last dim");
  TORCH_CHECK(keys.scalar_type() == query.scalar_type() && values.scalar_type() == query.scalar_type(),
              "query, keys and values must share a dtype");
  const at::Tensor q = query.contiguous();
  const at::Tensor lens = lengths.to(at::kLong).contiguous();
  const int64_t n = q.size(0), heads = q.size(1), groups = q.size(2), dim = q.size(3);
  TORCH_CHECK(keys.size(0) >= n && keys.size(1) == heads && keys.size(3) == dim, "keys shape mismatch");
  TORCH_CHECK(lens.numel() == n, "one length per sequence");
  TORCH_CHECK(dim <= kMaxDim && groups <= kMaxGroups, "head_dim or query heads per KV head too large");
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(len[i] >= 1 && len[i] <= keys.size(2), "length out of range");
  }
  at::Tensor out = at::empty_like(q);
  if (q.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(q, keys, values, out, len, static_cast<float>(scale));
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_attention supports float32 and bfloat16");
    run<float>(q, keys, values, out, len, static_cast<float>(scale));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(smolserve, m) {
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(smolserve, CPU, m) { m.impl("decode_attention", &decode_attention); }
