// One llama decoder layer over a step's packed rows, in one call: the ops the Python runner would call one by one
// (engine/model_runner.py, LlamaRunner.forward), called here directly, in the same order on the same tensors, so
// the result is bitwise the Python path's. For the path where every projection is a packed quantized matrix
// (quant_matmul.cpp) and the rows attend in decode_attention.cpp over a float32/bfloat16 cache. At one decoding
// row a layer is ~10 small ops and ~20 views: their Python dispatch cost ~1 ms of a ~7 ms step.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "ops.h"

namespace smolserve {

namespace {

// A packed quantized projection: its blocks, GGML type and number of outputs.
struct Projection {
  const at::Tensor& packed;
  int64_t type;
  int64_t out;

  at::Tensor operator()(const at::Tensor& x) const { return quant_linear(x, packed, type, out, 0); }
};

// As the runner's _rms_norm: normalized in float32 over the last dimension, scaled in the input's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return weight * at::rms_norm(x.to(at::kFloat), {x.size(-1)}, std::nullopt, eps).to(x.scalar_type());
}

}  // namespace

// hidden, normed [rows, hidden]: the residual stream and its input norm; returns the residual stream after the
// layer and its normalization by `next_norm` (the next layer's input norm, or the final norm).
// cos, sin [rows, head_dim]; keys, values: this layer's cache (decode_attention's layout); slots [rows]: where
// each row's K/V are stored; block_tables, lengths, block_size, window: as decode_attention takes them. What an
// architecture adds to a llama layer, as the runner's _LlamaLayer.extras: qkv_bias, q_norm and k_norm (qwen2,
// qwen3), the norms of the attention's and the MLP's outputs and GELU for SiLU (gemma3), each block's output scaled
// before the residual add (granite's residual multiplier).
std::tuple<at::Tensor, at::Tensor> llama_layer(
    const at::Tensor& hidden, const at::Tensor& normed, const at::Tensor& qkv, int64_t qkv_type, int64_t qkv_out,
    const at::Tensor& o, int64_t o_type, int64_t o_out, const at::Tensor& post_norm, const at::Tensor& gate_up,
    int64_t gate_up_type, int64_t gate_up_out, const at::Tensor& down, int64_t down_type, int64_t down_out,
    const at::Tensor& next_norm, double eps, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
    int64_t num_kv_heads, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slots,
    const at::Tensor& block_tables, const at::Tensor& lengths, int64_t block_size, double scale,
    const std::optional<at::Tensor>& qkv_bias, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, int64_t window, const std::optional<at::Tensor>& attn_out_norm,
    const std::optional<at::Tensor>& ffn_out_norm, bool gelu, double residual_scale) {
  const int64_t rows = hidden.size(0);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads");
  at::Tensor projected = Projection{qkv, qkv_type, qkv_out}(normed);
  if (qkv_bias.has_value()) projected = projected + *qkv_bias;
  const at::Tensor heads = projected.view({rows, num_heads + 2 * num_kv_heads, -1});
  at::Tensor qk = heads.narrow(1, 0, num_heads + num_kv_heads);
  if (q_norm.has_value() && k_norm.has_value()) {  // each head normalized before its rotation
    qk = at::cat({rms_norm(qk.narrow(1, 0, num_heads), *q_norm, eps),
                  rms_norm(qk.narrow(1, num_heads, num_kv_heads), *k_norm, eps)}, 1);
  }
  qk = rope(qk, cos, sin);  // q and k in one pass
  const at::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, num_kv_heads);
  write_kv(keys, values, slots, k, heads.narrow(1, num_heads + num_kv_heads, num_kv_heads));
  const at::Tensor grouped = q.reshape({rows, num_kv_heads, num_heads / num_kv_heads, -1});
  const at::Tensor attended =
      decode_attention(grouped, keys, values, block_tables, lengths, block_size, scale, window, std::nullopt);
  at::Tensor output = Projection{o, o_type, o_out}(attended.reshape({rows, -1}));
  if (residual_scale != 1.0) output = output * residual_scale;  // granite's residual multiplier
  const auto [residual, post_normed] = add_rms_norm(hidden, output, post_norm, eps, attn_out_norm);
  const at::Tensor projected_up = Projection{gate_up, gate_up_type, gate_up_out}(post_normed);
  const at::Tensor gated = gelu ? gelu_mul(projected_up) : silu_mul(projected_up);
  at::Tensor mlp = Projection{down, down_type, down_out}(gated);
  if (residual_scale != 1.0) mlp = mlp * residual_scale;
  return add_rms_norm(residual, mlp, next_norm, eps, ffn_out_norm);
}

}  // namespace smolserve

TORCH_LIBRARY_FRAGMENT(smolserve, m) {
  m.def(
      "llama_layer(Tensor hidden, Tensor normed, Tensor qkv, int qkv_type, int qkv_out, Tensor o, int o_type, "
      "int o_out, Tensor post_norm, Tensor gate_up, int gate_up_type, int gate_up_out, Tensor down, int down_type, "
      "int down_out, Tensor next_norm, float eps, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, "
      "Tensor(a!) keys, Tensor(b!) values, Tensor slots, Tensor block_tables, Tensor lengths, int block_size, "
      "float scale, Tensor? qkv_bias=None, Tensor? q_norm=None, Tensor? k_norm=None, int window=0, "
      "Tensor? attn_out_norm=None, Tensor? ffn_out_norm=None, bool gelu=False, float residual_scale=1.0) -> "
      "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(smolserve, CPU, m) { m.impl("llama_layer", &smolserve::llama_layer); }
