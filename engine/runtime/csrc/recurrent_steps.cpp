// The element-wise steps of the recurrent layers around their scans, one op each side, for bfloat16 or float32 rows
// on the CPU: Mamba-2's (Granite 4.0-H) and the Gated DeltaNet's (Qwen3.5). At one decoding row a layer's ~40 small
// torch ops between its projections cost more than its scan; at a prompt's 256 rows, torch's ops in calls of a few
// rows each (engine/runtime/model_runner.py, _by_rows) cost a Qwen3.5 prompt a fifth of its time. These take their
// place (LlamaRunner._mamba, LlamaRunner._delta_net).
//
// mamba_inputs: after the short convolution, x, B and C (the convolution's output plus its bias, through SiLU,
// rounded to the rows' dtype as torch's ops round them, then widened), B and C repeated for each head of their
// group, and each head's step dt = softplus(dt + dt_bias) and its decay dt A, in float32 as the scan takes them.
// mamba_output: the scan's read plus D x, times SiLU(z), RMS-normalized by groups, times the norm's weights,
// rounded to the rows' dtype.
// delta_inputs: after the short convolution, the query, key and value (SiLU, rounded to the rows' dtype, widened),
// the query and key L2-normalized per head, the query scaled by 1/sqrt(key dim), both repeated for the value heads
// each key head serves; beta = sigmoid(b) and the decay softplus(a + dt_bias) A, per value head.
// delta_output: each head's read RMS-normalized, times the norm's weights and SiLU(z), rounded to the rows' dtype.
// Each row is computed alone, the same code for every row: a row's result is the same bits whatever else the step
// holds.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using bf16 = c10::BFloat16;
using smolserve::narrow;
using smolserve::widen;

// The largest value head the gated norm takes (Qwen3.5's: 128).
constexpr int64_t kMaxValueDim = 512;

// Rows a task takes: one row is ~10k elements; small steps run inline.
constexpr int64_t kGrain = 4;

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// As torch's softplus (beta 1, threshold 20).
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

struct Shape {
  int64_t heads, head_dim, groups, state;
  int64_t inner() const { return heads * head_dim; }
  int64_t per_group() const { return heads / groups; }
};

// Elements a vector step takes: every element goes through the same vectorized code, its place in the row or its
// address aside (a loop's scalar remainder, or a peel for alignment, would compute some with the scalar exp).
constexpr int64_t kLanes = 16;

// out[i] = f(in(i)) for i < n, kLanes at a time through an aligned buffer, the last ones padded with zeros.
template <typename In, typename F>
inline void map_lanes(int64_t n, In in, float* out, F f) {
  alignas(64) float lanes[kLanes];
  for (int64_t i = 0; i < n; i += kLanes) {
    const int64_t m = std::min(kLanes, n - i);
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] = j < m ? in(i + j) : 0.0f;
#pragma omp simd aligned(lanes : 64)
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] = f(lanes[j]);
    for (int64_t j = 0; j < m; ++j) out[i + j] = lanes[j];
  }
}

// One row: x (its channels), B and C (repeated per head), the step and decay per head; scratch [2 groups state].
template <typename T>
void inputs_row(const T* xbc, const T* bias, const T* dt, const float* dt_bias, const float* decay, Shape s,
                float* scratch, float* x, float* b, float* c, float* step, float* decay_step) {
  const int64_t inner = s.inner(), shared = s.groups * s.state;
  // The bias added in the rows' dtype, SiLU rounded to it: as torch's ops on the rows.
  const auto biased = [&](int64_t i) { return widen(narrow<T>(widen(xbc[i]) + widen(bias[i]))); };
  const auto rounded_silu = [](float v) { return widen(narrow<T>(silu(v))); };
  map_lanes(inner, biased, x, rounded_silu);
  map_lanes(2 * shared, [&](int64_t i) { return biased(inner + i); }, scratch, rounded_silu);
  for (int64_t h = 0; h < s.heads; ++h) {
    const int64_t group = h / s.per_group();
    std::memcpy(b + h * s.state, scratch + group * s.state, s.state * sizeof(float));
    std::memcpy(c + h * s.state, scratch + shared + group * s.state, s.state * sizeof(float));
  }
  for (int64_t h = 0; h < s.heads; ++h) {
    step[h] = softplus(widen(dt[h]) + dt_bias[h]);
    decay_step[h] = step[h] * decay[h];
  }
}

// y's squares summed in kLanes running sums, then those in order: the same order at any address.
inline float sum_of_squares(const float* y, int64_t n) {
  float partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) partial[j] += y[i + j] * y[i + j];
  }
  for (int64_t j = 0; i + j < n; ++j) partial[j] += y[i + j] * y[i + j];
  float sum = 0.0f;
  for (int64_t j = 0; j < kLanes; ++j) sum += partial[j];
  return sum;
}

// One row: (read + D x) silu(z), RMS-normalized by groups, times the norm's weights; scratch [heads head_dim].
template <typename T>
void output_row(const float* read, const float* x, const float* skip, const T* z, const float* norm, Shape s,
                double eps, float* scratch, T* out) {
  const int64_t width = s.inner() / s.groups;
  map_lanes(s.inner(), [&](int64_t i) { return widen(z[i]); }, scratch, silu);
  for (int64_t h = 0; h < s.heads; ++h) {
    for (int64_t d = 0; d < s.head_dim; ++d) {
      const int64_t i = h * s.head_dim + d;
      scratch[i] *= read[i] + x[i] * skip[h];
    }
  }
  for (int64_t g = 0; g < s.groups; ++g) {
    const float* y = scratch + g * width;
    const float squares = sum_of_squares(y, width);
    const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(width) + static_cast<float>(eps));
    for (int64_t i = 0; i < width; ++i) out[g * width + i] = narrow<T>(y[i] * inverse * norm[g * width + i]);
  }
}

// The Gated DeltaNet's shapes; `tiled`: value head j reads key head j % key heads (llama.cpp's converter's order),
// else j / (value heads / key heads) (transformers').
struct DeltaShape {
  int64_t key_heads, value_heads, key_dim, value_dim;
  bool tiled;
  int64_t keys() const { return key_heads * key_dim; }
  int64_t values() const { return value_heads * value_dim; }
  int64_t key_head(int64_t j) const {
    return tiled ? j % key_heads : j / (value_heads / key_heads);
  }
};

// One row: q and k [value heads, key dim], v [value heads, value dim], decay and beta [value heads]; scratch
// [2 keys]: the key heads' query and key before they are repeated.
template <typename T>
void delta_inputs_row(const T* mixed, const T* b, const T* a, const float* dt_bias, const float* decay, DeltaShape s,
                      float* scratch, float* q, float* k, float* v, float* decay_out, float* beta) {
  const auto rounded_silu = [](float x) { return widen(narrow<T>(silu(x))); };
  map_lanes(2 * s.keys(), [&](int64_t i) { return widen(mixed[i]); }, scratch, rounded_silu);
  map_lanes(s.values(), [&](int64_t i) { return widen(mixed[2 * s.keys() + i]); }, v, rounded_silu);
  const float query_scale = 1.0f / std::sqrt(static_cast<float>(s.key_dim));
  for (int64_t h = 0; h < 2 * s.key_heads; ++h) {  // the query's heads, then the key's: each over its L2 norm
    float* x = scratch + h * s.key_dim;
    const float inverse = 1.0f / std::sqrt(sum_of_squares(x, s.key_dim) + 1e-6f);
    const float scale = h < s.key_heads ? query_scale : 1.0f;
    for (int64_t i = 0; i < s.key_dim; ++i) x[i] = h < s.key_heads ? x[i] * inverse * scale : x[i] * inverse;
  }
  for (int64_t j = 0; j < s.value_heads; ++j) {
    const int64_t from = s.key_head(j) * s.key_dim;
    std::memcpy(q + j * s.key_dim, scratch + from, s.key_dim * sizeof(float));
    std::memcpy(k + j * s.key_dim, scratch + s.keys() + from, s.key_dim * sizeof(float));
    beta[j] = sigmoid(widen(b[j]));
    decay_out[j] = decay[j] * softplus(widen(a[j]) + dt_bias[j]);
  }
}

// One row: each value head's read over its RMS, times the norm's weights [value dim] and SiLU(z); scratch [values].
// Rounded to the rows' dtype where torch's ops on them round: the read, its normalization, the weights' product.
template <typename T>
void delta_output_row(const float* read, const T* z, const T* norm, DeltaShape s, double eps, float* scratch,
                      T* out) {
  map_lanes(s.values(), [&](int64_t i) { return widen(z[i]); }, scratch, silu);
  float y[kMaxValueDim];
  for (int64_t j = 0; j < s.value_heads; ++j) {
    for (int64_t i = 0; i < s.value_dim; ++i) y[i] = widen(narrow<T>(read[j * s.value_dim + i]));
    const float squares = sum_of_squares(y, s.value_dim);
    const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(s.value_dim) + static_cast<float>(eps));
    for (int64_t i = 0; i < s.value_dim; ++i) {
      const float weighted = widen(narrow<T>(widen(norm[i]) * widen(narrow<T>(y[i] * inverse))));
      out[j * s.value_dim + i] = narrow<T>(weighted * scratch[j * s.value_dim + i]);
    }
  }
}

void check_float(const at::Tensor& t, const char* name, int64_t size) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == size && t.is_contiguous(), name,
              " must be a contiguous float32 [", size, "] tensor");
}

void check_rows(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t rows, int64_t width) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be of the rows' dtype");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == width && t.stride(1) == 1, name, " must be [", rows,
              ", ", width, "] with contiguous rows");
}

}  // namespace

namespace smolserve {

// xbc [rows, heads * head_dim + 2 * groups * state]: the convolution's output; conv_bias [channels] (its dtype);
// dt [rows, heads] (any row stride); dt_bias, decay [heads] float32. Returns x [rows, heads, head_dim], B and C
// [rows, heads, state], the step and the decay [rows, heads], all float32.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> mamba_inputs(
    const at::Tensor& xbc, const std::optional<at::Tensor>& conv_bias, const at::Tensor& dt, const at::Tensor& dt_bias,
    const at::Tensor& decay, int64_t heads, int64_t head_dim, int64_t groups, int64_t state) {
  const Shape s{heads, head_dim, groups, state};
  TORCH_CHECK(heads > 0 && groups > 0 && heads % groups == 0, "heads must be a multiple of groups");
  const at::ScalarType dtype = xbc.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "the rows must be bfloat16 or float32");
  const int64_t rows = xbc.size(0), channels = s.inner() + 2 * groups * state;
  check_rows(xbc, "xbc", dtype, rows, channels);
  TORCH_CHECK(xbc.is_contiguous(), "xbc must be contiguous");
  check_rows(dt, "dt", dtype, rows, heads);
  if (conv_bias.has_value()) {
    TORCH_CHECK(conv_bias->scalar_type() == dtype && conv_bias->dim() == 1 && conv_bias->size(0) == channels &&
                    conv_bias->is_contiguous(),
                "conv_bias must be a contiguous [channels] tensor of the rows' dtype");
  }
  check_float(dt_bias, "dt_bias", heads);
  check_float(decay, "decay", heads);
  const auto f32 = xbc.options().dtype(at::kFloat);
  at::Tensor x = at::empty({rows, heads, head_dim}, f32), b = at::empty({rows, heads, state}, f32);
  at::Tensor c = at::empty({rows, heads, state}, f32), step = at::empty({rows, heads}, f32);
  at::Tensor decay_step = at::empty({rows, heads}, f32);
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    const at::Tensor bias_or_zeros = conv_bias.has_value() ? *conv_bias : at::zeros({channels}, xbc.options());
    const T* bias = bias_or_zeros.const_data_ptr<T>();  // (adding zeros changes no value)
    at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(2 * groups * state);
      for (int64_t r = begin; r < end; ++r) {
        inputs_row<T>(xbc.const_data_ptr<T>() + r * channels, bias, dt.const_data_ptr<T>() + r * dt.stride(0),
                      dt_bias.const_data_ptr<float>(), decay.const_data_ptr<float>(), s, scratch.data(),
                      x.mutable_data_ptr<float>() + r * s.inner(), b.mutable_data_ptr<float>() + r * heads * state,
                      c.mutable_data_ptr<float>() + r * heads * state, step.mutable_data_ptr<float>() + r * heads,
                      decay_step.mutable_data_ptr<float>() + r * heads);
      }
    });
  };
  dtype == at::kBFloat16 ? run(bf16{}) : run(float{});
  return {x, b, c, step, decay_step};
}

// read, x [rows, heads, head_dim] float32: the scan's read and its input; skip [heads] (D) and norm
// [heads * head_dim] float32; z [rows, heads * head_dim] (any row stride) of the rows' dtype, which the result takes.
at::Tensor mamba_output(const at::Tensor& read, const at::Tensor& x, const at::Tensor& skip, const at::Tensor& z,
                        const at::Tensor& norm, int64_t groups, double eps) {
  TORCH_CHECK(read.dim() == 3 && read.scalar_type() == at::kFloat && read.is_contiguous(),
              "read must be a contiguous float32 [rows, heads, head_dim] tensor");
  TORCH_CHECK(x.sizes() == read.sizes() && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must match read");
  const int64_t rows = read.size(0), heads = read.size(1), head_dim = read.size(2);
  const Shape s{heads, head_dim, groups, 0};
  TORCH_CHECK(groups > 0 && heads % groups == 0, "heads must be a multiple of groups");
  const at::ScalarType dtype = z.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "z must be bfloat16 or float32");
  check_rows(z, "z", dtype, rows, s.inner());
  check_float(skip, "skip", heads);
  check_float(norm, "norm", s.inner());
  at::Tensor out = at::empty({rows, s.inner()}, z.options());
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(s.inner());
      for (int64_t r = begin; r < end; ++r) {
        const int64_t o = r * s.inner();
        output_row<T>(read.const_data_ptr<float>() + o, x.const_data_ptr<float>() + o, skip.const_data_ptr<float>(),
                      z.const_data_ptr<T>() + r * z.stride(0), norm.const_data_ptr<float>(), s, eps,
                      scratch.data(), out.mutable_data_ptr<T>() + o);
      }
    });
  };
  dtype == at::kBFloat16 ? run(bf16{}) : run(float{});
  return out;
}

// mixed [rows, 2 keys + values]: the convolution's output (query, key, value); gates [rows, 2 value heads] (any row
// stride): b, then a; dt_bias, decay [value heads] float32. Returns the query and key [rows, value heads, key dim],
// the value [rows, value heads, value dim], the decay and beta [rows, value heads], all float32.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> delta_inputs(
    const at::Tensor& mixed, const at::Tensor& gates, const at::Tensor& dt_bias, const at::Tensor& decay,
    int64_t key_heads, int64_t value_heads, int64_t key_dim, int64_t value_dim, bool tiled) {
  const DeltaShape s{key_heads, value_heads, key_dim, value_dim, tiled};
  TORCH_CHECK(key_heads > 0 && value_heads % key_heads == 0, "value heads must be a multiple of key heads");
  const at::ScalarType dtype = mixed.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "the rows must be bfloat16 or float32");
  const int64_t rows = mixed.size(0);
  check_rows(mixed, "mixed", dtype, rows, 2 * s.keys() + s.values());
  TORCH_CHECK(mixed.is_contiguous(), "mixed must be contiguous");
  check_rows(gates, "gates", dtype, rows, 2 * value_heads);
  check_float(dt_bias, "dt_bias", value_heads);
  check_float(decay, "decay", value_heads);
  const auto f32 = mixed.options().dtype(at::kFloat);
  at::Tensor q = at::empty({rows, value_heads, key_dim}, f32), k = at::empty({rows, value_heads, key_dim}, f32);
  at::Tensor v = at::empty({rows, value_heads, value_dim}, f32), decay_out = at::empty({rows, value_heads}, f32);
  at::Tensor beta = at::empty({rows, value_heads}, f32);
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(2 * s.keys());
      for (int64_t r = begin; r < end; ++r) {
        const T* row_gates = gates.const_data_ptr<T>() + r * gates.stride(0);
        delta_inputs_row<T>(mixed.const_data_ptr<T>() + r * mixed.size(1), row_gates, row_gates + value_heads,
                            dt_bias.const_data_ptr<float>(), decay.const_data_ptr<float>(), s, scratch.data(),
                            q.mutable_data_ptr<float>() + r * value_heads * key_dim,
                            k.mutable_data_ptr<float>() + r * value_heads * key_dim,
                            v.mutable_data_ptr<float>() + r * s.values(),
                            decay_out.mutable_data_ptr<float>() + r * value_heads,
                            beta.mutable_data_ptr<float>() + r * value_heads);
      }
    });
  };
  dtype == at::kBFloat16 ? run(bf16{}) : run(float{});
  return {q, k, v, decay_out, beta};
}

// read [rows, value heads, value dim] float32: what the rule's queries read; z [rows, value heads * value dim] (any
// row stride) of the rows' dtype, which the result takes; norm [value dim] of the rows' dtype.
at::Tensor delta_output(const at::Tensor& read, const at::Tensor& z, const at::Tensor& norm, double eps) {
  TORCH_CHECK(read.dim() == 3 && read.scalar_type() == at::kFloat && read.is_contiguous(),
              "read must be a contiguous float32 [rows, heads, value dim] tensor");
  const int64_t rows = read.size(0), heads = read.size(1), value_dim = read.size(2);
  const DeltaShape s{1, heads, 0, value_dim, false};
  const at::ScalarType dtype = z.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "z must be bfloat16 or float32");
  check_rows(z, "z", dtype, rows, s.values());
  TORCH_CHECK(value_dim <= kMaxValueDim, "value heads of at most ", kMaxValueDim);
  TORCH_CHECK(norm.scalar_type() == dtype && norm.dim() == 1 && norm.size(0) == value_dim && norm.is_contiguous(),
              "norm must be a contiguous [value dim] tensor of the rows' dtype");
  at::Tensor out = at::empty({rows, s.values()}, z.options());
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(s.values());
      for (int64_t r = begin; r < end; ++r) {
        delta_output_row<T>(read.const_data_ptr<float>() + r * s.values(), z.const_data_ptr<T>() + r * z.stride(0),
                            norm.const_data_ptr<T>(), s, eps, scratch.data(),
                            out.mutable_data_ptr<T>() + r * s.values());
      }
    });
  };
  dtype == at::kBFloat16 ? run(bf16{}) : run(float{});
  return out;
}

}  // namespace smolserve

TORCH_LIBRARY_FRAGMENT(smolserve, m) {
  m.def(
      "mamba_inputs(Tensor xbc, Tensor? conv_bias, Tensor dt, Tensor dt_bias, Tensor decay, int heads, int head_dim, "
      "int groups, int state) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("mamba_output(Tensor read, Tensor x, Tensor skip, Tensor z, Tensor norm, int groups, float eps) -> Tensor");
  m.def(
      "delta_inputs(Tensor mixed, Tensor gates, Tensor dt_bias, Tensor decay, int key_heads, int value_heads, "
      "int key_dim, int value_dim, bool tiled) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("delta_output(Tensor read, Tensor z, Tensor norm, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(smolserve, CPU, m) {
  m.impl("mamba_inputs", &smolserve::mamba_inputs);
  m.impl("mamba_output", &smolserve::mamba_output);
  m.impl("delta_inputs", &smolserve::delta_inputs);
  m.impl("delta_output", &smolserve::delta_output);
}
