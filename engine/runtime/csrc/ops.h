// The native ops that other native code calls directly (llama_layer.cpp), declared once. Each is also registered
// as torch.ops.smolserve.<name> by the file that defines it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace smolserve {

// decode_attention.cpp
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& block_tables, const at::Tensor& lengths, int64_t block_size,
                            double scale);
void write_kv(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slots, const at::Tensor& key,
              const at::Tensor& value);

// fused_ops.cpp
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& hidden, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate_up);

// quant_matmul.cpp
at::Tensor quant_pack(const at::Tensor& weight, int64_t type);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t type, int64_t out_features,
                        bool portable);

}  // namespace smolserve
