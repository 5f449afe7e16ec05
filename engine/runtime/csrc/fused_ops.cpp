// The small element-wise steps between a llama layer's matmuls, fused for bfloat16 or float32 rows on the CPU.
//
// In a decode step each of these runs on a few rows, so torch's cost is in dispatching its ~30 separate ops
// per layer, not in arithmetic. Each function below is one op. The arithmetic follows transformers' llama in
// float32 with results in the rows' dtype; intermediate roundings differ slightly, which is why dense float32
// models keep torch's ops (and their token-for-token parity with `generate`); float32 rows over quantized weights
// (`--quantization native`), which have no such parity to keep, take these.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"
#include "ops.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

using bf16 = c10::BFloat16;

using smolserve::narrow;
using smolserve::widen;

// Rows per parallel task: small batches run inline, without waking OpenMP's workers.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

void check_rows(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, " like the rows");
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous [rows, width] tensor");
}

// Calls body.template operator()<T>() with T the C++ type of `dtype` (bfloat16 or float32).
template <typename Body>
auto dispatch(at::ScalarType dtype, Body&& body) {
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "the fused ops take bfloat16 or float32 rows");
  return dtype == at::kBFloat16 ? body(bf16{}) : body(float{});
}

}  // namespace

namespace smolserve {

// hidden + delta, and that sum RMS-normalized and scaled by weight: (residual stream, next block's input).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& hidden, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps,
                                                const std::optional<at::Tensor>& delta_weight) {
  const at::ScalarType dtype = hidden.scalar_type();
  check_rows(hidden, "hidden", dtype);
  check_rows(delta, "delta", dtype);
  TORCH_CHECK(delta.sizes() == hidden.sizes(), "delta must match hidden");
  for (const at::Tensor* w : {&weight, delta_weight.has_value() ? &*delta_weight : &weight}) {
    TORCH_CHECK(w->scalar_type() == dtype && w->dim() == 1 && w->size(0) == hidden.size(1),
                "weights must be [width] tensors of the rows' dtype");
  }
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  at::Tensor sum = at::empty_like(hidden), normed = at::empty_like(hidden);
  const at::Tensor w_contiguous = weight.contiguous();
  const at::Tensor dw_contiguous = delta_weight.has_value() ? delta_weight->contiguous() : at::Tensor();
  dispatch(dtype, [&](auto zero) {
    using T = decltype(zero);
    const T* h = hidden.const_data_ptr<T>();
    const T* d = delta.const_data_ptr<T>();
    const T* w = w_contiguous.const_data_ptr<T>();
    T* s = sum.mutable_data_ptr<T>();
    T* n = normed.mutable_data_ptr<T>();
    const T* dw = delta_weight.has_value() ? dw_contiguous.const_data_ptr<T>() : nullptr;
    at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t o = r * width;
        if (dw != nullptr) {  // the block's output normalized first (Gemma 3), as the sum is below
          float delta_squares = 0.0f;
#pragma omp simd reduction(+ : delta_squares)
          for (int64_t i = 0; i < width; ++i) delta_squares += widen(d[o + i]) * widen(d[o + i]);
          const float scale = 1.0f / std::sqrt(delta_squares / static_cast<float>(width) + static_cast<float>(eps));
          for (int64_t i = 0; i < width; ++i) {
            const T delta_normed = narrow<T>(widen(dw[i]) * widen(narrow<T>(widen(d[o + i]) * scale)));
            s[o + i] = narrow<T>(widen(h[o + i]) + widen(delta_normed));
          }
        } else {
          for (int64_t i = 0; i < width; ++i) s[o + i] = narrow<T>(widen(h[o + i]) + widen(d[o + i]));
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < width; ++i) squares += widen(s[o + i]) * widen(s[o + i]);
        const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(width) + static_cast<float>(eps));
        for (int64_t i = 0; i < width; ++i) {
          n[o + i] = narrow<T>(widen(w[i]) * widen(narrow<T>(widen(s[o + i]) * inverse)));
        }
      }
    });
    return 0;
  });
  return {sum, normed};
}

// Rotary embedding of x [rows, heads, dim] (any row stride; heads and dim contiguous) with cos, sin
// [rows, dim]: x * cos + rotate_half(x) * sin. Returns a new contiguous tensor.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 3, "x must be a [rows, heads, dim] tensor");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "x's heads and dims must be contiguous");
  check_rows(cos, "cos", dtype);
  check_rows(sin, "sin", dtype);
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(cos.size(0) == rows && cos.size(1) == dim && sin.sizes() == cos.sizes(), "cos/sin shape mismatch");
  at::Tensor out = at::empty({rows, heads, dim}, x.options());
  dispatch(dtype, [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.const_data_ptr<T>();
    const T* cp = cos.const_data_ptr<T>();
    const T* sp = sin.const_data_ptr<T>();
    T* op = out.mutable_data_ptr<T>();
    const int64_t row_stride = x.stride(0);
    at::parallel_for(0, rows, grain(heads * dim), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* c = cp + r * dim;
        const T* s = sp + r * dim;
        for (int64_t h = 0; h < heads; ++h) {
          const T* in = xp + r * row_stride + h * dim;
          T* o = op + (r * heads + h) * dim;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float a = widen(in[i]), b = widen(in[i + half]);
            o[i] = narrow<T>(widen(narrow<T>(a * widen(c[i]))) - widen(narrow<T>(b * widen(s[i]))));
            o[i + half] =
                narrow<T>(widen(narrow<T>(b * widen(c[i + half]))) + widen(narrow<T>(a * widen(s[i + half]))));
          }
        }
      }
    });
    return 0;
  });
  return out;
}

// silu(gate) * up for gate_up = [gate | up] along the last dim.
namespace {

// The gated MLP's activation of the gate, times the up projection: x / (1 + e^-x) (SiLU), or GELU's tanh
// approximation 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as transformers' gelu_pytorch_tanh.
template <bool Gelu>
at::Tensor gated(const at::Tensor& gate_up) {
  const at::ScalarType dtype = gate_up.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "gate_up must be bfloat16 or float32");
  check_rows(gate_up, "gate_up", dtype);
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  dispatch(dtype, [&](auto zero) {
    using T = decltype(zero);
    const T* g = gate_up.const_data_ptr<T>();
    T* o = out.mutable_data_ptr<T>();
    at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = g + r * 2 * width;
        const T* up = gate + width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) {
          const float x = widen(gate[i]);
          const float act = Gelu ? 0.5f * x * (1.0f + std::tanh(0.7978845608f * (x + 0.044715f * x * x * x)))
                                 : x / (1.0f + std::exp(-x));
          o[r * width + i] = narrow<T>(widen(narrow<T>(act)) * widen(up[i]));
        }
      }
    });
    return 0;
  });
  return out;
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& gate_up) { return gated<false>(gate_up); }

at::Tensor gelu_mul(const at::Tensor& gate_up) { return gated<true>(gate_up); }

}  // namespace smolserve

TORCH_LIBRARY_FRAGMENT(smolserve, m) {
  m.def(
      "add_rms_norm(Tensor hidden, Tensor delta, Tensor weight, float eps, Tensor? delta_weight=None) -> "
      "(Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(smolserve, CPU, m) {
  m.impl("add_rms_norm", &smolserve::add_rms_norm);
  m.impl("rope", &smolserve::rope);
  m.impl("silu_mul", &smolserve::silu_mul);
  m.impl("gelu_mul", &smolserve::gelu_mul);
}
