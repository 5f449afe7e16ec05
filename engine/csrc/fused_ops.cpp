// The small element-wise steps between a llama layer's matmuls, fused for bfloat16 rows on the CPU.
//
// In a decode step each of these runs on a few rows, so torch's cost is in dispatching its ~30 separate ops
// per layer, not in arithmetic. Each function below is one op. The arithmetic follows transformers' llama in
// float32 with bfloat16 results; intermediate roundings differ slightly, which is why float32 models keep
// torch's ops (and their token-for-token parity with `generate`).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

using bf16 = c10::BFloat16;

inline float widen(bf16 value) {
  uint32_t bits = static_cast<uint32_t>(value.x) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(float));
  return result;
}

// Round to nearest even, as c10::BFloat16 does for finite values, in a form that vectorizes.
inline bf16 narrow(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(float));
  bits += 0x7FFF + ((bits >> 16) & 1);
  return bf16(static_cast<uint16_t>(bits >> 16), bf16::from_bits());
}

// Rows per parallel task: small batches run inline, without waking OpenMP's workers.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16");
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous [rows, width] tensor");
}

// hidden + delta, and that sum RMS-normalized and scaled by weight: (residual stream, next block's input).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& hidden, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  check_rows(hidden, "hidden");
  check_rows(delta, "delta");
  TORCH_CHECK(delta.sizes() == hidden.sizes(), "delta must match hidden");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 1 && weight.size(0) == hidden.size(1),
              "weight must be a bfloat16 [width] tensor");
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  at::Tensor sum = at::empty_like(hidden), normed = at::empty_like(hidden);
  const bf16* h = hidden.const_data_ptr<bf16>();
  const bf16* d = delta.const_data_ptr<bf16>();
  const bf16* w = weight.contiguous().const_data_ptr<bf16>();
  bf16* s = sum.mutable_data_ptr<bf16>();
  bf16* n = normed.mutable_data_ptr<bf16>();
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t o = r * width;
      for (int64_t i = 0; i < width; ++i) s[o + i] = narrow(widen(h[o + i]) + widen(d[o + i]));
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < width; ++i) squares += widen(s[o + i]) * widen(s[o + i]);
      const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(width) + static_cast<float>(eps));
      for (int64_t i = 0; i < width; ++i) n[o + i] = narrow(widen(w[i]) * widen(narrow(widen(s[o + i]) * inverse)));
    }
  });
  return {sum, normed};
}

// Rotary embedding of x [rows, heads, dim] (any row stride; heads and dim contiguous) with cos, sin
// [rows, dim]: x * cos + rotate_half(x) * sin. Returns a new contiguous tensor.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3, "x must be a bfloat16 [rows, heads, dim] tensor");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "x's heads and dims must be contiguous");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(cos.size(0) == rows && cos.size(1) == dim && sin.sizes() == cos.sizes(), "cos/sin shape mismatch");
  at::Tensor out = at::empty({rows, heads, dim}, x.options());
  const bf16* xp = x.const_data_ptr<bf16>();
  const bf16* cp = cos.const_data_ptr<bf16>();
  const bf16* sp = sin.const_data_ptr<bf16>();
  bf16* op = out.mutable_data_ptr<bf16>();
  const int64_t row_stride = x.stride(0);
  at::parallel_for(0, rows, grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16* c = cp + r * dim;
      const bf16* s = sp + r * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const bf16* in = xp + r * row_stride + h * dim;
        bf16* o = op + (r * heads + h) * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = widen(in[i]), b = widen(in[i + half]);
          o[i] = narrow(widen(narrow(a * widen(c[i]))) - widen(narrow(b * widen(s[i]))));
          o[i + half] = narrow(widen(narrow(b * widen(c[i + half]))) + widen(narrow(a * widen(s[i + half]))));
        }
      }
    }
  });
  return out;
}

// silu(gate) * up for gate_up = [gate | up] along the last dim.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  const bf16* g = gate_up.const_data_ptr<bf16>();
  bf16* o = out.mutable_data_ptr<bf16>();
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16* gate = g + r * 2 * width;
      const bf16* up = gate + width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float x = widen(gate[i]);
        o[r * width + i] = narrow(widen(narrow(x / (1.0f + std::exp(-x)))) * widen(up[i]));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(smolserve, m) {
  m.def("add_rms_norm(Tensor hidden, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(smolserve, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_mul", &silu_mul);
}
