// How the decode kernels find a sequence's positions in the block KV cache.
//
// The cache holds, per KV head, one run of positions: the pool's blocks of `block_size` positions one after
// another (block b holds positions b * block_size ... (b + 1) * block_size - 1 of that run). A row's block table
// lists its sequence's blocks in order, so its logical position t lies at physical position
// table[t / block_size] * block_size + t % block_size. Blocks are whole tiles of 16 positions, so the kernels
// turn the table into the physical start of each tile once per (row, head) and then index by tile.
//
// A sliding-window layer (`window` > 0 positions, Gemma 3's local layers) attends only a row's last `window`
// positions: the kernels start reading at the tile that holds the first of them (`first_tile`) and give the
// `skip` positions before it in that tile no weight.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace smolserve {

// The attention sinks the kernels take (decode_attention's `sinks`): float32, one a query head, contiguous; an
// undefined tensor without them.
inline at::Tensor checked_sinks(const std::optional<at::Tensor>& sinks, int64_t heads) {
  if (!sinks.has_value()) return at::Tensor();
  TORCH_CHECK(sinks->numel() == heads, "one attention sink a query head");
  return sinks->to(at::kFloat).contiguous();
}

constexpr int64_t kTilePositions = 16;

class BlockTables {
 public:
  // block_tables [rows, width] int32 (any row stride, the last stride 1); lengths [rows]; checks that every
  // block a row reads lies inside a cache of `positions` positions.
  BlockTables(const at::Tensor& block_tables, const at::Tensor& lengths, int64_t rows, int64_t block_size,
              int64_t positions, int64_t window = 0)
      : lengths_(lengths.to(at::kLong).contiguous()), block_size_(block_size), window_(window) {
    TORCH_CHECK(window >= 0, "a sliding window is a number of positions (0: none)");
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt, "block tables are int32 [rows, width]");
    TORCH_CHECK(block_tables.size(0) == rows && lengths_.numel() == rows, "one block table and length per row");
    TORCH_CHECK(block_tables.stride(1) == 1 || block_tables.size(1) <= 1, "each block table must be contiguous");
    TORCH_CHECK(block_size > 0 && block_size % kTilePositions == 0, "blocks hold whole tiles of 16 positions");
    TORCH_CHECK(positions % block_size == 0, "the cache holds whole blocks");
    table_ = block_tables.const_data_ptr<int32_t>();
    row_stride_ = block_tables.stride(0);
    const int64_t* length = lengths_.const_data_ptr<int64_t>();
    const int64_t blocks = positions / block_size;
    for (int64_t i = 0; i < rows; ++i) {
      TORCH_CHECK(length[i] >= 1 && length[i] <= block_tables.size(1) * block_size, "length out of range");
      for (int64_t b = 0; b * block_size < length[i]; ++b) {
        const int32_t block = table_[i * row_stride_ + b];
        TORCH_CHECK(block >= 0 && block < blocks, "block id out of range");
      }
    }
  }

  int64_t length(int64_t row) const { return lengths_.const_data_ptr<int64_t>()[row]; }

  // The first position row `row` attends: 0, or the start of its sliding window.
  int64_t start(int64_t row) const { return window_ > 0 ? std::max<int64_t>(0, length(row) - window_) : 0; }
  // The tile holding that position: the kernels read from it on.
  int64_t first_tile(int64_t row) const { return start(row) / kTilePositions; }
  // Positions of that tile before the window, which get no weight.
  int64_t skip(int64_t row) const { return start(row) % kTilePositions; }

  // Whether row `next` reads every position row `row` reads, at the same physical place, and no fewer (the rows
  // of one prompt chunk, in order): a kernel may then read row `next`'s tiles for both.
  bool continues(int64_t row, int64_t next) const {
    if (window_ > 0 || length(next) < length(row)) return false;
    const int32_t* first = table_ + row * row_stride_;
    return std::equal(first, first + (length(row) + block_size_ - 1) / block_size_, table_ + next * row_stride_);
  }

  // The physical position where each of row `row`'s tiles starts, in a per-thread buffer valid until the
  // thread's next call.
  const int64_t* tile_starts(int64_t row) const {
    thread_local std::vector<int64_t> starts;
    const int64_t tiles = (length(row) + kTilePositions - 1) / kTilePositions;
    if (static_cast<int64_t>(starts.size()) < tiles) starts.resize(tiles);
    const int32_t* table = table_ + row * row_stride_;
    for (int64_t i = 0; i < tiles; ++i) {
      const int64_t position = i * kTilePositions;
      starts[i] = table[position / block_size_] * block_size_ + position % block_size_;
    }
    return starts.data();
  }

 private:
  at::Tensor lengths_;
  const int32_t* table_ = nullptr;
  int64_t row_stride_ = 0;
  int64_t block_size_;
  int64_t window_;
};

}  // namespace smolserve
