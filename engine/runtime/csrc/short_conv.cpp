// A hybrid's short causal convolution over a step's rows (LFM2's, Qwen3.5's linear attention's, Granite 4.0-H's
// Mamba-2 layers'), each sequence over its own inputs, its state moved past them: one op where torch gathered a
// [rows, span, channels] copy of the windows each call (about 50 times the arithmetic's time).
//
// A sequence's segment is its rows of the step, in order: row t reads the inputs at offsets t - keep .. t of the
// segment (keep = span - 1), a negative offset from the sequence's state (its last keep inputs; zeros for a
// sequence at its first position, whatever its slot held). Each output channel is w[c][0] x_0 + ... + w[c][span-1]
// x_t, summed in float32 in that order and rounded once to the rows' dtype: a row's result is the same whatever
// else the step holds and however its sequence's positions were cut into steps (the state holds the inputs
// themselves).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"
#include "ops.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using bf16 = c10::BFloat16;
using smolserve::narrow;
using smolserve::widen;

// Channels a task takes: a long segment's channels split among the threads, a short one's in one task.
constexpr int64_t kChannelBlock = 512;

template <typename T>
void convolve(T* state, const T* inputs, const float* weight, const int64_t* segments, int64_t n, int64_t keep,
              int64_t channels, T* out) {
  const int64_t span = keep + 1;
  const int64_t blocks = (channels + kChannelBlock - 1) / kChannelBlock;
  at::parallel_for(0, n * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> past(keep * kChannelBlock);
    std::vector<float> taps(span * kChannelBlock), sums(kChannelBlock);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t* segment = segments + 4 * (task / blocks);
      const int64_t first = (task % blocks) * kChannelBlock, width = std::min(kChannelBlock, channels - first);
      T* own = state + segment[0] * keep * channels + first;
      const bool fresh = segment[1] != 0;
      const int64_t row = segment[2], length = segment[3];
      for (int64_t k = 0; k < span; ++k)  // the weights by tap: each tap's channels side by side
        for (int64_t c = 0; c < width; ++c) taps[k * kChannelBlock + c] = weight[(first + c) * span + k];
      for (int64_t j = 0; j < keep; ++j)  // the inputs before the segment
        for (int64_t c = 0; c < width; ++c) past[j * kChannelBlock + c] = fresh ? T(0.0f) : own[j * channels + c];
      for (int64_t t = 0; t < length; ++t) {
        for (int64_t c = 0; c < width; ++c) sums[c] = 0.0f;
        for (int64_t k = 0; k < span; ++k) {  // taps in order: every channel's sum in one order
          const int64_t at = t - keep + k;
          const T* x = at < 0 ? past.data() + (keep + at) * kChannelBlock : inputs + (row + at) * channels + first;
          const float* w = taps.data() + k * kChannelBlock;
          for (int64_t c = 0; c < width; ++c) sums[c] += w[c] * widen(x[c]);
        }
        T* result = out + (row + t) * channels + first;
        for (int64_t c = 0; c < width; ++c) result[c] = narrow<T>(sums[c]);
      }
      for (int64_t j = 0; j < keep; ++j) {  // the state: the segment's last keep inputs
        const int64_t at = length - keep + j;
        const T* x = at < 0 ? past.data() + (keep + at) * kChannelBlock : inputs + (row + at) * channels + first;
        for (int64_t c = 0; c < width; ++c) own[j * channels + c] = x[c];
      }
    }
  });
}

}  // namespace

namespace smolserve {

// state [slots, keep, channels] (the layer's; updated in place); inputs [rows, channels]; weight [channels, span]
// float32; segments [n, 4] int64: a slot (no slot twice), whether the sequence starts at its first position, its
// first row and its rows. Returns [rows, channels] in the inputs' dtype (rows of no segment are not written).
at::Tensor short_conv(at::Tensor state, const at::Tensor& inputs, const at::Tensor& weight,
                      const at::Tensor& segments) {
  TORCH_CHECK(state.dim() == 3 && state.is_contiguous() && inputs.dim() == 2 && inputs.is_contiguous(),
              "state must be [slots, keep, channels] and inputs [rows, channels], contiguous");
  TORCH_CHECK(state.scalar_type() == inputs.scalar_type() &&
                  (inputs.scalar_type() == at::kFloat || inputs.scalar_type() == at::kBFloat16),
              "state and inputs must be both float32 or both bfloat16");
  const int64_t slots = state.size(0), keep = state.size(1), channels = state.size(2), rows = inputs.size(0);
  TORCH_CHECK(inputs.size(1) == channels, "inputs must have the state's channels");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(0) == channels && weight.size(1) == keep + 1,
              "weight must be float32 [channels, keep + 1], contiguous");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 4 &&
                  segments.is_contiguous(),
              "segments must be [n, 4] int64: slot, fresh, first row, rows");
  const int64_t n = segments.size(0);
  const int64_t* segment = segments.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(segment[4 * i] >= 0 && segment[4 * i] < slots, "a segment's slot is out of range");
    TORCH_CHECK(segment[4 * i + 2] >= 0 && segment[4 * i + 3] >= 0 && segment[4 * i + 2] + segment[4 * i + 3] <= rows,
                "a segment's rows are out of range");
  }
  at::Tensor out = at::empty_like(inputs);
  if (inputs.scalar_type() == at::kBFloat16) {
    convolve(state.data_ptr<bf16>(), inputs.data_ptr<bf16>(), weight.data_ptr<float>(), segment, n, keep, channels,
             out.data_ptr<bf16>());
  } else {
    convolve(state.data_ptr<float>(), inputs.data_ptr<float>(), weight.data_ptr<float>(), segment, n, keep, channels,
             out.data_ptr<float>());
  }
  return out;
}

}  // namespace smolserve

TORCH_LIBRARY_FRAGMENT(smolserve, m) {
  m.def("short_conv(Tensor(a!) state, Tensor inputs, Tensor weight, Tensor segments) -> Tensor");
}

TORCH_LIBRARY_IMPL(smolserve, CPU, m) { m.impl("short_conv", &smolserve::short_conv); }
