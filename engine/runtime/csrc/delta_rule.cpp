// Qwen3.5's gated delta rule (Gated DeltaNet) over one sequence's positions, in float32 on the CPU: each value head
// keeps a [key dim, value dim] matrix S; at each position S decays by exp(g), the key reads v' = S^T k from it, S
// moves toward the value by beta (S += k (v - v')^T beta), and the query reads o = S^T q. The same arithmetic as
// transformers' torch_recurrent_gated_delta_rule, in another order of sums: over the key dimension, one row of S
// after another (ascending), every value column at once. A head's result is the same whatever else the step holds
// or however the sequence's positions were cut into calls (each position reads the S the one before it left), and
// every head is computed by one thread.
//
// Two passes over S a position: decay it and read the key's value; then move it and read the query's. S is 64 KiB
// a head at 128 x 128: it stays in the core's cache between the passes.
//
// Without the correction (correct = false) it is Mamba-2's selective scan (Granite 4.0-H) in the same form: S
// decays by exp(g) and moves by k (v beta)^T, the key B, the value x, beta the step dt, the query C. With AVX-512
// and value dims of whole vectors, a sequence's several positions (a prompt's) go a 16-value column of S at a time:
// the scan takes up to kFused positions a pass over a column, moved position after position in a register, each
// position's read summed as it goes (one pass a position read and wrote S: at Granite 4.0-H's 48 heads of 128 x 64
// the loads and stores, not the arithmetic, set its time); the rule's two passes a position stay on one column, in
// the core's first cache. A sequence's one position (a decoding step's) goes row by row, S read in memory order.
// Every element's arithmetic and every sum's order are the same on each path, so however a sequence's positions are
// cut into calls its bits are the same.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define SMOLSERVE_SCAN_AVX512 1
#endif

namespace smolserve {

namespace {

void check(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK(t.dim() == dims && t.is_contiguous(), name, " must be a contiguous ", dims, "-D tensor");
}

// One head, one position: S [keys][values], the position's query and key [keys], value [values]; out [values].
inline void head_step(float* S, const float* q, const float* k, const float* v, float decay, float beta,
                      float* out, float* read, int64_t keys, int64_t values, bool correct) {
  const float g = std::exp(decay);
  if (!correct) {  // Mamba-2: one pass, S = g S + k (v beta)^T, read by q
    for (int64_t j = 0; j < values; ++j) read[j] = v[j] * beta;
    for (int64_t j = 0; j < values; ++j) out[j] = 0.0f;
    for (int64_t i = 0; i < keys; ++i) {
      float* row = S + i * values;
      const float ki = k[i], qi = q[i];
      for (int64_t j = 0; j < values; ++j) {
        row[j] = row[j] * g + ki * read[j];
        out[j] += row[j] * qi;
      }
    }
    return;
  }
  for (int64_t j = 0; j < values; ++j) read[j] = 0.0f;
  for (int64_t i = 0; i < keys; ++i) {
    float* row = S + i * values;
    const float ki = k[i];
    for (int64_t j = 0; j < values; ++j) {
      row[j] *= g;
      read[j] += row[j] * ki;
    }
  }
  for (int64_t j = 0; j < values; ++j) read[j] = (v[j] - read[j]) * beta;  // the delta
  for (int64_t j = 0; j < values; ++j) out[j] = 0.0f;
  for (int64_t i = 0; i < keys; ++i) {
    float* row = S + i * values;
    const float ki = k[i], qi = q[i];
    for (int64_t j = 0; j < values; ++j) {
      row[j] += ki * read[j];
      out[j] += row[j] * qi;
    }
  }
}

#if SMOLSERVE_SCAN_AVX512
// Positions of Mamba-2's scan a pass over S takes (registers: P reads and P steps' x beta a 16-value column).
constexpr int64_t kFused = 4;
// Explicit rounding: these intrinsics are opaque to -ffast-math's rewriting of plain vector arithmetic.
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
// The widest value dim these paths take (a row of S in registers: its reads' sums, 16 values a vector).
constexpr int64_t kMaxValueVectors = 16;

// The element-wise arithmetic every path below shares, one definition each (the paths differ only in the order they
// visit S's elements, so a position's bits are the same on each).
inline __m512 decayed(__m512 s, __m512 g) { return _mm512_mul_round_ps(s, g, kNearest); }  // g S
inline __m512 decayed(const float* at, __m512 g) { return decayed(_mm512_loadu_ps(at), g); }
inline __m512 times(const float* at, float beta) {  // x beta: the scan's step
  return _mm512_mul_round_ps(_mm512_loadu_ps(at), _mm512_set1_ps(beta), kNearest);
}
inline __m512 summed(__m512 sum, __m512 s, float weight) {  // sum + s weight: a read by a key or a query
  return _mm512_fmadd_round_ps(s, _mm512_set1_ps(weight), sum, kNearest);
}
inline __m512 moved(__m512 decayed_s, float k, __m512 step) {  // g S + k step: the scan's move and the rule's
  return _mm512_fmadd_round_ps(_mm512_set1_ps(k), step, decayed_s, kNearest);
}
inline __m512 delta(const float* v, __m512 read, float beta) {  // (v - S^T k) beta
  return _mm512_mul_round_ps(_mm512_sub_round_ps(_mm512_loadu_ps(v), read, kNearest), _mm512_set1_ps(beta), kNearest);
}

// P positions of Mamba-2's scan for one head, S [keys][values] (values a multiple of 16): for each 16-value column
// of S, the column's rows in order, each moved by the P positions in turn (S = g S + k (x beta)) and read by their
// queries. q, k: the positions' [keys] vectors; v: their [values]; g: exp(decay); beta; out: their [values].
template <int P>
void scan_positions(float* S, const float* const* q, const float* const* k, const float* const* v, const float* g,
                    const float* beta, float* const* out, int64_t keys, int64_t values) {
  for (int64_t j = 0; j < values; j += 16) {
    __m512 step[P], read[P], decay[P];
    for (int p = 0; p < P; ++p) {
      step[p] = times(v[p] + j, beta[p]);
      read[p] = _mm512_setzero_ps();
      decay[p] = _mm512_set1_ps(g[p]);
    }
    float* column = S + j;
    for (int64_t i = 0; i < keys; ++i) {
      __m512 s = _mm512_loadu_ps(column + i * values);
      for (int p = 0; p < P; ++p) {
        s = moved(decayed(s, decay[p]), k[p][i], step[p]);
        read[p] = summed(read[p], s, q[p][i]);
      }
      _mm512_storeu_ps(column + i * values, s);
    }
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(out[p] + j, read[p]);
  }
}

// One position of Mamba-2's scan for one head, row by row of S (a decoding sequence's: S read once, in the order it
// lies in memory; column by column it was read at a stride, ~1.7x the time over 32 sequences' 50 MB): each element's
// arithmetic and each read's order of sums as scan_positions's.
void scan_position(float* S, const float* q, const float* k, const float* v, float g, float beta, float* out,
                   int64_t keys, int64_t values) {
  const int64_t vectors = values / 16;
  __m512 step[kMaxValueVectors], read[kMaxValueVectors];
  const __m512 decay = _mm512_set1_ps(g);
  for (int64_t j = 0; j < vectors; ++j) {
    step[j] = times(v + 16 * j, beta);
    read[j] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < keys; ++i) {
    float* row = S + i * values;
    for (int64_t j = 0; j < vectors; ++j) {
      const __m512 s = moved(decayed(row + 16 * j, decay), k[i], step[j]);
      _mm512_storeu_ps(row + 16 * j, s);
      read[j] = summed(read[j], s, q[i]);
    }
  }
  for (int64_t j = 0; j < vectors; ++j) _mm512_storeu_ps(out + 16 * j, read[j]);
}

// One position of the gated delta rule for one head, row by row of S (a decoding sequence's, as scan_position): each
// element's arithmetic and each sum's order as rule_head's.
void rule_position(float* S, const float* q, const float* k, const float* v, float g, float beta, float* out,
                   int64_t keys, int64_t values) {
  const int64_t vectors = values / 16;
  const __m512 decay = _mm512_set1_ps(g);
  __m512 sums[kMaxValueVectors];
  for (int64_t j = 0; j < vectors; ++j) sums[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < keys; ++i) {
    for (int64_t j = 0; j < vectors; ++j) {
      sums[j] = summed(sums[j], decayed(S + i * values + 16 * j, decay), k[i]);
    }
  }
  for (int64_t j = 0; j < vectors; ++j) sums[j] = delta(v + 16 * j, sums[j], beta);  // the key's read: the delta
  __m512 reads[kMaxValueVectors];
  for (int64_t j = 0; j < vectors; ++j) reads[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < keys; ++i) {
    for (int64_t j = 0; j < vectors; ++j) {
      float* at = S + i * values + 16 * j;
      const __m512 s = moved(decayed(at, decay), k[i], sums[j]);
      _mm512_storeu_ps(at, s);
      reads[j] = summed(reads[j], s, q[i]);
    }
  }
  for (int64_t j = 0; j < vectors; ++j) _mm512_storeu_ps(out + 16 * j, reads[j]);
}

// exp(x) by the scalar library call, as head_step takes it: a loop of these over a pass's positions was vectorized
// into the vector library's exp, whose last bit differs (a position's bits then depended on its pass).
__attribute__((noinline)) float scalar_exp(float x) { return std::exp(x); }

// One head's positions first .. first + count of Mamba-2's scan, kFused a pass (the last pass fewer); the vectors
// as delta_rules takes them, [rows, heads, ...].
void scan_head(float* S, int64_t first, int64_t count, int64_t heads, int64_t h, const float* q, const float* k,
               const float* v, const float* decay, const float* beta, float* o, int64_t keys, int64_t values) {
  for (int64_t t = first; t < first + count; t += kFused) {
    const int64_t n = std::min<int64_t>(kFused, first + count - t);
    const float *qs[kFused], *ks[kFused], *vs[kFused];
    float gs[kFused], bs[kFused], *os[kFused];
    for (int64_t p = 0; p < n; ++p) {
      const int64_t row = (t + p) * heads + h;
      qs[p] = q + row * keys, ks[p] = k + row * keys, vs[p] = v + row * values, os[p] = o + row * values;
      gs[p] = scalar_exp(decay[row]), bs[p] = beta[row];
    }
    if (n == 4) scan_positions<4>(S, qs, ks, vs, gs, bs, os, keys, values);
    if (n == 3) scan_positions<3>(S, qs, ks, vs, gs, bs, os, keys, values);
    if (n == 2) scan_positions<2>(S, qs, ks, vs, gs, bs, os, keys, values);
    if (n == 1) scan_positions<1>(S, qs, ks, vs, gs, bs, os, keys, values);
  }
}

// One head's positions first .. first + count of the gated delta rule, one 16-value column of S after another: a
// column's values depend only on that column (the key's read, the delta, the move, the query's read), so each
// position's two passes read the column's keys x 16 floats from the core's first cache, not the whole S from the
// second. The arithmetic is head_step's, element for element and in its order of sums.
void rule_head(float* S, int64_t first, int64_t count, int64_t heads, int64_t h, const float* q, const float* k,
               const float* v, const float* decay, const float* beta, float* o, int64_t keys, int64_t values) {
  for (int64_t j = 0; j < values; j += 16) {
    float* column = S + j;
    for (int64_t t = first; t < first + count; ++t) {
      const int64_t row = t * heads + h;
      const float *qt = q + row * keys, *kt = k + row * keys;
      const __m512 g = _mm512_set1_ps(scalar_exp(decay[row]));
      __m512 read = _mm512_setzero_ps();
      for (int64_t i = 0; i < keys; ++i) read = summed(read, decayed(column + i * values, g), kt[i]);
      const __m512 step = delta(v + row * values + j, read, beta[row]);
      __m512 out = _mm512_setzero_ps();
      for (int64_t i = 0; i < keys; ++i) {
        const __m512 s = moved(decayed(column + i * values, g), kt[i], step);
        _mm512_storeu_ps(column + i * values, s);
        out = summed(out, s, qt[i]);
      }
      _mm512_storeu_ps(o + row * values + j, out);
    }
  }
}
#endif

}  // namespace

// Several sequences' positions in one call: matrices [slots, heads, keys, values] (each piece's slot updated in
// place); pieces [n, 3] int64: a slot, its first row and its rows (no slot twice); query, key [rows, heads, keys];
// value [rows, heads, values]; decay, beta [rows, heads]; out [rows, heads, values], written for the pieces' rows.
// Each (piece, head) is one task, its positions in order: a head's sums are those of delta_rule, whatever else
// the call holds.
void delta_rules(at::Tensor matrices, const at::Tensor& pieces, const at::Tensor& query, const at::Tensor& key,
                 const at::Tensor& value, const at::Tensor& decay, const at::Tensor& beta, bool correct,
                 at::Tensor out) {
  check(matrices, "matrices", 4);
  check(query, "query", 3);
  check(key, "key", 3);
  check(value, "value", 3);
  check(decay, "decay", 2);
  check(beta, "beta", 2);
  check(out, "out", 3);
  TORCH_CHECK(pieces.scalar_type() == at::kLong && pieces.dim() == 2 && pieces.size(1) == 3 && pieces.is_contiguous(),
              "pieces must be [n, 3] int64: slot, first row, rows");
  const int64_t slots = matrices.size(0), heads = matrices.size(1), keys = matrices.size(2), values = matrices.size(3);
  const int64_t rows = query.size(0), n = pieces.size(0);
  TORCH_CHECK(query.size(1) == heads && query.size(2) == keys && key.sizes() == query.sizes(),
              "query and key must be [rows, heads, keys] of the matrices' heads and keys");
  TORCH_CHECK(value.size(0) == rows && value.size(1) == heads && value.size(2) == values && out.sizes() == value.sizes(),
              "value and out must be [rows, heads, values]");
  TORCH_CHECK(decay.size(0) == rows && decay.size(1) == heads && beta.sizes() == decay.sizes(),
              "decay and beta must be [rows, heads]");
  const int64_t* piece = pieces.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(piece[3 * i] >= 0 && piece[3 * i] < slots, "a piece's slot is out of range");
    TORCH_CHECK(piece[3 * i + 1] >= 0 && piece[3 * i + 2] >= 0 && piece[3 * i + 1] + piece[3 * i + 2] <= rows,
                "a piece's rows are out of range");
  }
  float* S = matrices.data_ptr<float>();
  const float *q = query.data_ptr<float>(), *k = key.data_ptr<float>(), *v = value.data_ptr<float>();
  const float *g = decay.data_ptr<float>(), *b = beta.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> read(values);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / heads, h = task % heads;
      float* matrix = S + (piece[3 * i] * heads + h) * keys * values;
#if SMOLSERVE_SCAN_AVX512
      if (values % 16 == 0 && values <= 16 * kMaxValueVectors) {
        const int64_t first = piece[3 * i + 1], count = piece[3 * i + 2], row = first * heads + h;
        if (count == 1) {  // a decoding sequence's one position: S in memory order
          (correct ? rule_position : scan_position)(matrix, q + row * keys, k + row * keys, v + row * values,
                                                    scalar_exp(g[row]), b[row], o + row * values, keys, values);
        } else {
          (correct ? rule_head : scan_head)(matrix, first, count, heads, h, q, k, v, g, b, o, keys, values);
        }
        continue;
      }
#endif
      for (int64_t t = piece[3 * i + 1]; t < piece[3 * i + 1] + piece[3 * i + 2]; ++t) {
        const int64_t row = t * heads + h;
        head_step(matrix, q + row * keys, k + row * keys, v + row * values, g[row], b[row], o + row * values,
                  read.data(), keys, values, correct);
      }
    }
  });
}

// One sequence's positions: matrix [heads, keys, values] (updated in place); query, key [positions, heads, keys];
// value [positions, heads, values]; decay, beta [positions, heads]; correct: the delta rule's correction (else
// Mamba-2's scan). Returns what each position's query reads, [positions, heads, values]: delta_rules' one piece.
at::Tensor delta_rule(at::Tensor matrix, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const at::Tensor& decay, const at::Tensor& beta, bool correct) {
  check(matrix, "matrix", 3);
  at::Tensor out = at::empty_like(value);
  const at::Tensor piece = at::tensor({int64_t{0}, int64_t{0}, query.size(0)}, at::kLong).reshape({1, 3});
  delta_rules(matrix.unsqueeze(0), piece, query, key, value, decay, beta, correct, out);
  return out;
}

}  // namespace smolserve

TORCH_LIBRARY_FRAGMENT(smolserve, m) {
  m.def("delta_rule(Tensor(a!) matrix, Tensor query, Tensor key, Tensor value, Tensor decay, Tensor beta, bool correct=True) -> Tensor");
  m.def("delta_rules(Tensor(a!) matrices, Tensor pieces, Tensor query, Tensor key, Tensor value, Tensor decay, "
        "Tensor beta, bool correct, Tensor(b!) out) -> ()");
}

TORCH_LIBRARY_IMPL(smolserve, CPU, m) {
  m.impl("delta_rule", &smolserve::delta_rule);
  m.impl("delta_rules", &smolserve::delta_rules);
}
