// Every native op, declared once. Each is registered as torch.ops.smolserve.<name> by the file that defines it;
// native code calls them directly (llama_layer.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace smolserve {

// decode_attention.cpp
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& block_tables, const at::Tensor& lengths, int64_t block_size,
                            double scale, int64_t window, const std::optional<at::Tensor>& sinks);
void write_kv(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slots, const at::Tensor& key,
              const at::Tensor& value);

// int8_attention.cpp
at::Tensor decode_attention_int8(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                                 const at::Tensor& key_scales, const at::Tensor& value_scales,
                                 const at::Tensor& block_tables, const at::Tensor& lengths, int64_t block_size,
                                 double scale, int64_t window, const std::optional<at::Tensor>& sinks);
void write_kv_int8(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& key_scales,
                   const at::Tensor& value_scales, const at::Tensor& positions, const at::Tensor& key,
                   const at::Tensor& value);

// fused_ops.cpp
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& hidden, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps,
                                                const std::optional<at::Tensor>& delta_weight);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor gelu_mul(const at::Tensor& gate_up);

// quant_matmul.cpp
at::Tensor quant_pack(const at::Tensor& weight, int64_t type);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t type, int64_t out_features,
                        int64_t path);
std::vector<int64_t> quant_paths();
at::Tensor quant_rows(const at::Tensor& packed, int64_t type, const at::Tensor& index);

// llama_layer.cpp
std::tuple<at::Tensor, at::Tensor> llama_layer(
    const at::Tensor& hidden, const at::Tensor& normed, const at::Tensor& qkv, int64_t qkv_type, int64_t qkv_out,
    const at::Tensor& o, int64_t o_type, int64_t o_out, const at::Tensor& post_norm, const at::Tensor& gate_up,
    int64_t gate_up_type, int64_t gate_up_out, const at::Tensor& down, int64_t down_type, int64_t down_out,
    const at::Tensor& next_norm, double eps, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
    int64_t num_kv_heads, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slots,
    const at::Tensor& block_tables, const at::Tensor& lengths, int64_t block_size, double scale,
    const std::optional<at::Tensor>& qkv_bias, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, int64_t window, const std::optional<at::Tensor>& attn_out_norm,
    const std::optional<at::Tensor>& ffn_out_norm, bool gelu, double residual_scale);

// experts.cpp
at::Tensor moe_mixture(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& chosen,
                       const at::Tensor& gate_up, int64_t gate_up_type, int64_t gate_up_out, const at::Tensor& down,
                       int64_t down_type, int64_t down_out, const std::optional<at::Tensor>& gate_up_bias,
                       const std::optional<at::Tensor>& down_bias, double alpha, double limit);

// delta_rule.cpp
at::Tensor delta_rule(at::Tensor matrix, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const at::Tensor& decay, const at::Tensor& beta, bool correct);
// short_conv.cpp
at::Tensor short_conv(at::Tensor state, const at::Tensor& inputs, const at::Tensor& weight,
                      const at::Tensor& segments);

// recurrent_steps.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> mamba_inputs(
    const at::Tensor& xbc, const std::optional<at::Tensor>& conv_bias, const at::Tensor& dt, const at::Tensor& dt_bias,
    const at::Tensor& decay, int64_t heads, int64_t head_dim, int64_t groups, int64_t state);
at::Tensor mamba_output(const at::Tensor& read, const at::Tensor& x, const at::Tensor& skip, const at::Tensor& z,
                        const at::Tensor& norm, int64_t groups, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> delta_inputs(
    const at::Tensor& mixed, const at::Tensor& gates, const at::Tensor& dt_bias, const at::Tensor& decay,
    int64_t key_heads, int64_t value_heads, int64_t key_dim, int64_t value_dim, bool tiled);
at::Tensor delta_output(const at::Tensor& read, const at::Tensor& z, const at::Tensor& norm, double eps);

// delta_rule.cpp (several sequences)
void delta_rules(at::Tensor matrices, const at::Tensor& pieces, const at::Tensor& query, const at::Tensor& key,
                 const at::Tensor& value, const at::Tensor& decay, const at::Tensor& beta, bool correct,
                 at::Tensor out);

}  // namespace smolserve
