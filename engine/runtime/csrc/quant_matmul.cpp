// Matmuls on a GGUF's quantized weights, every common GGML type: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and MXFP4
// blocks of 32 weights; Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS ones of 256.
//
// GGML stores each weight row as a run of blocks along the input dimension (w: a weight, q: its quant):
//   Q4_0: fp16 d, 16 bytes of 4-bit q (byte j: weight j in the low nibble, weight 16 + j in the high); w = (q - 8) d
//   Q4_1: fp16 d, fp16 m, 16 bytes of 4-bit q as above;                                                 w = q d + m
//   Q5_0: fp16 d, 32 high bits, 16 bytes of low nibbles as above;                                      w = (q - 16) d
//   Q5_1: fp16 d, fp16 m, 32 high bits, low nibbles;                                                    w = q d + m
//   Q8_0: fp16 d, 32 int8 q;                                                                            w = q d
//   IQ4_NL: fp16 d, 4-bit indices into a table of 16 int8 values;                                  w = d table[q]
//   Q2_K: 16 4-bit scales and mins, 2-bit q, fp16 d, dmin; 16 weights share sc, mn:           w = q (d sc) - dmin mn
//   Q3_K: high-bit mask, 2-bit q, 16 6-bit scales, fp16 d; per 16 weights:           w = (q - 4 [bit unset]) d (sc - 32)
//   Q4_K: fp16 d, fp16 dmin, 8 6-bit scales sc and mins mn, 4-bit q; sub-block s of 32:    w = q (d sc_s) - dmin mn_s
//   Q5_K: as Q4_K with a fifth bit per weight
//   Q6_K: 6-bit q in low and high bit planes, 16 int8 scales sc, fp16 d; weights i:         w = (q - 32) (d sc_{i/16})
//   IQ4_XS: fp16 d, 8 6-bit scales, 4-bit indices into IQ4_NL's table; sub-block s:     w = d (sc_s - 32) table[q]
//   MXFP4 (gpt-oss's experts): an E8M0 exponent e, 4-bit E2M1 codes into a table of doubled values; w = 2^(e-128) t[q]
// Packing turns every type into 32-weight blocks of one of four kinds: 4-bit or 5-bit quants with an offset
// (Q4_0, Q4_1, Q4_K, Q2_K; Q5_0, Q5_1, Q5_K), 6-bit ones less 32 (Q6_K), signed 8-bit ones (Q8_0, IQ4_NL, IQ4_XS,
// Q3_K: a table's value or q minus its offset, exact in int8), or 4-bit indices into a table of int8 values that
// the kernel looks up (MXFP4: a 20B's experts as 8-bit values would not fit in 24 GB). Q4_K's, Q5_K's and Q6_K's
// scales stay as the file holds them, small integers and a super-block's fp16 d (and dmin), and the kernel forms
// d sc (exact in float32) as it reads them: a Q4_K_M 30B's experts packed at the file's size (float32 scales made
// Q4_K 0.75 bytes a weight against the file's 0.56, Q6_K 1.25 against 0.82: 24 GB for an 18 GB file). Q2_K's and
// Q3_K's d sc, and MXFP4's powers of 2 (float32's whole range), are packed as float32 (one per 16 weights where the
// type has that: Q2_K, Q3_K), the others as the file's fp16 (Q4_0's m = -8 d and Q5_0's m = -16 d: powers of 2,
// exact).
// `quant_pack` regroups them once at load, as llama.cpp's repacked formats do: the blocks of 8 output rows side
// by side, so that one vector instruction works on 8 outputs and a block's scales are one vector load:
//   4-bit group block: 8 d, 8 m (each twice, for weights 0-15 then 16-31, where the type scales by 16), then 4 runs
//     of 32 bytes, run k holding bytes 4k..4k+3 of each of the 8 rows in turn (byte j: weight j in the low nibble,
//     weight 16 + j in the high);
//   5-bit group block: the 4-bit one, then 32 bytes of fifth bits: byte 4c + i holds, for output column c, bit 2k
//     the fifth bit of weight 4k + i and bit 2k + 1 that of weight 16 + 4k + i (run k's low and high nibbles);
//   8-bit group block: 8 d (twice where scaled by 16), then 8 runs of 32 bytes, run k holding weights 4k..4k+3 of
//     each row in turn;
//   table group block: 8 float32 d, then the 4-bit group block's runs of nibbles (the table's indices);
//   6-bit group block: 8 int8 scales for weights 0-15, 8 for 16-31, the 4-bit runs of q's low nibbles, then two
//     planes of 32 bytes of high bits (weights 0-15, then 16-31): byte 4c + i's bits 2k, 2k + 1 those of weight
//     4k + i (16 + 4k + i);
//   a super-block's blocks (Q4_K, Q5_K, Q6_K: 8 group blocks) hold their scales and mins as bytes, after a header
//     of the 8 rows' fp16 d (and dmin).
// Each activation row is quantized per block of 32 to int8 with a scale a = max|x| / 127 (held block-major: a tile's
// rows of one block at fixed offsets from one pointer, no per-row address arithmetic a block), and a block's dot
// product is an integer one: sum(w x) = d a sum(q qx) (+ m a sum(qx) for the types with an offset). On AVX2, a
// run's 4 weights of each of 8 rows meet the row's 4 activations, broadcast, in one vpmaddubsw (unsigned 4/5-bit
// weights times signed 8-bit activations; 8-bit through the sign trick), and the block's 8 integer dot products end
// in one vector. Up to 4 activation rows share each unpacked weight run. Elsewhere, plain loops over the same
// integers.
//
// Every output is one fixed sequence of floating-point operations over its row's blocks, whatever the number of
// rows in the call: a row's result does not depend on its batchmates (greedy decoding stays batch-invariant).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "prefetch.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SMOLSERVE_QUANT_AVX2 1
// AVX-512 VNNI (with VL: its 256-bit form): vpdpbusd multiplies and sums 4 unsigned x signed byte pairs into each
// int32 lane, where AVX2 needs vpmaddubsw, vpmaddwd and an add. The integer sums are exact on both, so both paths
// give the same bits.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SMOLSERVE_QUANT_VNNI 1
#endif
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kCols = 8;   // output rows whose blocks are packed side by side
constexpr int64_t kRowTile = 4;  // activation rows per pass over a group's weights (AVX2: 16 vector registers)
constexpr int64_t kRowTileVnni = 8;  // with AVX-512's 32 registers
// The kernels a call may take, as quant_linear's `path` names them (0: the best this build has).
enum Path : int64_t { kBest = 0, kPortable = 1, kAvx2 = 2, kVnni = 3 };
constexpr int64_t kChunk = 64;  // activation rows per sweep over a thread's groups (their int8 stays in cache)
enum QuantType : int64_t {  // GGML's type numbers
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kIQ4_NL = 20, kIQ4_XS = 23, kMXFP4 = 39
};
// IQ4_NL's and IQ4_XS's non-linear 4-bit values (ggml's kvalues_iq4nl).
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// MXFP4's E2M1 values, doubled (ggml's kvalues_mxfp4): the block's scale is half the E8M0 power.
constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// The tables a packed layout's nibbles index (Layout::table): none, MXFP4's.
constexpr int kMXFP4Table = 1;
constexpr const int8_t* kTables[2] = {nullptr, kMXFP4Values};

// Bytes of one GGML block of `type`, and the weights it holds.
int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kIQ4_NL: return 18;
    case kQ2_K: return 84;
    case kQ3_K: return 110;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    case kIQ4_XS: return 136;
    case kMXFP4: return 17;
    default:
      TORCH_CHECK(false, "unsupported quantized type ", type, " (supported: Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, ",
                  "Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, ",
                  "MXFP4 = 39)");
  }
}

int64_t block_weights(int64_t type) { return block_bytes(type) > 34 ? 256 : kBlock; }  // every K-quant is larger

// How a packed layout holds its scales (Layout::scales): fp16 bits, float32 values, or a super-block's (the
// K-quants' 256 weights, 8 group blocks): each block's sub-scales (and mins) as the file's small integers, one byte a
// row, the super-block's fp16 d (and dmin) for the 8 rows in a header before its 8 blocks. The kernel multiplies
// them back as packing did (d sc: an fp16 times an integer below 64 or 128, exact in float32), so the products
// are the float32 ones bit for bit, at near the file's size (Q4_K 0.58 bytes a weight against 0.75 as float32).
enum Scales : int { kHalfScales = 0, kFloatScales = 1, kSuperScales = 2 };

// How a type is packed: `bits` 4 or 5 (unsigned quants with an offset m), 6 (Q6_K: unsigned 0..63 less 32, signed,
// no offset) or 8 (signed); its `scales`; a scale (and offset) per 16 weights (else per 32); `table` (4 bits, no
// offset): each nibble an index into a table of 16 int8 values (kTables), looked up in the kernel (MXFP4: half the
// bytes of its values as 8-bit quants).
struct Layout {
  int bits;
  int scales;
  bool halves;
  int table = 0;
  constexpr bool q8() const { return bits == 8; }
  constexpr bool offset() const { return bits < 6 && table == 0; }  // an m beside each d
  constexpr bool super() const { return scales == kSuperScales; }
  constexpr int64_t scale_width() const { return scales == kFloatScales ? 4 : scales == kHalfScales ? 2 : 1; }
  constexpr int64_t scale_bytes() const { return scale_width() * kCols * (halves ? 2 : 1); }
  constexpr int64_t quants_at() const { return scale_bytes() * (offset() ? 2 : 1); }  // after d (and m)
  constexpr int64_t high_at() const { return quants_at() + kCols * kBlock / 2; }  // 5/6-bit: the high bits
  constexpr int64_t bytes() const {  // a group block's, without its super-block's header
    const int64_t high = bits == 5 ? kCols * kBlock / 8 : bits == 6 ? kCols * kBlock / 4 : 0;
    return quants_at() + kCols * kBlock / (q8() ? 1 : 2) + high;
  }
  // A super-block's header: the 8 rows' fp16 d, then their fp16 dmin where there is an offset.
  constexpr int64_t header_bytes() const { return super() ? 2 * kCols * (offset() ? 2 : 1) : 0; }
  constexpr int64_t span() const { return header_bytes() + 8 * bytes(); }  // a super-block's bytes
  constexpr int64_t row_bytes(int64_t blocks) const { return super() ? blocks / 8 * span() : blocks * bytes(); }
  // Where group block b of a group of 8 rows starts, and the header of its super-block.
  constexpr int64_t block_at(int64_t b) const {
    return super() ? b / 8 * span() + header_bytes() + b % 8 * bytes() : b * bytes();
  }
  constexpr int64_t header_at(int64_t b) const { return b / 8 * span(); }
};

Layout layout_of(int64_t type) {
  block_bytes(type);  // refuses unsupported types
  switch (type) {
    case kQ4_0: case kQ4_1: return Layout{4, kHalfScales, false};
    case kQ4_K: return Layout{4, kSuperScales, false};
    case kQ2_K: return Layout{4, kFloatScales, true};
    case kQ5_0: case kQ5_1: return Layout{5, kHalfScales, false};
    case kQ5_K: return Layout{5, kSuperScales, false};
    case kQ6_K: return Layout{6, kSuperScales, true};
    case kQ8_0: case kIQ4_NL: return Layout{8, kHalfScales, false};
    case kIQ4_XS: return Layout{8, kFloatScales, false};
    case kMXFP4: return Layout{4, kFloatScales, false, kMXFP4Table};
    default: return Layout{8, kFloatScales, true};  // Q3_K
  }
}

inline float half_to_float(uint16_t bits) {
#if defined(SMOLSERVE_QUANT_AVX2)
  return _cvtsh_ss(bits);  // one instruction (F16C), where c10::Half converts in software
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline uint16_t load_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bits;
}

// 32 weights of one row, decoded from their GGML block as the packed layout stores them: scales (fp16 bits, or
// float32 values: two where the type scales by 16; a super-block's: its fp16 d and dmin bits, and the sub-block's
// integer scales and min), offsets (4/5-bit types), and quants (unsigned 0..31, or int8 bits).
struct SubBlock {
  uint16_t d_half = 0, m_half = 0;
  float d[2] = {0.0f, 0.0f};
  float m[2] = {0.0f, 0.0f};
  uint8_t sc[2] = {0, 0}, mn = 0;
  uint8_t q[kBlock] = {};
};

// Q4_K's and Q5_K's 6-bit scale and min of sub-block j, as ggml's get_scale_min_k4.
inline void scale_min_k4(int64_t j, const uint8_t* packed, uint8_t& scale, uint8_t& min) {
  if (j < 4) {
    scale = packed[j] & 63;
    min = packed[j + 4] & 63;
  } else {
    scale = (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4);
    min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
  }
}

// The 4-bit value of weight j (0-31) of a 32-weight block whose 16 bytes hold j in the low nibble, 16 + j in the high.
inline uint8_t nibble(const uint8_t* bytes, int64_t j) { return j < 16 ? bytes[j] & 0x0F : bytes[j - 16] >> 4; }

// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL: one sub-block.
void decode_small(const uint8_t* block, int64_t type, SubBlock& sb) {
  sb.d_half = load_half(block);
  const bool has_m = type == kQ4_1 || type == kQ5_1, five = type == kQ5_0 || type == kQ5_1;
  if (has_m) sb.m_half = load_half(block + 2);
  if (type == kQ4_0) sb.m_half = c10::Half(-8.0f * half_to_float(sb.d_half)).x;  // a power of 2: exact
  if (type == kQ5_0) sb.m_half = c10::Half(-16.0f * half_to_float(sb.d_half)).x;
  uint32_t high = 0;
  if (five) std::memcpy(&high, block + (has_m ? 4 : 2), 4);
  const uint8_t* quants = block + 2 + (has_m ? 2 : 0) + (five ? 4 : 0);
  for (int64_t j = 0; j < kBlock; ++j) {
    if (type == kQ8_0) sb.q[j] = quants[j];
    else if (type == kIQ4_NL) sb.q[j] = static_cast<uint8_t>(kIQ4Values[nibble(quants, j)]);
    else sb.q[j] = nibble(quants, j) | (five ? ((high >> j) & 1) << 4 : 0);
  }
}

// Q4_K and Q5_K: 8 sub-blocks of 32, each with its scale and min (packed as the file's integers beside d and dmin:
// the kernel forms their products).
void decode_q45_k(const uint8_t* block, bool five, SubBlock* out) {
  const uint8_t* scales = block + 4;
  const uint8_t* high = block + 16;
  const uint8_t* qs = block + 16 + (five ? 32 : 0);
  for (int64_t s = 0; s < 8; ++s) {
    uint8_t scale, min;
    scale_min_k4(s, scales, scale, min);
    out[s].d_half = load_half(block);
    out[s].m_half = load_half(block + 2);
    out[s].sc[0] = scale;
    out[s].mn = min;
    const uint8_t* bytes = qs + 32 * (s / 2);  // sub-blocks 2p and 2p + 1: the low and high nibbles of 32 bytes
    for (int64_t l = 0; l < kBlock; ++l) {
      out[s].q[l] = (s % 2 ? bytes[l] >> 4 : bytes[l] & 0x0F) | (five ? ((high[l] >> s) & 1) << 4 : 0);
    }
  }
}

// Q2_K: 16 sub-blocks of 16, each with a 4-bit scale and min; 2-bit quants in 2 halves of 128.
void decode_q2_k(const uint8_t* block, SubBlock* out) {
  const uint8_t* scales = block;
  const uint8_t* qs = block + 16;
  const float d = half_to_float(load_half(block + 80)), dmin = half_to_float(load_half(block + 82));
  for (int64_t i = 0; i < 256; ++i) {
    const int64_t half = i / 128, shift = 2 * (i % 128 / 32), l = i % 32, t = i / 16;
    SubBlock& sb = out[i / kBlock];
    sb.q[i % kBlock] = (qs[32 * half + l] >> shift) & 3;
    sb.d[t % 2] = d * static_cast<float>(scales[t] & 0x0F);
    sb.m[t % 2] = -(dmin * static_cast<float>(scales[t] >> 4));
  }
}

// Q3_K: 16 sub-blocks of 16 with 6-bit signed scales; 2-bit quants less 4 where the high-bit mask is unset.
void decode_q3_k(const uint8_t* block, SubBlock* out) {
  const uint8_t* hmask = block;
  const uint8_t* qs = block + 32;
  const uint8_t* scales = block + 96;
  const float d = half_to_float(load_half(block + 108));
  for (int64_t i = 0; i < 256; ++i) {
    const int64_t half = i / 128, shift = 2 * (i % 128 / 32), l = i % 32, t = i / 16;
    const int low = (qs[32 * half + l] >> shift) & 3, unset = ((hmask[l] >> (i / 32)) & 1) ^ 1;
    const int scale = (((scales[t % 8] >> (4 * (t / 8))) & 0x0F) | (((scales[8 + t % 4] >> (2 * (t / 4))) & 3) << 4)) - 32;
    SubBlock& sb = out[i / kBlock];
    sb.q[i % kBlock] = static_cast<uint8_t>(static_cast<int8_t>(low - 4 * unset));
    sb.d[t % 2] = d * static_cast<float>(scale);
  }
}

// Q6_K: as ggml's dequantize_row_q6_K: halves of 128, quarters of 32.
void decode_q6_k(const uint8_t* block, SubBlock* out) {
  const uint8_t* ql = block;
  const uint8_t* qh = block + 128;
  const auto* scales = reinterpret_cast<const int8_t*>(block + 192);
  for (int64_t s = 0; s < 8; ++s) out[s].d_half = load_half(block + 208);
  for (int64_t i = 0; i < 256; ++i) {
    const int64_t half = i / 128, quarter = i % 128 / 32, l = i % 32;
    const uint8_t low = ql[64 * half + l + 32 * (quarter % 2)];
    const int value = ((quarter < 2 ? low & 0x0F : low >> 4) | (((qh[32 * half + l] >> (2 * quarter)) & 3) << 4)) - 32;
    out[i / kBlock].q[i % kBlock] = static_cast<uint8_t>(static_cast<int8_t>(value));
    out[i / kBlock].sc[i % kBlock / 16] = static_cast<uint8_t>(scales[i / 16]);
  }
}

// IQ4_XS: 8 sub-blocks of 32, each with a 6-bit scale, their 4-bit indices into IQ4_NL's table.
void decode_iq4_xs(const uint8_t* block, SubBlock* out) {
  const float d = half_to_float(load_half(block));
  const uint16_t scales_high = load_half(block + 2);
  const uint8_t* scales_low = block + 4;
  const uint8_t* qs = block + 8;
  for (int64_t s = 0; s < 8; ++s) {
    const int scale = (((scales_low[s / 2] >> (4 * (s % 2))) & 0x0F) | (((scales_high >> (2 * s)) & 3) << 4)) - 32;
    out[s].d[0] = d * static_cast<float>(scale);
    for (int64_t l = 0; l < kBlock; ++l) out[s].q[l] = static_cast<uint8_t>(kIQ4Values[nibble(qs + 16 * s, l)]);
  }
}

// MXFP4: one sub-block; its scale 2^(e - 128) as ggml's GGML_E8M0_TO_FP32_HALF computes it (exact in float32,
// subnormal below e = 2).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : (static_cast<uint32_t>(e) - 1) << 23;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

void decode_mxfp4(const uint8_t* block, SubBlock& sb) {
  sb.d[0] = e8m0_half(block[0]);
  for (int64_t j = 0; j < kBlock; ++j) sb.q[j] = nibble(block + 1, j);  // packed as the table's indices
}

// An MXFP4 block written into column c of its packed group block at once: its 16 bytes of nibbles are already as
// the packed runs hold them (byte j: weight j low, 16 + j high), so they are copied as 4 runs of 4 bytes (what
// decode_mxfp4 and write_sub_block give, without the 32 nibbles' round trip: 1.5 GB/s here, 1.3 before; a cold
// file's read from disk costs more).
inline void pack_mxfp4(const uint8_t* block, const Layout& layout, int64_t c, uint8_t* to) {
  const float d = e8m0_half(block[0]);
  std::memcpy(to + 4 * c, &d, 4);
  for (int64_t k = 0; k < 4; ++k) std::memcpy(to + layout.quants_at() + 32 * k + 4 * c, block + 1 + 4 * k, 4);
}

// The sub-blocks of one GGML block (1 of 32 weights, or 8 for the 256 of the K-quants and IQ4_XS).
void decode_block(const uint8_t* block, int64_t type, SubBlock* out) {
  switch (type) {
    case kMXFP4: return decode_mxfp4(block, out[0]);
    case kQ2_K: return decode_q2_k(block, out);
    case kQ3_K: return decode_q3_k(block, out);
    case kQ4_K: return decode_q45_k(block, false, out);
    case kQ5_K: return decode_q45_k(block, true, out);
    case kQ6_K: return decode_q6_k(block, out);
    case kIQ4_XS: return decode_iq4_xs(block, out);
    default: return decode_small(block, type, out[0]);
  }
}

// The scales of one row's sub-block written into its column `c` of a packed group block (and of its
// super-block's header, for the super-block's first).
void write_scales(const SubBlock& sb, const Layout& layout, int64_t c, uint8_t* to, uint8_t* header) {
  const int64_t parts = layout.halves ? 2 : 1, half = layout.scale_bytes() / parts, m_at = layout.scale_bytes();
  if (layout.super()) {
    for (int64_t h = 0; h < parts; ++h) to[h * half + c] = sb.sc[h];
    if (layout.offset()) to[m_at + c] = sb.mn;
    std::memcpy(header + 2 * c, &sb.d_half, 2);
    if (layout.offset()) std::memcpy(header + 2 * kCols + 2 * c, &sb.m_half, 2);
  } else if (layout.scales == kFloatScales) {
    for (int64_t h = 0; h < parts; ++h) {
      std::memcpy(to + h * half + 4 * c, &sb.d[h], 4);
      if (layout.offset()) std::memcpy(to + m_at + h * half + 4 * c, &sb.m[h], 4);
    }
  } else {
    std::memcpy(to + 2 * c, &sb.d_half, 2);
    if (layout.offset()) std::memcpy(to + m_at + 2 * c, &sb.m_half, 2);
  }
}

// One row's sub-block written into its column `c` of a packed group block. 6-bit quants (Q6_K's q - 32) are
// stored as q: their low nibbles as the 4-bit runs, their high 2 bits in two planes of 32 bytes (weights 0-15,
// then 16-31): byte 4c + i of a plane holds in bits 2k, 2k + 1 those of weight 4k + i (16 + 4k + i).
void write_sub_block(const SubBlock& sb, const Layout& layout, int64_t c, uint8_t* to, uint8_t* header) {
  write_scales(sb, layout, c, to, header);
  uint8_t* runs = to + layout.quants_at();
  if (layout.q8()) {
    for (int64_t k = 0; k < 8; ++k) std::memcpy(runs + 32 * k + 4 * c, sb.q + 4 * k, 4);
    return;
  }
  uint8_t q[kBlock];
  for (int64_t j = 0; j < kBlock; ++j) q[j] = layout.bits == 6 ? static_cast<uint8_t>(sb.q[j] + 32) : sb.q[j];
  uint8_t bytes[kBlock / 2];
  for (int64_t j = 0; j < kBlock / 2; ++j) bytes[j] = (q[j] & 0x0F) | ((q[j + kBlock / 2] & 0x0F) << 4);
  for (int64_t k = 0; k < 4; ++k) std::memcpy(runs + 32 * k + 4 * c, bytes + 4 * k, 4);
  for (int64_t i = 0; i < 4 && layout.bits > 4; ++i) {
    uint8_t fifth = 0, planes[2] = {0, 0};
    for (int64_t k = 0; k < 4; ++k) {
      fifth |= ((q[4 * k + i] >> 4) & 1) << (2 * k);
      fifth |= ((q[16 + 4 * k + i] >> 4) & 1) << (2 * k + 1);
      planes[0] |= ((q[4 * k + i] >> 4) & 3) << (2 * k);
      planes[1] |= ((q[16 + 4 * k + i] >> 4) & 3) << (2 * k);
    }
    if (layout.bits == 5) to[layout.high_at() + 4 * c + i] = fifth;
    for (int64_t h = 0; h < 2 && layout.bits == 6; ++h) to[layout.high_at() + 32 * h + 4 * c + i] = planes[h];
  }
}

// The activations of the rows, per block of 32: int8 values, their scale, and what the offsets m multiply: scale *
// sum, and scale * the sums of weights 0-15 and 16-31 (for the types with an offset per 16). Block-major: block b
// of every row, then block b + 1 (`at`), so that a tile's rows of one block sit at fixed offsets from one pointer.
struct QuantizedRows {
  int64_t rows;
  std::vector<int8_t> q;  // [blocks * rows * 32]
  std::vector<float> scale;  // [blocks * rows]
  std::vector<float> scaled_sum;
  std::vector<float> scaled_halves;  // [blocks * rows * 2]
  std::vector<int32_t> halves;  // [blocks * rows * 2]: the sums of the int8 values 0-15 and 16-31
  int64_t at(int64_t row, int64_t block) const { return block * rows + row; }
};

// A block's 32 activations quantized: int8 values into q, and the sums of values 0-15 and 16-31; returns the
// block's scale, its largest magnitude / 127. The plain loops' operations (std::nearbyint: round to nearest, ties
// to even).
template <typename T>
float quantize_block_portable(const T* block, int8_t* q, int32_t totals[2]) {
  float most = 0.0f;
  for (int64_t j = 0; j < kBlock; ++j) most = std::max(most, std::abs(static_cast<float>(block[j])));
  const float scale = most / 127.0f;
  const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
  for (int64_t j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(static_cast<float>(block[j]) * inverse));
    totals[j / 16] += q[j];
  }
  return scale;
}

#if defined(SMOLSERVE_QUANT_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bfloat16: float32's high half
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// The same bits with AVX2 (every CPU class served has it): the same float products, vcvtps2dq's rounding (to
// nearest, ties to even: nearbyint's), the largest magnitude as std::max keeps it (a NaN never replaces it).
template <typename T>
float quantize_block(const T* block, int8_t* q, int32_t totals[2]) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4], most = _mm256_setzero_ps();
  for (int64_t i = 0; i < 4; ++i) {
    v[i] = load8(block + 8 * i);
    most = _mm256_max_ps(_mm256_and_ps(v[i], magnitude), most);  // the second operand where the first is NaN
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, most);
  float largest = 0.0f;
  for (float lane : lanes) largest = std::max(largest, lane);
  const float scale = largest / 127.0f;
  const __m256 inverse = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
  __m256i n[4];
  for (int64_t i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
  const __m256i words = _mm256_packs_epi32(n[0], n[1]), words_high = _mm256_packs_epi32(n[2], n[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words_high),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  for (int64_t h = 0; h < 2; ++h) {
    alignas(32) int32_t sums[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums), _mm256_add_epi32(n[2 * h], n[2 * h + 1]));
    for (int32_t value : sums) totals[h] += value;
  }
  return scale;
}
#else
template <typename T>
float quantize_block(const T* block, int8_t* q, int32_t totals[2]) {
  return quantize_block_portable(block, q, totals);
}
#endif

// `portable`: the plain loops' quantizer (quant_linear's path 1, which the tests hold the others to bit for bit).
template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t rows, int64_t in, bool portable) {
  const int64_t blocks = in / kBlock;
  QuantizedRows out{rows, std::vector<int8_t>(rows * in), std::vector<float>(rows * blocks),
                    std::vector<float>(rows * blocks), std::vector<float>(rows * blocks * 2),
                    std::vector<int32_t>(rows * blocks * 2)};
  at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
    // In the order they are held (block-major), so that a thread's writes are its own cache lines.
    for (int64_t i = begin; i < end; ++i) {
      int32_t totals[2] = {0, 0};
      const T* block = x + (i % rows * blocks + i / rows) * kBlock;  // row i % rows, block i / rows
      int8_t* q = &out.q[i * kBlock];
      const float scale = portable ? quantize_block_portable(block, q, totals) : quantize_block(block, q, totals);
      out.scale[i] = scale;
      out.scaled_sum[i] = scale * static_cast<float>(totals[0] + totals[1]);
      out.scaled_halves[2 * i] = scale * static_cast<float>(totals[0]);
      out.scaled_halves[2 * i + 1] = scale * static_cast<float>(totals[1]);
      out.halves[2 * i] = totals[0];
      out.halves[2 * i + 1] = totals[1];
    }
  });
  return out;
}

// Where the activations of rows [first, first + count) meet a group: a tile's arguments.
struct Tile {
  const uint8_t* group;  // the group's packed blocks
  int64_t blocks;
  const QuantizedRows* x;
  int64_t first;
  float* out;  // the group's 8 outputs of row `first`
  int64_t out_stride;
};

// A packed scale: fp16 bits or float32, output column c of the 8 at p.
template <bool F32>
inline float scale_at(const uint8_t* p, int64_t c) {
  if constexpr (F32) {
    float value;
    std::memcpy(&value, p + 4 * c, 4);
    return value;
  } else {
    return half_to_float(load_half(p + 2 * c));
  }
}

// The scale d of output column c (weights 0-15, or 16-31 with h = 1 where the type scales by 16) in packed block g
// whose super-block's header is `header`, and its offset m: as packing computed them (a super-block's d sc and
// -(dmin mn): exact products, so the same floats as packed float32 ones). `volatile`: the build's -ffast-math may
// not fold the product into what multiplies it next (d sc a regrouped as d (sc a) rounds differently).
inline float packed_d(const Layout& layout, const uint8_t* g, const uint8_t* header, int64_t c, int64_t h) {
  const uint8_t* p = g + h * (layout.scale_bytes() / 2);
  if (layout.scales == kFloatScales) return scale_at<true>(p, c);
  if (layout.scales == kHalfScales) return scale_at<false>(p, c);
  const float sc = layout.offset() ? static_cast<float>(p[c]) : static_cast<float>(static_cast<int8_t>(p[c]));
  const volatile float product = half_to_float(load_half(header + 2 * c)) * sc;
  return product;
}

inline float packed_m(const Layout& layout, const uint8_t* g, const uint8_t* header, int64_t c, int64_t h) {
  const uint8_t* p = g + layout.scale_bytes() + h * (layout.scale_bytes() / 2);
  if (layout.scales == kFloatScales) return scale_at<true>(p, c);
  if (layout.scales == kHalfScales) return scale_at<false>(p, c);
  const volatile float product = half_to_float(load_half(header + 2 * kCols + 2 * c)) * static_cast<float>(p[c]);
  return -product;
}

// Quant j (0-31) of output column c in a packed block: its int8 value, its table's value, its 6-bit one less 32, or
// its unsigned 4/5-bit one.
inline int32_t quant_at(const uint8_t* block, const Layout& layout, int64_t c, int64_t j) {
  const uint8_t* runs = block + layout.quants_at();
  if (layout.q8()) return static_cast<int8_t>(runs[j / 4 * 32 + c * 4 + j % 4]);
  const int64_t k = j % 16 / 4, at = c * 4 + j % 4;
  int32_t value = (runs[k * 32 + at] >> (j < 16 ? 0 : 4)) & 0x0F;
  if (layout.table) return kTables[layout.table][value];
  if (layout.bits == 5) value |= ((block[layout.high_at() + at] >> (2 * k + (j < 16 ? 0 : 1))) & 1) << 4;
  if (layout.bits == 6) return (value | ((block[layout.high_at() + (j < 16 ? 0 : 32) + at] >> (2 * k)) & 3) << 4) - 32;
  return value;
}

// The 32 weights of output column c in one packed block, dequantized as GGUF computes them: d x q, plus m for the
// types with an offset, d x q rounded before m is added (`volatile`: never fused into one FMA, which would round
// once).
void dequantize_column(const uint8_t* block, const uint8_t* header, const Layout& layout, int64_t c, float* out) {
  for (int64_t j = 0; j < kBlock; ++j) {
    const int64_t h = layout.halves && j >= 16 ? 1 : 0;
    const volatile float product = packed_d(layout, block, header, c, h) * static_cast<float>(quant_at(block, layout, c, j));
    out[j] = layout.offset() ? product + packed_m(layout, block, header, c, h) : product;
  }
}

// Portable loops: for each row and each of the group's 8 outputs, block by block, the AVX2 path's operations.
template <int Bits, int Scales, bool Halves, int Table>
void tile_portable(const Tile& t, int64_t count) {
  constexpr Layout layout{Bits, Scales, Halves, Table};
  for (int64_t r = t.first; r < t.first + count; ++r) {
    for (int64_t c = 0; c < kCols; ++c) {
      float acc = 0.0f;
      for (int64_t b = 0; b < t.blocks; ++b) {
        const uint8_t *g = t.group + layout.block_at(b), *header = t.group + layout.header_at(b);
        const int8_t* qx = &t.x->q[t.x->at(r, b) * kBlock];
        int32_t dots[2] = {0, 0};  // weights 0-15, 16-31
        for (int64_t j = 0; j < kBlock; ++j) dots[j / 16] += quant_at(g, layout, c, j) * qx[j];
        const int64_t at = t.x->at(r, b);
        const float a = t.x->scale[at];
        if constexpr (Halves) {
          acc = std::fma(packed_d(layout, g, header, c, 0) * a, static_cast<float>(dots[0]), acc);
          acc = std::fma(packed_d(layout, g, header, c, 1) * a, static_cast<float>(dots[1]), acc);
        } else {
          acc = std::fma(packed_d(layout, g, header, c, 0) * a, static_cast<float>(dots[0] + dots[1]), acc);
        }
        if constexpr (layout.offset() && Halves) {
          acc = std::fma(packed_m(layout, g, header, c, 0), t.x->scaled_halves[2 * at], acc);
          acc = std::fma(packed_m(layout, g, header, c, 1), t.x->scaled_halves[2 * at + 1], acc);
        } else if constexpr (layout.offset()) {
          acc = std::fma(packed_m(layout, g, header, c, 0), t.x->scaled_sum[at], acc);
        }
      }
      t.out[(r - t.first) * t.out_stride + c] = acc;
    }
  }
}

#if defined(SMOLSERVE_QUANT_AVX2)
inline __m256i broadcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm256_set1_epi32(four);
}

// The 8 columns' scales d at p (a super-block's: its integer scales at p, signed unless `Unsigned`, times the d of
// the header), and offsets m (a super-block's: -(dmin mn)), as packed_d and packed_m compute them.
template <int Scales, bool Unsigned>
inline __m256 load_d(const uint8_t* p, const uint8_t* header) {
  if constexpr (Scales == kFloatScales) return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  if constexpr (Scales == kHalfScales) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256i wide = Unsigned ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes);
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header)));
  __m256 product = _mm256_mul_ps(d, _mm256_cvtepi32_ps(wide));
  __asm__("" : "+x"(product));  // as packed_d's `volatile`: -ffast-math may not regroup d sc a
  return product;
}

template <int Scales>
inline __m256 load_m(const uint8_t* p, const uint8_t* header) {
  if constexpr (Scales != kSuperScales) return load_d<Scales, true>(p, header);
  return _mm256_xor_ps(load_d<Scales, true>(p, header + 2 * kCols), _mm256_set1_ps(-0.0f));
}

// VNNI's unsigned weights (q + 128, or a table's value + 128) summed against activations whose int8 values sum to
// `sum`: the signed weights' integer sums, 128 sum taken off.
inline __m256i unlifted(__m256i sums, int32_t sum) { return _mm256_sub_epi32(sums, _mm256_set1_epi32(128 * sum)); }

// Rows [first, first + R) against one group of a 4- or 5-bit matrix: a block's 8 integer dot products per row in
// one vector (two with `Halves`: weights 0-15 and 16-31), summed in int16 while they fit (4-bit: 4 runs, at most
// 4 * 2 * 2 * 15 * 128 = 30720; 5-bit: 2 runs, 2 * 2 * 2 * 31 * 128 = 31744), then in int32, scaled and summed in
// float.
//
// A table's nibbles (MXFP4) become its signed int8 values by one byte shuffle, then multiply as the 8-bit path's do
// (|w| times x with w's sign; with VNNI, w + 128 and 128 sum(x) taken off); its 4 runs' int16 sums stay below
// 4 * 2 * 2 * 12 * 127 = 24384. No offset.
template <int64_t R, int Bits, int Scales, bool Halves, bool Vnni, int Table>
void tile_q4_avx2(const Tile& t) {
  constexpr Layout layout{Bits, Scales, Halves, Table};
  constexpr int64_t bytes = layout.bytes(), half = layout.scale_bytes() / 2, flush = Bits == 5 ? 2 : 4;
  constexpr int64_t parts = Halves ? 2 : 1;
  static_assert(Table == 0 || Table == kMXFP4Table, "a table's int16 sums are bounded for MXFP4's values only");
  const __m256i nibble = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
  __m256i table = _mm256_setzero_si256();
  if constexpr (Table != 0) {
    table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kTables[Table])));
  }
  __m256 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < t.blocks; ++b) {
    const int64_t base = t.x->at(t.first, b);  // row first + r's block b: base + r
    const uint8_t *g = t.group + layout.block_at(b), *header = t.group + layout.header_at(b);
    smolserve::prefetch_ahead(g, bytes);
    const int8_t* qx[R];
    __m256i sums[R][parts], wide[R][parts];
    for (int64_t r = 0; r < R; ++r) {
      qx[r] = &t.x->q[(base + r) * kBlock];
      for (int64_t p = 0; p < parts; ++p) sums[r][p] = wide[r][p] = _mm256_setzero_si256();
    }
    __m256i high_bits = _mm256_setzero_si256();
    if constexpr (Bits == 5) high_bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + layout.high_at()));
    for (int64_t k = 0; k < 4; ++k) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + layout.quants_at() + 32 * k));
      __m256i low = _mm256_and_si256(w, nibble), high = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
      if constexpr (Bits == 5) {  // run k's fifth bits are bits 2k and 2k + 1 of each byte: moved to bit 4
        low = _mm256_or_si256(low, _mm256_and_si256(_mm256_slli_epi16(high_bits, 4), fifth));
        high = _mm256_or_si256(high, _mm256_and_si256(_mm256_slli_epi16(high_bits, 3), fifth));
        high_bits = _mm256_srli_epi16(high_bits, 2);
      }
      __m256i low_x_sign = low, high_x_sign = high;  // what gives each activation its weight's sign (a table's)
      if constexpr (Table != 0 && Vnni) {  // the table's values + 128, unsigned, as the 8-bit path's
        low = _mm256_xor_si256(_mm256_shuffle_epi8(table, low), _mm256_set1_epi8(static_cast<char>(0x80)));
        high = _mm256_xor_si256(_mm256_shuffle_epi8(table, high), _mm256_set1_epi8(static_cast<char>(0x80)));
      } else if constexpr (Table != 0) {
        low_x_sign = _mm256_shuffle_epi8(table, low);
        high_x_sign = _mm256_shuffle_epi8(table, high);
        low = _mm256_sign_epi8(low_x_sign, low_x_sign);
        high = _mm256_sign_epi8(high_x_sign, high_x_sign);
      }
      for (int64_t r = 0; r < R; ++r) {
        __m256i xl = broadcast4(qx[r] + 4 * k), xh = broadcast4(qx[r] + 16 + 4 * k);
        if constexpr (Table != 0 && !Vnni) {
          xl = _mm256_sign_epi8(xl, low_x_sign);
          xh = _mm256_sign_epi8(xh, high_x_sign);
        }
#if defined(SMOLSERVE_QUANT_VNNI)
        if constexpr (Vnni) {
          wide[r][0] = _mm256_dpbusd_epi32(wide[r][0], low, xl);
          wide[r][parts - 1] = _mm256_dpbusd_epi32(wide[r][parts - 1], high, xh);
          continue;
        }
#endif
        const __m256i pl = _mm256_maddubs_epi16(low, xl);
        const __m256i ph = _mm256_maddubs_epi16(high, xh);
        if constexpr (Halves) {
          sums[r][0] = _mm256_add_epi16(sums[r][0], pl);
          sums[r][1] = _mm256_add_epi16(sums[r][1], ph);
        } else {
          sums[r][0] = _mm256_add_epi16(sums[r][0], _mm256_add_epi16(pl, ph));
        }
        if ((k + 1) % flush == 0) {
          for (int64_t p = 0; p < parts; ++p) {
            wide[r][p] = _mm256_add_epi32(wide[r][p], _mm256_madd_epi16(sums[r][p], ones));
            sums[r][p] = _mm256_setzero_si256();
          }
        }
      }
    }
    const __m256 d = load_d<Scales, true>(g, header);
    __m256 m = _mm256_setzero_ps(), d_high = m, m_high = m;
    if constexpr (Table == 0) m = load_m<Scales>(g + layout.scale_bytes(), header);
    if constexpr (Halves) {
      d_high = load_d<Scales, true>(g + half, header);
      m_high = load_m<Scales>(g + layout.scale_bytes() + half, header);
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t at = base + r;
      const __m256 a = _mm256_set1_ps(t.x->scale[at]);
      if constexpr (Table != 0 && Vnni) {
        wide[r][0] = unlifted(wide[r][0], t.x->halves[2 * at] + t.x->halves[2 * at + 1]);
      }
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, a), _mm256_cvtepi32_ps(wide[r][0]), acc[r]);
      if constexpr (Table != 0) continue;  // no offset
      if constexpr (Halves) {
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d_high, a), _mm256_cvtepi32_ps(wide[r][1]), acc[r]);
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(t.x->scaled_halves[2 * at]), acc[r]);
        acc[r] = _mm256_fmadd_ps(m_high, _mm256_set1_ps(t.x->scaled_halves[2 * at + 1]), acc[r]);
      } else {
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(t.x->scaled_sum[at]), acc[r]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) _mm256_storeu_ps(t.out + r * t.out_stride, acc[r]);
}

// The same for 8-bit: signed weights, so |q| times qx with q's sign; pairs reach 2 * 128 * 127, so int32 per run.
// With VNNI, whose vpdpbusd sums in int32 without saturating, q + 128 (unsigned) times qx instead, and 128 times
// the block's sum of qx taken off after: the same integers, one operation a row and run fewer (no sign per row).
// With `Halves` (Q3_K) the runs of weights 0-15 and 16-31 are summed apart, each with its own scale.
template <int64_t R, int Scales, bool Halves, bool Vnni>
void tile_q8_avx2(const Tile& t) {
  constexpr Layout layout{8, Scales, Halves};
  static_assert(Scales != kSuperScales, "8-bit quants keep their scales whole");
  constexpr int64_t bytes = layout.bytes();
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < t.blocks; ++b) {
    const int64_t base = t.x->at(t.first, b);  // row first + r's block b: base + r
    const uint8_t* g = t.group + b * bytes;
    smolserve::prefetch_ahead(g, bytes);
    const int8_t* qx[R];
    __m256i sums[R][2];
    for (int64_t r = 0; r < R; ++r) {
      qx[r] = &t.x->q[(base + r) * kBlock];
      sums[r][0] = sums[r][1] = _mm256_setzero_si256();
    }
    for (int64_t k = 0; k < 8; ++k) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + layout.quants_at() + 32 * k));
#if defined(SMOLSERVE_QUANT_VNNI)
      if constexpr (Vnni) {  // q + 128, unsigned: vpdpbusd's int32 sums do not saturate; 128 sum(qx) comes off below
        const __m256i lifted = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
        for (int64_t r = 0; r < R; ++r) {
          __m256i& sum = sums[r][Halves && k >= 4];
          sum = _mm256_dpbusd_epi32(sum, lifted, broadcast4(qx[r] + 4 * k));
        }
        continue;
      }
#endif
      const __m256i magnitude = _mm256_sign_epi8(w, w);
      for (int64_t r = 0; r < R; ++r) {
        const __m256i x = _mm256_sign_epi8(broadcast4(qx[r] + 4 * k), w);
        __m256i& sum = sums[r][Halves && k >= 4];
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x), ones));
      }
    }
    if constexpr (Vnni) {
      for (int64_t r = 0; r < R; ++r) {
        const int32_t* halves = &t.x->halves[2 * (base + r)];
        if constexpr (Halves) {
          sums[r][0] = unlifted(sums[r][0], halves[0]);
          sums[r][1] = unlifted(sums[r][1], halves[1]);
        } else {
          sums[r][0] = unlifted(sums[r][0], halves[0] + halves[1]);
        }
      }
    }
    const __m256 d = load_d<Scales, false>(g, nullptr);
    for (int64_t r = 0; r < R; ++r) {
      const __m256 a = _mm256_set1_ps(t.x->scale[base + r]);
      if constexpr (Halves) {
        const __m256 d_high = load_d<Scales, false>(g + layout.scale_bytes() / 2, nullptr);
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, a), _mm256_cvtepi32_ps(sums[r][0]), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d_high, a), _mm256_cvtepi32_ps(sums[r][1]), acc[r]);
      } else {
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, a), _mm256_cvtepi32_ps(sums[r][0]), acc[r]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) _mm256_storeu_ps(t.out + r * t.out_stride, acc[r]);
}

// Q6_K's 6-bit quants: run k's nibbles with their high 2 bits (bits 2k, 2k + 1 of the two planes: the 5-bit path's
// shifts) are q, 0..63, unsigned: they multiply the activations directly (vpmaddubsw pairs reach 2 * 63 * 127), and
// 32 times the activations' sum is taken off after: sum((q - 32) x), Q6_K's int8 values' integer sums exactly,
// with no sign trick. Weights 0-15 (the low nibbles) and 16-31 (the high) are summed apart, each with its own
// scale, as the 8-bit path's halves.
template <int64_t R, bool Vnni>
void tile_q6_avx2(const Tile& t) {
  constexpr Layout layout{6, kSuperScales, true};
  const __m256i nibble = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < t.blocks; ++b) {
    const int64_t base = t.x->at(t.first, b);  // row first + r's block b: base + r
    const uint8_t *g = t.group + layout.block_at(b), *header = t.group + layout.header_at(b);
    smolserve::prefetch_ahead(g, layout.bytes());
    const int8_t* qx[R];
    __m256i sums[R][2];
    for (int64_t r = 0; r < R; ++r) {
      qx[r] = &t.x->q[(base + r) * kBlock];
      sums[r][0] = sums[r][1] = _mm256_setzero_si256();
    }
    __m256i plane_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + layout.high_at()));
    __m256i plane_high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + layout.high_at() + 32));
    for (int64_t k = 0; k < 4; ++k) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + layout.quants_at() + 32 * k));
      const __m256i low = _mm256_or_si256(_mm256_and_si256(w, nibble),
                                          _mm256_and_si256(_mm256_slli_epi16(plane_low, 4), top));
      const __m256i high = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), nibble),
                                           _mm256_and_si256(_mm256_slli_epi16(plane_high, 4), top));
      plane_low = _mm256_srli_epi16(plane_low, 2);
      plane_high = _mm256_srli_epi16(plane_high, 2);
      for (int64_t r = 0; r < R; ++r) {
        const __m256i xl = broadcast4(qx[r] + 4 * k), xh = broadcast4(qx[r] + 16 + 4 * k);
#if defined(SMOLSERVE_QUANT_VNNI)
        if constexpr (Vnni) {
          sums[r][0] = _mm256_dpbusd_epi32(sums[r][0], low, xl);
          sums[r][1] = _mm256_dpbusd_epi32(sums[r][1], high, xh);
          continue;
        }
#endif
        sums[r][0] = _mm256_add_epi32(sums[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(low, xl), ones));
        sums[r][1] = _mm256_add_epi32(sums[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(high, xh), ones));
      }
    }
    const __m256 d = load_d<kSuperScales, false>(g, header);
    const __m256 d_high = load_d<kSuperScales, false>(g + layout.scale_bytes() / 2, header);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t at = base + r;
      const __m256 a = _mm256_set1_ps(t.x->scale[at]);
      const __m256i low = _mm256_sub_epi32(sums[r][0], _mm256_set1_epi32(32 * t.x->halves[2 * at]));
      const __m256i high = _mm256_sub_epi32(sums[r][1], _mm256_set1_epi32(32 * t.x->halves[2 * at + 1]));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, a), _mm256_cvtepi32_ps(low), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d_high, a), _mm256_cvtepi32_ps(high), acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) _mm256_storeu_ps(t.out + r * t.out_stride, acc[r]);
}

template <int Bits, int Scales, bool Halves, bool Vnni, int Table>
void tile_avx2(const Tile& t, int64_t count) {
  auto run = [&](auto rows) {
    if constexpr (Bits == 8) tile_q8_avx2<decltype(rows)::value, Scales, Halves, Vnni>(t);
    else if constexpr (Bits == 6) tile_q6_avx2<decltype(rows)::value, Vnni>(t);
    else tile_q4_avx2<decltype(rows)::value, Bits, Scales, Halves, Vnni, Table>(t);
  };
  switch (count) {
    case 1: return run(std::integral_constant<int64_t, 1>{});
    case 2: return run(std::integral_constant<int64_t, 2>{});
    case 3: return run(std::integral_constant<int64_t, 3>{});
    case 4: return run(std::integral_constant<int64_t, 4>{});
  }
  if constexpr (Vnni) {  // count <= kRowTileVnni
    switch (count) {
      case 5: return run(std::integral_constant<int64_t, 5>{});
      case 6: return run(std::integral_constant<int64_t, 6>{});
      case 7: return run(std::integral_constant<int64_t, 7>{});
      default: return run(std::integral_constant<int64_t, 8>{});
    }
  }
}
#endif

using TileFn = void (*)(const Tile&, int64_t);

// The paths this build has, best last.
std::vector<int64_t> available_paths() {
  std::vector<int64_t> paths{kPortable};
#if defined(SMOLSERVE_QUANT_AVX2)
  paths.push_back(kAvx2);
#endif
#if defined(SMOLSERVE_QUANT_VNNI)
  paths.push_back(kVnni);
#endif
  return paths;
}

template <int Bits, int Scales, bool Halves, int Table = 0>
TileFn tile_of(int64_t path) {
#if defined(SMOLSERVE_QUANT_VNNI)
  if (path == kVnni) return tile_avx2<Bits, Scales, Halves, true, Table>;
#endif
#if defined(SMOLSERVE_QUANT_AVX2)
  if (path == kAvx2) return tile_avx2<Bits, Scales, Halves, false, Table>;
#endif
  return tile_portable<Bits, Scales, Halves, Table>;
}

// One instantiation for each layout `layout_of` gives, on `path` (which this build must have).
TileFn tile_function(const Layout& layout, int64_t path) {
  switch (layout.bits) {
    case 4:
      if (layout.table == kMXFP4Table) return tile_of<4, kFloatScales, false, kMXFP4Table>(path);
      if (layout.halves) return tile_of<4, kFloatScales, true>(path);  // Q2_K
      return layout.super() ? tile_of<4, kSuperScales, false>(path) : tile_of<4, kHalfScales, false>(path);
    case 5: return layout.super() ? tile_of<5, kSuperScales, false>(path) : tile_of<5, kHalfScales, false>(path);
    case 6: return tile_of<6, kSuperScales, true>(path);  // Q6_K
    default:
      if (layout.halves) return tile_of<8, kFloatScales, true>(path);  // Q3_K
      if (layout.scales == kFloatScales) return tile_of<8, kFloatScales, false>(path);  // IQ4_XS
      return tile_of<8, kHalfScales, false>(path);
  }
}

}  // namespace

namespace smolserve {

// weight uint8 [out, bytes per row] in GGML's layout of `type` -> uint8 [ceil(out / 8), in / 32 * group block
// bytes], the layout `quant_linear` reads (outputs past `out` in the last group: zero scales).
at::Tensor quant_pack(const at::Tensor& weight, int64_t type) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte, "expected weight uint8 [out, bytes]");
  const Layout layout = layout_of(type);
  const int64_t bytes = block_bytes(type), out = weight.size(0), subs = block_weights(type) / kBlock;
  TORCH_CHECK(weight.size(1) % bytes == 0, "weight bytes per row are not whole blocks of this type");
  const int64_t blocks = weight.size(1) / bytes, groups = (out + kCols - 1) / kCols;
  const int64_t row_bytes = layout.row_bytes(blocks * subs);
  const at::Tensor source = weight.contiguous();
  at::Tensor packed = at::empty({groups, row_bytes}, weight.options());
  if (out % kCols) packed[groups - 1].zero_();  // its columns past `out`: zero scales
  const uint8_t* w = source.const_data_ptr<uint8_t>();
  uint8_t* p = packed.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    SubBlock decoded[8];
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t c = 0; c < kCols && g * kCols + c < out; ++c) {
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* block = w + (g * kCols + c) * blocks * bytes + b * bytes;
          uint8_t* group = p + g * row_bytes;
          if (type == kMXFP4) {
            pack_mxfp4(block, layout, c, group + layout.block_at(b));
            continue;
          }
          decode_block(block, type, decoded);
          for (int64_t s = 0; s < subs; ++s) {
            const int64_t at = b * subs + s;
            write_sub_block(decoded[s], layout, c, group + layout.block_at(at), group + layout.header_at(at));
          }
        }
      }
    }
  });
  return packed;
}

// x [rows, in] float32 or bfloat16 (contiguous rows); packed: `quant_pack(weight, type)` of a weight with
// `out_features` rows; returns x @ W.T, [rows, out_features], in x's dtype. `path`: 0 the best this build has, or
// one of `quant_paths()` (1 the plain loops, 2 AVX2, 3 AVX-512 VNNI): every path gives the same bits.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t type, int64_t out_features,
                        int64_t path) {
  const std::vector<int64_t> paths = available_paths();
  if (path == kBest) path = paths.back();
  TORCH_CHECK(std::find(paths.begin(), paths.end(), path) != paths.end(), "this build has no quant_linear path ", path);
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2, "expected x [rows, in] and packed weight [groups, bytes]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed weight must be contiguous uint8");
  const Layout layout = layout_of(type);
  const int64_t rows = x.size(0), in = x.size(1), blocks = in / kBlock, groups = packed.size(0);
  TORCH_CHECK(in % kBlock == 0, "the input size must be a multiple of 32");
  TORCH_CHECK(!layout.super() || blocks % 8 == 0, "this type's rows are whole blocks of 256");
  TORCH_CHECK(packed.size(1) == layout.row_bytes(blocks), "packed weight bytes do not match the input size");
  TORCH_CHECK(out_features > (groups - 1) * kCols && out_features <= groups * kCols,
              "out_features does not match the packed weight's groups");
  const at::Tensor input = x.contiguous();
  QuantizedRows quantized;
  if (input.scalar_type() == at::kBFloat16) {
    quantized = quantize_rows(input.const_data_ptr<c10::BFloat16>(), rows, in, path == kPortable);
  } else {
    TORCH_CHECK(input.scalar_type() == at::kFloat, "x must be float32 or bfloat16");
    quantized = quantize_rows(input.const_data_ptr<float>(), rows, in, path == kPortable);
  }
  const int64_t width = groups * kCols;
  at::Tensor result = at::empty({rows, width}, input.options().dtype(at::kFloat));
  float* out = result.mutable_data_ptr<float>();
  const uint8_t* w = packed.const_data_ptr<uint8_t>();
  const int64_t group_bytes = packed.size(1);
  const TileFn tile = tile_function(layout, path);
  // Q3_K's two sums a row fill AVX-512's registers at 8 rows (measured 0.8x of 4 there); Q6_K's 6-bit quants cost
  // more to unpack, and 8 rows sharing them took 0.7-0.8x the time of 4 at 64 rows.
  const int64_t row_tile = path == kVnni && (!layout.halves || layout.bits == 6) ? kRowTileVnni : kRowTile;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = 0; chunk < rows; chunk += kChunk) {
      const int64_t chunk_end = std::min(rows, chunk + kChunk);
      for (int64_t g = begin; g < end; ++g) {
        for (int64_t first = chunk; first < chunk_end; first += row_tile) {
          const Tile t{w + g * group_bytes, blocks, &quantized, first, out + first * width + g * kCols, width};
          tile(t, std::min(row_tile, chunk_end - first));
        }
      }
    }
  });
  if (width != out_features) result = result.narrow(1, 0, out_features).contiguous();
  return input.scalar_type() == at::kFloat ? result : result.to(input.scalar_type());
}

// The quant_linear paths this build has (1 the plain loops, 2 AVX2, 3 AVX-512 VNNI), best last.
std::vector<int64_t> quant_paths() { return available_paths(); }

// Rows `index` [count] int64 of the matrix `packed` holds, dequantized: [count, in] float32 (an embedding lookup
// in a model served from its blocks).
at::Tensor quant_rows(const at::Tensor& packed, int64_t type, const at::Tensor& index) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed weight must be contiguous uint8 [groups, bytes]");
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong, "index must be int64 [count]");
  const Layout layout = layout_of(type);
  const int64_t span = layout.super() ? layout.span() : layout.bytes(), subs = layout.super() ? 8 : 1;
  TORCH_CHECK(packed.size(1) % span == 0, "packed weight bytes are not whole blocks of this type");
  const int64_t count = index.size(0), blocks = packed.size(1) / span * subs, rows = packed.size(0) * kCols;
  const at::Tensor ids = index.contiguous();
  at::Tensor result = at::empty({count, blocks * kBlock}, packed.options().dtype(at::kFloat));
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const uint8_t* p = packed.const_data_ptr<uint8_t>();
  float* out = result.mutable_data_ptr<float>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, "row ", id[i], " is out of range");
    const uint8_t* group = p + id[i] / kCols * packed.size(1);
    for (int64_t b = 0; b < blocks; ++b) {
      dequantize_column(group + layout.block_at(b), group + layout.header_at(b), layout, id[i] % kCols,
                        out + (i * blocks + b) * kBlock);
    }
  }
  return result;
}

}  // namespace smolserve

TORCH_LIBRARY_FRAGMENT(smolserve, m) {
  m.def("quant_pack(Tensor weight, int type) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor packed, int type, int out_features, int path=0) -> Tensor");
  m.def("quant_paths() -> int[]", &smolserve::quant_paths);  // no tensor to dispatch on: one kernel for all
  m.def("quant_rows(Tensor packed, int type, Tensor index) -> Tensor");
}

TORCH_LIBRARY_IMPL(smolserve, CPU, m) {
  m.impl("quant_pack", &smolserve::quant_pack);
  m.impl("quant_linear", &smolserve::quant_linear);
  m.impl("quant_rows", &smolserve::quant_rows);
}
