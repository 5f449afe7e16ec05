// A mixture of experts' routed part over a step's rows, in one call: what the runner's `_mixture` does expert by
// expert from Python (engine/runtime/model_runner.py), the same ATen and native ops in the same order on the same
// tensors, so the result is bitwise the Python path's. Each chosen expert, in ascending order, takes the rows that
// chose it (in row order), multiplies them by its gate-and-up blocks once, gates them (SiLU), multiplies by its down
// blocks, weights each row's output by the router's weight and adds it to the row's sum (gpt-oss: with each
// expert's biases, and its clamped SwiGLU for the SiLU gate, as `_clamped_swiglu`). At one decoding row a
// 30B-A3B's layer chooses 8 experts, ~10 small ops each: ~80 Python dispatches a layer, 4,000 a token, otherwise.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "ops.h"

namespace smolserve {

namespace {

// One expert's gated MLP over its rows, as the runner's `_expert`: SiLU's gate, or with biases (gpt-oss) the gate
// clamped above at `limit`, the up to +-limit, (up + 1) * gate * sigmoid(alpha gate).
at::Tensor expert_mlp(const at::Tensor& input, const at::Tensor& gate_up, int64_t gate_up_type, int64_t gate_up_out,
                      const at::Tensor& down, int64_t down_type, int64_t down_out,
                      const std::optional<at::Tensor>& gate_up_bias, const std::optional<at::Tensor>& down_bias,
                      double alpha, double limit) {
  const at::Tensor projected = quant_linear(input, gate_up, gate_up_type, gate_up_out, 0);
  if (!gate_up_bias.has_value() || !down_bias.has_value()) {
    return quant_linear(silu_mul(projected), down, down_type, down_out, 0);
  }
  const std::vector<at::Tensor> parts = (projected + *gate_up_bias).chunk(2, -1);
  const at::Tensor gate = parts[0].clamp(std::nullopt, limit);
  const at::Tensor gated = (parts[1].clamp(-limit, limit) + 1) * (gate * at::sigmoid(gate * alpha));
  return quant_linear(gated, down, down_type, down_out, 0) + *down_bias;
}

}  // namespace

// x [rows, hidden]; weights [rows, k] in x's dtype and chosen [rows, k] int64: each row's experts and their
// weights; gate_up [experts, groups, bytes] and down [experts, groups, bytes]: every expert's packed blocks
// (`quant_pack`), of types gate_up_type and down_type with gate_up_out and down_out outputs; gpt-oss's biases
// gate_up_bias [experts, gate_up_out] and down_bias [experts, hidden] with its SwiGLU's alpha and limit. Returns the
// rows' weighted sums [rows, hidden], zero for a row with no expert.
at::Tensor moe_mixture(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& chosen,
                       const at::Tensor& gate_up, int64_t gate_up_type, int64_t gate_up_out, const at::Tensor& down,
                       int64_t down_type, int64_t down_out, const std::optional<at::Tensor>& gate_up_bias,
                       const std::optional<at::Tensor>& down_bias, double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2 && weights.dim() == 2 && chosen.sizes() == weights.sizes() && chosen.size(0) == x.size(0),
              "expected x [rows, hidden], weights and chosen [rows, k]");
  TORCH_CHECK(chosen.scalar_type() == at::kLong, "chosen must be int64");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(0) == down.size(0),
              "expected gate_up and down [experts, groups, bytes]");
  const int64_t rows = chosen.size(0), k = chosen.size(1), experts = gate_up.size(0);
  const at::Tensor ids = chosen.contiguous();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  std::vector<int64_t> count(experts + 1, 0);  // where each expert's (row, slot) pairs start in `taken`
  for (int64_t i = 0; i < rows * k; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < experts, "expert ", id[i], " is out of range");
    ++count[id[i] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) count[e + 1] += count[e];
  // Each expert's (row, slot) pairs in row order, as torch.where(chosen == e) lists them: the rows, and where each
  // pair's weight sits in the flattened weights (read with one index_select: the same values, copied).
  std::vector<int64_t> taken(rows * k), at(rows * k), next(count.begin(), count.end() - 1);
  for (int64_t i = 0; i < rows * k; ++i) {
    const int64_t slot = next[id[i]]++;
    taken[slot] = i / k;
    at[slot] = i;
  }
  const auto index = at::TensorOptions().dtype(at::kLong);
  const at::Tensor all_rows = at::tensor(taken, index);
  const at::Tensor all_weights = weights.reshape({-1}).index_select(0, at::tensor(at, index)).unsqueeze(1);
  const auto bias = [](const std::optional<at::Tensor>& all, int64_t e) {  // expert e's, where there are biases
    return all.has_value() ? std::optional<at::Tensor>((*all)[e]) : std::nullopt;
  };
  at::Tensor output = at::zeros_like(x);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t first = count[e], n = count[e + 1] - first;
    if (n == 0) continue;
    const at::Tensor these = all_rows.narrow(0, first, n);
    // One row (a decoding step's usual case): its view, not a copy.
    const at::Tensor input = n == 1 ? x.narrow(0, taken[first], 1) : x.index_select(0, these);
    const at::Tensor out = expert_mlp(input, gate_up[e], gate_up_type, gate_up_out, down[e], down_type, down_out,
                                      bias(gate_up_bias, e), bias(down_bias, e), alpha, limit);
    output.index_add_(0, these, out * all_weights.narrow(0, first, n));
  }
  return output;
}

}  // namespace smolserve

TORCH_LIBRARY_FRAGMENT(smolserve, m) {
  m.def(
      "moe_mixture(Tensor x, Tensor weights, Tensor chosen, Tensor gate_up, int gate_up_type, int gate_up_out, "
      "Tensor down, int down_type, int down_out, Tensor? gate_up_bias=None, Tensor? down_bias=None, "
      "float alpha=0.0, float limit=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(smolserve, CPU, m) { m.impl("moe_mixture", &smolserve::moe_mixture); }
