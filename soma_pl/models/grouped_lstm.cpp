// Grouped bias-free LSTM layer over a chunk of time steps, on the CPU, for zero-order evaluation.
//
// G groups (experts x perturbed copies) each carry their own recurrent weights and a few rows
// (windows); groups that share one weight set (EGGROLL's members of one expert) run as one bundle
// of their rows. Each group, or tile of a bundle's rows, runs all of the chunk's steps in turn, so
// its recurrent weights stay in the core's cache across them, and groups are shared among threads
// without any per-step barrier. A step is one register-blocked micro-kernel per register of hidden
// units (16 with AVX-512, 8 with AVX2) and up to 4 rows (2 with AVX2): the four gates' pre-activations
// for those units accumulate in 16 (8) vector registers (input projection + h_prev @ W_hh^T), then the gate activations, the cell and the hidden state are computed from them
// before anything is written back. No gate buffer and no library call per step: with a few rows
// per weight set a general GEMM call spends more on its set-up than on the product. In the model's
// layout the step also adds the hidden state to the residual stream and normalises it for the next
// layer while the row is in cache.
//
// The recurrent weights come packed by the caller (soma_pl.models.recurrence.pack_recurrent):
// [G, nb, d, 4, 16], for each block of 16 hidden units and each input k the 16 weights of each
// gate, zero beyond d, so a step reads them contiguously. Gate order (input, forget, cell, output),
// torch.nn.LSTM's, as in soma_pl.models.stacked. No autograd: used only when gradients are off.
//
// Also here: the tied head's next-byte cross entropy (grouped_head_nll), its logits formed in
// registers and reduced at once; the MLP's GELU with EGGROLL's rank-r terms of both its matrices
// beside it (grouped_gelu) and the rows' thin products with a rank-r factor (grouped_thin), each a
// single pass over the rows; and the core's multiply-add throughput (fma_gflops), the limit every
// ratio of the benchmarks can be read against.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;     // hidden units per block of the packed weights
constexpr int64_t kGates = 4;
constexpr int64_t kMaxRows = 4;    // rows per block of a step: tiles start at multiples of it
constexpr int64_t kTileRows = 8;   // rows of a shared weight set that run through a chunk's steps together

// One register of floats: 16 with AVX-512, 8 otherwise, where a block of 16 units runs as two halves
// of 8. A micro-kernel holds 4 gates x `kRegRows` rows of sums and 4 weight vectors in registers: 4 x 4 + 4
// of AVX-512's 32, 4 x 2 + 4 of AVX2's 16 (4 rows there spill the sums and ran at half the loop's speed).
#if defined(__AVX512F__)
constexpr int64_t kVec = 16;
constexpr int64_t kRegRows = 4;
#else
constexpr int64_t kVec = 8;
constexpr int64_t kRegRows = 2;
#endif
typedef float vec __attribute__((vector_size(kVec * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(kVec * sizeof(float)), aligned(4)));

// exp(x) by Cody-Waite range reduction and a degree-6 minimax polynomial (the Cephes expf
// coefficients): within 2 ulp of expf on [-87.3, 88.3], inputs clamped to that range. Branch-free
// arithmetic and a bit cast, so the compiler vectorizes the loops that call it. A NaN input fails
// both clamps and stays NaN through the polynomial. The constants are shared with the 16-lane
// version below (inverse_one_plus_exp), which runs the same arithmetic.
constexpr float kExpLow = -87.3f, kExpHigh = 88.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Correction = 2.12194440e-4f;  // r = x - k ln2 in two parts
constexpr int kExpTerms = 6;
constexpr float kExpPoly[kExpTerms] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                       4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float fast_exp(float x) {
  x = x < kExpLow ? kExpLow : x;
  x = x > kExpHigh ? kExpHigh : x;
  const float k = std::floor(x * kLog2e + 0.5f);
  const float r = x - k * kLn2High + k * kLn2Correction;
  float p = kExpPoly[0];
  for (int i = 1; i < kExpTerms; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.0f;
  const uint32_t bits = (static_cast<uint32_t>(static_cast<int32_t>(k)) + 127u) << 23;
  return p * __builtin_bit_cast(float, bits);
}

inline float sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }

inline float tanh_(float x) { return 2.0f / (1.0f + fast_exp(-2.0f * x)) - 1.0f; }

// The first `lanes` floats at `from` (zeros after them), and their store. A block's last lanes when d
// is not a multiple of 16 take a masked load / store: a lane-by-lane copy there compiles to a
// memcpy call and a stalled reload, which cost d_t = 44 a tenth of its step.
#if defined(__AVX2__) && !defined(__AVX512F__)
inline __m256i lane_mask(int64_t lanes) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(lanes)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

inline vec load(const float* from, int64_t lanes) {
  if (lanes == kVec) return *reinterpret_cast<const vec_unaligned*>(from);
#if defined(__AVX512F__)
  return (vec)_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << lanes) - 1), from);
#elif defined(__AVX2__)
  return (vec)_mm256_maskload_ps(from, lane_mask(lanes));
#else
  vec v = {};
  for (int64_t l = 0; l < lanes; ++l) v[l] = from[l];
  return v;
#endif
}

inline void store(float* to, vec from, int64_t lanes) {
  if (lanes == kVec) {
    *reinterpret_cast<vec_unaligned*>(to) = from;
    return;
  }
#if defined(__AVX512F__)
  _mm512_mask_storeu_ps(to, static_cast<__mmask16>((1u << lanes) - 1), (__m512)from);
#elif defined(__AVX2__)
  _mm256_maskstore_ps(to, lane_mask(lanes), (__m256)from);
#else
  for (int64_t l = 0; l < lanes; ++l) to[l] = from[l];
#endif
}

#if defined(__AVX512F__)
// The cell update on whole registers, the rows of a block at once. fast_exp's arithmetic on 16
// lanes (scalef for the power of two), and 1 / (1 + e) by the approximate reciprocal and one Newton
// step (relative error about 2^-28) instead of a division, which costs a 512-bit register as much
// as a dozen multiply-adds. Each stage runs over all N vectors before the next, so the N chains
// are interleaved and the pipes stay full instead of waiting on one chain's latency.
// max/min keep a NaN in their second operand.
template <int N>
inline void inverse_one_plus_exp(__m512* x) {  // x[i] <- 1 / (1 + exp(x[i]))
  __m512 k[N], r[N], p[N];
  for (int i = 0; i < N; ++i)
    x[i] = _mm512_min_ps(_mm512_set1_ps(kExpHigh), _mm512_max_ps(_mm512_set1_ps(kExpLow), x[i]));
  for (int i = 0; i < N; ++i)
    k[i] = _mm512_roundscale_ps(_mm512_fmadd_ps(x[i], _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  for (int i = 0; i < N; ++i) r[i] = _mm512_fnmadd_ps(k[i], _mm512_set1_ps(kLn2High), x[i]);
  for (int i = 0; i < N; ++i) r[i] = _mm512_fmadd_ps(k[i], _mm512_set1_ps(kLn2Correction), r[i]);
  for (int i = 0; i < N; ++i) p[i] = _mm512_set1_ps(kExpPoly[0]);
  for (int term = 1; term < kExpTerms; ++term)
    for (int i = 0; i < N; ++i) p[i] = _mm512_fmadd_ps(p[i], r[i], _mm512_set1_ps(kExpPoly[term]));
  for (int i = 0; i < N; ++i) p[i] = _mm512_fmadd_ps(_mm512_mul_ps(p[i], r[i]), r[i], r[i]);
  for (int i = 0; i < N; ++i)
    x[i] = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_scalef_ps(_mm512_add_ps(p[i], _mm512_set1_ps(1.0f)), k[i]));
  for (int i = 0; i < N; ++i) r[i] = _mm512_rcp14_ps(x[i]);
  for (int i = 0; i < N; ++i) x[i] = _mm512_fmadd_ps(r[i], _mm512_fnmadd_ps(x[i], r[i], _mm512_set1_ps(1.0f)), r[i]);
}

// Rows rows' new cells and hidden states of 16 units from their gates' pre-activations (input,
// forget, cell, output): sigmoid(x) = 1 / (1 + exp(-x)), tanh(x) = 2 / (1 + exp(-2x)) - 1.
template <int Rows>
inline void cell_update(vec (*gates)[kGates], vec* cell, vec* hidden) {
  __m512 a[Rows * kGates], t[Rows];
  const __m512 minus_one = _mm512_set1_ps(-1.0f), minus_two = _mm512_set1_ps(-2.0f), two = _mm512_set1_ps(2.0f),
               one = _mm512_set1_ps(1.0f);
  for (int r = 0; r < Rows; ++r)
    for (int q = 0; q < kGates; ++q) a[r * kGates + q] = _mm512_mul_ps((__m512)gates[r][q], q == 2 ? minus_two : minus_one);
  inverse_one_plus_exp<Rows * kGates>(a);
  for (int r = 0; r < Rows; ++r) {
    const __m512 candidate = _mm512_fmsub_ps(two, a[r * kGates + 2], one);
    const __m512 next = _mm512_fmadd_ps(a[r * kGates + 1], (__m512)cell[r], _mm512_mul_ps(a[r * kGates], candidate));
    cell[r] = (vec)next;
    t[r] = _mm512_mul_ps(next, minus_two);
  }
  inverse_one_plus_exp<Rows>(t);
  for (int r = 0; r < Rows; ++r) hidden[r] = (vec)_mm512_mul_ps(a[r * kGates + 3], _mm512_fmsub_ps(two, t[r], one));
}
#else
template <int Rows>
inline void cell_update(vec (*gates)[kGates], vec* cell, vec* hidden) {
  for (int r = 0; r < Rows; ++r) {
    alignas(64) float g[kGates][kVec];
    alignas(64) float c[kVec];
    alignas(64) float h[kVec];
    std::memcpy(g, gates[r], sizeof(g));
    std::memcpy(c, &cell[r], sizeof(c));
#pragma omp simd
    for (int64_t l = 0; l < kVec; ++l) {
      const float next = sigmoid(g[1][l]) * c[l] + sigmoid(g[0][l]) * tanh_(g[2][l]);
      c[l] = next;
      h[l] = sigmoid(g[3][l]) * tanh_(next);
    }
    std::memcpy(&cell[r], c, sizeof(c));
    std::memcpy(&hidden[r], h, sizeof(h));
  }
}
#endif

// Pins four vectors to registers: without it the compiler folds each load into every multiply-add
// that reads it (a memory operand per row), and the loads, not the multiply-adds, set the pace.
inline void keep_in_registers(vec& a, vec& b, vec& c, vec& d) {
#if defined(__AVX512F__) || defined(__AVX2__)
  asm("" : "+v"(a), "+v"(b), "+v"(c), "+v"(d));
#else
  (void)a, (void)b, (void)c, (void)d;
#endif
}

// acc[r][q] += h[r][k] * w[k][q] for k in [k0, k1): `Rows` rows of h at stride `h_stride`, four
// vectors of w at w + k * w_stride + q * q_stride. The sums are copied into locals for the loop, so the compiler
// keeps all of them in registers (2-4% faster per step than updating them through the pointer).
template <int Rows>
inline void accumulate(vec (*sums)[kGates], const float* w, const float* h, int64_t h_stride, int64_t k0, int64_t k1,
                       int64_t w_stride = kGates * kLanes, int64_t q_stride = kLanes) {
  vec acc[Rows][kGates];
  for (int r = 0; r < Rows; ++r)
    for (int q = 0; q < kGates; ++q) acc[r][q] = sums[r][q];
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * w_stride;
    vec w0 = *reinterpret_cast<const vec_unaligned*>(wk), w1 = *reinterpret_cast<const vec_unaligned*>(wk + q_stride),
        w2 = *reinterpret_cast<const vec_unaligned*>(wk + 2 * q_stride),
        w3 = *reinterpret_cast<const vec_unaligned*>(wk + 3 * q_stride);
    keep_in_registers(w0, w1, w2, w3);
    for (int r = 0; r < Rows; ++r) {
      const float s = h[r * h_stride + k];
      acc[r][0] += s * w0;
      acc[r][1] += s * w1;
      acc[r][2] += s * w2;
      acc[r][3] += s * w3;
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int q = 0; q < kGates; ++q) sums[r][q] = acc[r][q];
}

// Where one group's rows live: row r of step t at base + t * step + r * row, in floats. Time-major
// chunks ([T, b, n]) have step = b * n and row = n; window-major ones ([b, T, n]) step = n and row = T * n.
struct Strides {
  int64_t step, row;
};

// One step of `Rows` rows for hidden units [j0, j0 + lanes) of one group.
//   w: the packed weights of this unit block, [d][4][16];
//   gates_in: row r's input projections at gates_in + r * gi_row (gate q of unit j at q * d + j);
//   h_prev, h_next: row r at + r * hp_row, + r * hn_row; c: row r at + r * d.
//   extra_w, extra_h, extra_k: a further product of extra_k inputs (EGGROLL's rank-r terms): row r's
//   packed [extra_k][4][16] weights of this unit block at extra_w[r] (its member's own), its inputs at
//   extra_h + r * extra_k.
template <int Rows>
void unit_block(const float* w, const float* gates_in, int64_t gi_row, const float* h_prev, int64_t hp_row,
                float* h_next, int64_t hn_row, float* c, int64_t width, int64_t j0, int64_t lanes,
                const float* const* extra_w, const float* extra_h, int64_t extra_k) {
  vec acc[Rows][kGates];
  for (int r = 0; r < Rows; ++r)
    for (int q = 0; q < kGates; ++q) acc[r][q] = load(gates_in + r * gi_row + q * width + j0, lanes);
  if (extra_k)
    for (int r = 0; r < Rows; ++r) accumulate<1>(acc + r, extra_w[r], extra_h + r * extra_k, extra_k, 0, extra_k);
  if (Rows == 1) {
    // One row has four independent sums, too few to cover the FMA latency: a second set takes
    // the second half of k.
    vec second[1][kGates] = {};
    accumulate<1>(acc, w, h_prev, hp_row, 0, width / 2);
    accumulate<1>(second, w, h_prev, hp_row, width / 2, width);
    for (int q = 0; q < kGates; ++q) acc[0][q] += second[0][q];
  } else {
    accumulate<Rows>(acc, w, h_prev, hp_row, 0, width);
  }
  vec cell[Rows], hidden[Rows];
  for (int r = 0; r < Rows; ++r) cell[r] = load(c + r * width + j0, lanes);
  cell_update<Rows>(acc, cell, hidden);
  for (int r = 0; r < Rows; ++r) {
    store(c + r * width + j0, cell[r], lanes);
    store(h_next + r * hn_row + j0, hidden[r], lanes);
  }
}

// One step of one row in each of two groups with their own weights (w0, w1: this unit block's, as in
// unit_block), side by side: a lone row's step waits on its own products and activations, and the
// other group's fill those waits. Rows at gates_in, h_prev, h_next, c + r * (gi_row, hp_row, hn_row, d).
void own_pair_block(const float* w0, const float* w1, const float* gates_in, int64_t gi_row, const float* h_prev,
                    int64_t hp_row, float* h_next, int64_t hn_row, float* c, int64_t width, int64_t j0, int64_t lanes) {
  vec acc[2][kGates];
  for (int r = 0; r < 2; ++r)
    for (int q = 0; q < kGates; ++q) acc[r][q] = load(gates_in + r * gi_row + q * width + j0, lanes);
  const auto at = [](const float* w, int64_t k, int q) {
    return *reinterpret_cast<const vec_unaligned*>(w + k * kGates * kLanes + q * kLanes);
  };
  for (int64_t k = 0; k < width; ++k) {
    vec a0 = at(w0, k, 0), a1 = at(w0, k, 1), a2 = at(w0, k, 2), a3 = at(w0, k, 3);
    keep_in_registers(a0, a1, a2, a3);
    const float s0 = h_prev[k];
    acc[0][0] += s0 * a0;
    acc[0][1] += s0 * a1;
    acc[0][2] += s0 * a2;
    acc[0][3] += s0 * a3;
    vec b0 = at(w1, k, 0), b1 = at(w1, k, 1), b2 = at(w1, k, 2), b3 = at(w1, k, 3);
    keep_in_registers(b0, b1, b2, b3);
    const float s1 = h_prev[hp_row + k];
    acc[1][0] += s1 * b0;
    acc[1][1] += s1 * b1;
    acc[1][2] += s1 * b2;
    acc[1][3] += s1 * b3;
  }
  vec cell[2], hidden[2];
  for (int r = 0; r < 2; ++r) cell[r] = load(c + r * width + j0, lanes);
  cell_update<2>(acc, cell, hidden);
  for (int r = 0; r < 2; ++r) {
    store(c + r * width + j0, cell[r], lanes);
    store(h_next + r * hn_row + j0, hidden[r], lanes);
  }
}

// EGGROLL's rank-r terms, when given: thin_in (x_t · B_ih; row r of a step at + r * thin_row), and for
// each group b_hh [d, r] and the packed joint factor [nb, 2r, 4, 16] of [A_ih, A_hh] (at + g * b_hh_group,
// + g * a_group); the gates gain [x_t · B_ih, h · B_hh] · [A_ih, A_hh]^T.
struct LowRank {
  const float* b_hh;
  const float* a_packed;
  int64_t rank, thin_row, b_hh_group, a_group;
};

// Which group row i of a bundle belongs to: the bundle's rows are `rows_per_group` rows of each of its
// groups in turn, the first of them row `first_row` of group `first_group`.
struct RowGroups {
  int64_t first_group, first_row, rows_per_group;
  int64_t of(int64_t i) const { return first_group + (first_row + i) / rows_per_group; }
};

// One step of `rows` rows sharing one weight set, all hidden units; rows at strides gi_row (gates_in),
// hp_row (h_prev), hn_row (h_next), width (c). thin: scratch of rows x 2r floats. own_pair: the two
// rows are one row of each of two groups, the second group's weights `own_pair` floats after the first's.
void group_step(const float* packed, const float* gates_in, int64_t gi_row, const float* h_prev, int64_t hp_row,
                float* h_next, int64_t hn_row, float* c, int64_t rows, int64_t width, const LowRank* low,
                const RowGroups& groups, const float* thin_in, float* thin, int64_t own_pair = 0) {
  const int64_t blocks = (width + kLanes - 1) / kLanes, extra_k = low ? 2 * low->rank : 0;
  // Unit block b's part `half` (of kLanes / kVec): units [j0, j0 + lanes), their weights at w.
  const auto part = [&](int64_t b, int64_t half, int64_t& j0, int64_t& lanes) {
    j0 = b * kLanes + half * kVec;
    lanes = std::min(kVec, width - j0);
    return packed + b * width * kGates * kLanes + half * kVec;
  };
  int64_t j0 = 0, lanes = 0;
  if (own_pair && rows == 2) {
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t half = 0; half < kLanes / kVec; ++half) {
        const float* w = part(b, half, j0, lanes);
        if (lanes > 0)
          own_pair_block(w, w + own_pair, gates_in, gi_row, h_prev, hp_row, h_next, hn_row, c, width, j0, lanes);
      }
    return;
  }
  if (low) {
    for (int64_t r = 0; r < rows; ++r) {
      float* row = thin + r * extra_k;
      const float* b_hh = low->b_hh + groups.of(r) * low->b_hh_group;
      std::memcpy(row, thin_in + r * low->thin_row, low->rank * sizeof(float));
      for (int64_t j = 0; j < low->rank; ++j) {
        float sum = 0.0f;
        for (int64_t k = 0; k < width; ++k) sum += h_prev[r * hp_row + k] * b_hh[k * low->rank + j];
        row[low->rank + j] = sum;
      }
    }
  }
  for (int64_t b = 0; b < blocks * (kLanes / kVec); ++b) {
    const float* w = part(b / (kLanes / kVec), b % (kLanes / kVec), j0, lanes);
    if (lanes <= 0) continue;
    for (int64_t r0 = 0; r0 < rows; r0 += kRegRows) {
      const int64_t n = std::min(kRegRows, rows - r0);
      const float* gi = gates_in + r0 * gi_row;
      const float* hp = h_prev + r0 * hp_row;
      float* hn = h_next + r0 * hn_row;
      float* cr = c + r0 * width;
      const float* eh = thin + r0 * extra_k;
      const float* extra_w[kMaxRows] = {};
      for (int64_t r = 0; low && r < n; ++r)
        extra_w[r] = low->a_packed + groups.of(r0 + r) * low->a_group +
                     (b / (kLanes / kVec)) * extra_k * kGates * kLanes + (b % (kLanes / kVec)) * kVec;
      switch (n) {
#if defined(__AVX512F__)
        case 4: unit_block<4>(w, gi, gi_row, hp, hp_row, hn, hn_row, cr, width, j0, lanes, extra_w, eh, extra_k); break;
        case 3: unit_block<3>(w, gi, gi_row, hp, hp_row, hn, hn_row, cr, width, j0, lanes, extra_w, eh, extra_k); break;
#endif
        case 2: unit_block<2>(w, gi, gi_row, hp, hp_row, hn, hn_row, cr, width, j0, lanes, extra_w, eh, extra_k); break;
        default: unit_block<1>(w, gi, gi_row, hp, hp_row, hn, hn_row, cr, width, j0, lanes, extra_w, eh, extra_k); break;
      }
    }
  }
}

// The sum of a vector's lanes, as a tree (a lane-by-lane sum waits on each add in turn).
inline float sum_lanes(vec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float total = 0.0f;
  for (int64_t l = 0; l < kVec; ++l) total += v[l];
  return total;
#endif
}

// The residual stream and the next layer's input after one step: for each of `rows` rows,
// x += h (row r of x at x + r * x_row, of h at h + r * width; none where h is null), then the gain-only LayerNorm
// normed = (x - mean(x)) / sqrt(var(x) + eps) * gain (row r at normed + r * x_row; its group's gain
// at gains + group * width). A block's padding lanes load as zeros, so each adds mean^2 to the
// centred squares: taken off before the variance.
void residual_norm(float* x, int64_t x_row, const float* h, float* normed, const float* gains, const RowGroups& groups,
                   int64_t rows, int64_t width, float eps) {
  const int64_t padding = (width + kVec - 1) / kVec * kVec - width;
  for (int64_t r = 0; r < rows; ++r) {
    const float* gain = gains + groups.of(r) * width;
    float* xr = x + r * x_row;
    const float* hr = h ? h + r * width : nullptr;
    vec sums = {};
    for (int64_t j = 0; j < width; j += kVec) {
      const int64_t lanes = std::min(kVec, width - j);
      vec sum = load(xr + j, lanes);
      if (h) {
        sum += load(hr + j, lanes);
        store(xr + j, sum, lanes);
      }
      sums += sum;
    }
    const float mean = sum_lanes(sums) / static_cast<float>(width);
    vec squares = {};
    for (int64_t j = 0; j < width; j += kVec) {
      const vec centred = load(xr + j, std::min(kVec, width - j)) - mean;
      squares += centred * centred;
    }
    const float variance = (sum_lanes(squares) - static_cast<float>(padding) * mean * mean) / static_cast<float>(width);
    const float scale = 1.0f / std::sqrt(std::max(variance, 0.0f) + eps);
    float* nr = normed + r * x_row;
    for (int64_t j = 0; j < width; j += kVec) {
      const int64_t lanes = std::min(kVec, width - j);
      store(nr + j, (load(xr + j, lanes) - mean) * scale * load(gain + j, lanes), lanes);
    }
  }
}

constexpr int64_t kVocab = 256;
constexpr int64_t kVocabPart = kGates * kVec;  // 4 vectors of logits per row and pass

// A head's second product (EGGROLL's rank-r part of a member's head): rank-r inputs per row at
// thin (stride rank) against head_low [rank, 256]; none where rank is 0.
struct HeadLow {
  const float* head_low;
  const float* thin;
  int64_t rank;
};

// Logits of `Rows` rows for one part of the vocabulary: logits[r][part * kVocabPart + j].
template <int Rows>
void logit_part(const float* head_t, const float* features, int64_t dim, const HeadLow& low, int64_t part,
                float (*logits)[kVocab]) {
  vec acc[Rows][kGates] = {};
  accumulate<Rows>(acc, head_t + part * kVocabPart, features, dim, 0, dim, kVocab, kVec);
  if (low.rank) accumulate<Rows>(acc, low.head_low + part * kVocabPart, low.thin, low.rank, 0, low.rank, kVocab, kVec);
  for (int r = 0; r < Rows; ++r) std::memcpy(logits[r] + part * kVocabPart, acc[r], sizeof(acc[r]));
}

// -log softmax(logits)[target], from the logits of one row.
float row_nll(const float* logits, int64_t target) {
  float top = logits[0];
#pragma omp simd reduction(max : top)
  for (int64_t v = 1; v < kVocab; ++v) top = logits[v] > top ? logits[v] : top;
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t v = 0; v < kVocab; ++v) total += fast_exp(logits[v] - top);
  if (target < 0 || target >= kVocab) return NAN;
  return top + std::log(total) - logits[target];
}

template <int Rows>
void nll_rows(const float* head_t, const float* features, const HeadLow& low, const int64_t* targets, float* nll,
              int64_t dim) {
  alignas(64) float logits[Rows][kVocab];
  for (int64_t part = 0; part < kVocab / kVocabPart; ++part) logit_part<Rows>(head_t, features, dim, low, part, logits);
  for (int r = 0; r < Rows; ++r) nll[r] = row_nll(logits[r], targets[r]);
}

}  // namespace

// gates_in: [G, T, b, 4d] input projections (contiguous), or [G, b, T, 4d] when window_major;
// packed: [P, nb, d, 4, 16] recurrent weights (nb = ceil(d / 16)), P dividing G, group g running
// packed[g / (G / P)] (P = G: a weight set per group; P = E: EGGROLL's members share their
// expert's, and in the window-major layout run as one bundle of rows); h0, c0: [G, b, d]. With
// EGGROLL's rank-r terms, each group's own: thin_in [G, T, b, r] ([G, b, T, r] when window_major),
// b_hh [G, d, r], a_packed [G, nb, 2r, 4, 16].
// With `residual` ([G, b, T, d], window-major only) and `next_gain` ([G, d], each group's), the layer's residual
// add and the MLP's gain-only LayerNorm run inside the step, while the row is in cache: residual += h in place,
// and the first output is layer_norm(residual) * next_gain (eps `eps`) instead of the hidden states,
// which then live only in a two-step scratch.
// Returns (out [G, T, b, d], or [G, b, T, d] when window_major; h [G, b, d]; c [G, b, d]). The
// window-major layout is the model's own ([G, b, T, d] streams): no transposed copy either side.
std::vector<at::Tensor> grouped_lstm_chunk(const at::Tensor& gates_in, const at::Tensor& packed,
                                           const at::Tensor& h0, const at::Tensor& c0,
                                           const std::optional<at::Tensor>& thin_in,
                                           const std::optional<at::Tensor>& b_hh,
                                           const std::optional<at::Tensor>& a_packed, bool window_major,
                                           const std::optional<at::Tensor>& residual,
                                           const std::optional<at::Tensor>& next_gain, double eps) {
  TORCH_CHECK(gates_in.dim() == 4 && packed.dim() == 5 && h0.dim() == 3 && c0.dim() == 3, "bad ranks");
  TORCH_CHECK(gates_in.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(gates_in.is_contiguous() && packed.is_contiguous(), "gates_in and packed must be contiguous");
  const int64_t groups = gates_in.size(0), steps = gates_in.size(window_major ? 2 : 1),
                rows = gates_in.size(window_major ? 1 : 2);
  const int64_t width = packed.size(2), blocks = (width + kLanes - 1) / kLanes;
  TORCH_CHECK(gates_in.size(3) == kGates * width && packed.size(0) > 0 && groups % packed.size(0) == 0 &&
                  packed.size(1) == blocks && packed.size(3) == kGates && packed.size(4) == kLanes &&
                  h0.size(0) == groups && h0.size(1) == rows && h0.size(2) == width,
              "shape mismatch");
  const bool low_rank = thin_in.has_value();
  TORCH_CHECK(low_rank == b_hh.has_value() && low_rank == a_packed.has_value(), "thin_in, b_hh, a_packed go together");
  int64_t rank = 0;
  if (low_rank) {
    rank = thin_in->size(3);
    TORCH_CHECK(thin_in->is_contiguous() && b_hh->is_contiguous() && a_packed->is_contiguous() &&
                    thin_in->scalar_type() == at::kFloat && b_hh->scalar_type() == at::kFloat &&
                    a_packed->scalar_type() == at::kFloat, "low-rank factors: contiguous float32");
    TORCH_CHECK(thin_in->dim() == 4 && thin_in->size(0) == groups &&
                    thin_in->size(window_major ? 2 : 1) == steps && thin_in->size(window_major ? 1 : 2) == rows &&
                    b_hh->dim() == 3 && b_hh->size(0) == groups &&
                    b_hh->size(1) == width && b_hh->size(2) == rank && a_packed->dim() == 5 &&
                    a_packed->size(0) == groups && a_packed->size(1) == blocks && a_packed->size(2) == 2 * rank &&
                    a_packed->size(3) == kGates && a_packed->size(4) == kLanes,
                "low-rank shape mismatch");
  }
  const bool fused = residual.has_value();
  TORCH_CHECK(fused == next_gain.has_value(), "residual and next_gain go together");
  if (fused) {
    TORCH_CHECK(window_major, "the fused residual and norm are window-major only");
    TORCH_CHECK(residual->scalar_type() == at::kFloat && next_gain->scalar_type() == at::kFloat &&
                    residual->is_contiguous() && next_gain->is_contiguous(), "residual, next_gain: contiguous float32");
    TORCH_CHECK(residual->dim() == 4 && residual->size(0) == groups && residual->size(1) == rows &&
                    residual->size(2) == steps && residual->size(3) == width && next_gain->dim() == 2 &&
                    next_gain->size(0) == groups && next_gain->size(1) == width, "residual / next_gain shape mismatch");
  }
  auto out = window_major ? at::empty({groups, rows, steps, width}, gates_in.options())
                          : at::empty({groups, steps, rows, width}, gates_in.options());
  const Strides gi = window_major ? Strides{kGates * width, steps * kGates * width} : Strides{rows * kGates * width, kGates * width};
  const Strides hs = window_major ? Strides{width, steps * width} : Strides{rows * width, width};
  const Strides ts = window_major ? Strides{rank, steps * rank} : Strides{rows * rank, rank};
  auto c = c0.contiguous().clone();
  auto h_first = h0.contiguous();
  auto h_last = fused ? at::empty_like(h_first) : at::Tensor();
  const float* in = gates_in.data_ptr<float>();
  const float* weights = packed.data_ptr<float>();
  const float* h_start = h_first.data_ptr<float>();
  float* h_all = out.data_ptr<float>();
  float* c_all = c.data_ptr<float>();
  const int64_t state = rows * width, group_weights = packed[0].numel(), sharing = groups / packed.size(0);
  // Groups that share a weight set run as one bundle of their rows, so a step's weights are read
  // once for several rows: in the window-major layout the rows of consecutive groups lie at one
  // stride. A bundle runs in tiles of at most kTileRows rows, each tile through all the steps before
  // the next (more rows per tile read the weights fewer times but walk more rows' streams at once,
  // which measured slower at d = 32 and no faster at 181 with 1,024 rows), and in more tiles when
  // there are fewer bundles than threads.
  // Groups of one row each with their own weights (a batch of one window per perturbed copy) run in
  // pairs instead (own_pair_block).
  const bool pairs = window_major && sharing == 1 && rows == 1 && !low_rank;
  const int64_t bundle = pairs ? 2 : window_major ? sharing : 1, units = (groups + bundle - 1) / bundle;
  const int64_t unit_rows = bundle * rows;
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::max((unit_rows + kTileRows - 1) / kTileRows, units >= threads ? 1 : (threads + units - 1) / units);
  const int64_t split_rows = ((unit_rows + splits - 1) / splits + kMaxRows - 1) / kMaxRows * kMaxRows;
  at::parallel_for(0, units * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> thin(split_rows * 2 * rank), scratch(fused ? 2 * split_rows * width : 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t unit = task / splits, first = (task % splits) * split_rows;
      const int64_t n = std::min(std::min(unit_rows, (groups - unit * bundle) * rows), first + split_rows) - first;
      if (n <= 0) continue;
      const int64_t g0 = unit * bundle, row0 = g0 * rows + first;  // row0: the first row among all groups' rows
      const RowGroups row_groups{g0, first, rows};
      LowRank low{};
      if (low_rank) low = {b_hh->data_ptr<float>(), a_packed->data_ptr<float>(), rank, ts.row, width * rank,
                           blocks * 2 * rank * kGates * kLanes};
      const float* unit_weights = weights + (g0 / sharing) * group_weights;  // pairs: the first group's
      // Where row `first` of the unit lies in a [G, ...] tensor of `n_per_step` floats per row and step.
      const auto at_first = [&](const Strides& strides, int64_t n_per_step) {
        return g0 * steps * rows * n_per_step + first * strides.row;
      };
      const float* h_prev = h_start + row0 * width;
      int64_t hp_row = width;
      for (int64_t t = 0; t < steps; ++t) {
        const int64_t out_at = at_first(hs, width) + t * hs.step;
        float* h_next = fused ? scratch.data() + (t % 2) * n * width : h_all + out_at;
        const float* step_thin = low_rank ? thin_in->data_ptr<float>() + at_first(ts, rank) + t * ts.step : nullptr;
        group_step(unit_weights, in + at_first(gi, kGates * width) + t * gi.step, gi.row, h_prev, hp_row, h_next,
                   fused ? width : hs.row, c_all + row0 * width, n, width, low_rank ? &low : nullptr, row_groups,
                   step_thin, thin.data(), pairs ? group_weights : 0);
        if (fused)
          residual_norm(residual->data_ptr<float>() + out_at, hs.row, h_next, h_all + out_at,
                        next_gain->data_ptr<float>(), row_groups, n, width, static_cast<float>(eps));
        h_prev = h_next;
        hp_row = fused ? width : hs.row;
      }
      if (fused) std::memcpy(h_last.data_ptr<float>() + row0 * width, h_prev, n * width * sizeof(float));
    }
  });
  if (!fused) h_last = out.select(window_major ? 2 : 1, steps - 1).clone();
  return {out, h_last, c};
}

// features: [G, n, dE] (contiguous); head_t: [P, dE, 256] transposed tied heads (contiguous), P
// dividing G, group g reading head_t[g / (G / P)] (P = 1: one shared head); targets: [G, n] int64 bytes.
// With thin [G, n, r] and head_low [G, r, 256] (EGGROLL's members: each group its own rank-r part),
// row i of group g scores features[g, i]·head_t + thin[g, i]·head_low[g]. Returns the next-byte
// cross entropy of every row, [G, n]: the logits are formed `kRegRows` rows x 32 or 64 at a time in
// registers and reduced at once, never written out.
at::Tensor grouped_head_nll(const at::Tensor& features, const at::Tensor& head_t, const at::Tensor& targets,
                            const std::optional<at::Tensor>& thin, const std::optional<at::Tensor>& head_low) {
  TORCH_CHECK(features.dim() == 3 && head_t.dim() == 3 && targets.dim() == 2, "bad ranks");
  TORCH_CHECK(features.scalar_type() == at::kFloat && head_t.scalar_type() == at::kFloat &&
                  targets.scalar_type() == at::kLong, "float32 features and head, int64 targets");
  TORCH_CHECK(features.is_contiguous() && head_t.is_contiguous() && targets.is_contiguous(), "must be contiguous");
  const int64_t groups = features.size(0), rows = features.size(1), dim = features.size(2);
  TORCH_CHECK(head_t.size(1) == dim && head_t.size(2) == kVocab && head_t.size(0) > 0 && groups % head_t.size(0) == 0 &&
                  targets.size(0) == groups && targets.size(1) == rows, "shape mismatch");
  TORCH_CHECK(thin.has_value() == head_low.has_value(), "thin and head_low go together");
  const int64_t rank = thin ? thin->size(2) : 0;
  if (thin) {
    TORCH_CHECK(thin->scalar_type() == at::kFloat && head_low->scalar_type() == at::kFloat && thin->is_contiguous() &&
                    head_low->is_contiguous(), "contiguous float32 thin and head_low");
    TORCH_CHECK(thin->dim() == 3 && thin->size(0) == groups && thin->size(1) == rows && head_low->dim() == 3 &&
                    head_low->size(0) == groups && head_low->size(1) == rank && head_low->size(2) == kVocab,
                "low-rank head shape mismatch");
  }
  auto nll = at::empty({groups, rows}, features.options());
  const float* f = features.data_ptr<float>();
  const float* head = head_t.data_ptr<float>();
  const float* low_w = thin ? head_low->data_ptr<float>() : nullptr;
  const float* low_x = thin ? thin->data_ptr<float>() : nullptr;
  const int64_t* t = targets.data_ptr<int64_t>();
  float* out = nll.data_ptr<float>();
  const int64_t per_group = (rows + kRegRows - 1) / kRegRows, sharing = groups / head_t.size(0);
  at::parallel_for(0, groups * per_group, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / per_group, r0 = (item % per_group) * kRegRows, n = std::min(kRegRows, rows - r0);
      const float* h = head + (g / sharing) * dim * kVocab;
      const float* fr = f + (g * rows + r0) * dim;
      const HeadLow low{rank ? low_w + g * rank * kVocab : nullptr, rank ? low_x + (g * rows + r0) * rank : nullptr,
                        rank};
      const int64_t* tr = t + g * rows + r0;
      float* o = out + g * rows + r0;
      switch (n) {
#if defined(__AVX512F__)
        case 4: nll_rows<4>(h, fr, low, tr, o, dim); break;
        case 3: nll_rows<3>(h, fr, low, tr, o, dim); break;
#endif
        case 2: nll_rows<2>(h, fr, low, tr, o, dim); break;
        default: nll_rows<1>(h, fr, low, tr, o, dim); break;
      }
    }
  });
  return nll;
}

// erf(x) as x·P(x²)/Q(x²) on [-4, 4] (clamped beyond), the rational approximation of XLA's and
// Eigen's float erf: within about 5e-7 of erf, so the GELU below is within 1.1e-6 of the exact one
// (relative beyond |GELU| = 1; worst where 1 + erf cancels, x near -5.6: tests/models/test_recurrence.py).
// Branch-free on whole registers; a NaN fails both clamps and stays NaN, and GELU(-inf) is NaN as torch's.
constexpr int kErfP = 7, kErfQ = 5;
constexpr float kErfAlpha[kErfP] = {-2.72614225801306e-10f, 2.77068142495902e-08f, -2.10102402082508e-06f,
                                    -5.69250639462346e-05f, -7.34990630326855e-04f, -2.95459980854025e-03f,
                                    -1.60960333262415e-02f};
constexpr float kErfBeta[kErfQ] = {-1.45660718464996e-05f, -2.13374055278905e-04f, -1.68282697438203e-03f,
                                   -7.37332916720468e-03f, -1.42647390514189e-02f};

template <typename T>
inline T erf_(T x) {
  const T zero = {}, low = zero - 4.0f, high = zero + 4.0f;  // ±4 in x's type (a float, or every lane of a vec)
  x = x < low ? low : x;
  x = x > high ? high : x;
  const T x2 = x * x;
  T p = x2 * kErfAlpha[0] + kErfAlpha[1], q = x2 * kErfBeta[0] + kErfBeta[1];
  for (int i = 2; i < kErfP; ++i) p = p * x2 + kErfAlpha[i];
  for (int i = 2; i < kErfQ; ++i) q = q * x2 + kErfBeta[i];
  return x * p / q;
}

template <typename T>
inline T gelu_(T x) { return 0.5f * x * (1.0f + erf_(x * 0.70710678118654752f)); }

inline float dot(const float* a, const float* b, int64_t n) {
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t k = 0; k < n; ++k) total += a[k] * b[k];
  return total;
}

// The MLP's GELU (the exact one, 0.5·x·(1 + erf(x/√2))) over its hidden rows in place, with
// EGGROLL's rank-r terms on either side of it while a row is in cache: before it, each member's
// (x·B_in)·A_inᵀ from the row's normalised input x; after it, the row's thin product with B_out
// for the second matrix (returned; grouped_residual_norm adds its ·A_outᵀ with the product's output).
// hidden [K, n, h]; normed [K, n, d], a_in [K, r, h], b_in [K, r, d], b_out [K, r, h] (K groups,
// each one member); without them, the GELU alone. Returns thin_out [K, n, r] (r = 0: empty).
at::Tensor grouped_gelu(at::Tensor& hidden, const std::optional<at::Tensor>& normed,
                        const std::optional<at::Tensor>& a_in, const std::optional<at::Tensor>& b_in,
                        const std::optional<at::Tensor>& b_out) {
  TORCH_CHECK(hidden.dim() == 3 && hidden.device().is_cpu() && hidden.scalar_type() == at::kFloat &&
                  hidden.is_contiguous(), "hidden: contiguous CPU float32 [K, n, h]");
  const int64_t groups = hidden.size(0), rows = hidden.size(1), width = hidden.size(2);
  const bool in_terms = a_in.has_value(), out_terms = b_out.has_value();
  TORCH_CHECK(in_terms == b_in.has_value() && in_terms == normed.has_value(), "normed, a_in and b_in go together");
  const int64_t rank_in = in_terms ? a_in->size(1) : 0, rank_out = out_terms ? b_out->size(1) : 0;
  const int64_t dim = in_terms ? normed->size(2) : 0;
  auto check = [&](const at::Tensor& t, std::vector<int64_t> shape, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                    t.sizes() == at::IntArrayRef(shape), name, ": contiguous CPU float32 of the shape documented");
  };
  if (in_terms) {
    check(*normed, {groups, rows, dim}, "normed");
    check(*a_in, {groups, rank_in, width}, "a_in");
    check(*b_in, {groups, rank_in, dim}, "b_in");
  }
  if (out_terms) check(*b_out, {groups, rank_out, width}, "b_out");
  auto thin = at::empty({groups, rows, rank_out}, hidden.options());
  float* hid = hidden.data_ptr<float>();
  float* thin_out = thin.data_ptr<float>();
  const float* x_in = in_terms ? normed->data_ptr<float>() : nullptr;
  const float* a1 = in_terms ? a_in->data_ptr<float>() : nullptr;
  const float* b1 = in_terms ? b_in->data_ptr<float>() : nullptr;
  const float* b2 = out_terms ? b_out->data_ptr<float>() : nullptr;
  at::parallel_for(0, groups * rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> t(rank_in);
    std::vector<vec> sums(rank_out);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / rows;
      float* row = hid + item * width;
      const float* a = a1 + g * rank_in * width;
      const float* b = b2 + g * rank_out * width;
      for (int64_t j = 0; j < rank_in; ++j) t[j] = dot(x_in + item * dim, b1 + (g * rank_in + j) * dim, dim);
      std::fill(sums.begin(), sums.end(), vec{});
      // one pass over the row in whole registers (gcc's own loops took 4 lanes); padding lanes load
      // as zeros and add nothing to the sums
      for (int64_t k = 0; k < width; k += kVec) {
        const int64_t lanes = std::min(kVec, width - k);
        vec h = load(row + k, lanes);
        for (int64_t j = 0; j < rank_in; ++j) h += t[j] * load(a + j * width + k, lanes);
        h = gelu_(h);
        store(row + k, h, lanes);
        for (int64_t j = 0; j < rank_out; ++j) sums[j] += h * load(b + j * width + k, lanes);
      }
      for (int64_t j = 0; j < rank_out; ++j) thin_out[item * rank_out + j] = sum_lanes(sums[j]);
    }
  });
  return thin;
}

// Each row's thin products with its group's rank-r factor: thin[g, i, j] = x[g, i]·b[g, j], for
// x [K, n, d] and b [K, r, d] (EGGROLL's (x·B) before its ·Aᵀ). A batched matrix-vector product
// reads x at a fraction of the memory's speed at these shapes; this reads it once, row by row.
at::Tensor grouped_thin(const at::Tensor& x, const at::Tensor& b) {
  TORCH_CHECK(x.dim() == 3 && b.dim() == 3 && x.device().is_cpu() && b.device().is_cpu() &&
                  x.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && x.is_contiguous() && b.is_contiguous(),
              "contiguous CPU float32 x [K, n, d] and b [K, r, d]");
  const int64_t groups = x.size(0), rows = x.size(1), dim = x.size(2), rank = b.size(1);
  TORCH_CHECK(b.size(0) == groups && b.size(2) == dim, "shape mismatch");
  auto thin = at::empty({groups, rows, rank}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* bs = b.data_ptr<float>();
  float* out = thin.data_ptr<float>();
  at::parallel_for(0, groups * rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const float* row = xs + item * dim;
      for (int64_t j = 0; j < rank; ++j) out[item * rank + j] = dot(row, bs + ((item / rows) * rank + j) * dim, dim);
    }
  });
  return thin;
}

// A residual add and the gain-only LayerNorm after it, one pass over each row (the MLP's add and the
// next block's or the final norm; the LSTM's own are inside its step): x [K, n, d] += delta in place
// (none without it), plus each member's rank-r term thin·a_low (EGGROLL's, of the MLP's second
// matrix: thin [K, n, r] from grouped_gelu, a_low [K, r, d]; none without them), and returns
// LayerNorm(x) * gains[k] for the rows of group k, gains [K, d].
at::Tensor grouped_residual_norm(at::Tensor& x, const at::Tensor& gains, const std::optional<at::Tensor>& delta,
                                 const std::optional<at::Tensor>& thin, const std::optional<at::Tensor>& a_low,
                                 double eps) {
  auto cpu_float = [](const at::Tensor& t) {
    return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
  };
  TORCH_CHECK(x.dim() == 3 && cpu_float(x) && cpu_float(gains), "contiguous CPU float32 x [K, n, d] and gains [K, d]");
  const int64_t groups = x.size(0), rows = x.size(1), width = x.size(2);
  TORCH_CHECK(gains.sizes() == at::IntArrayRef({groups, width}), "gains: [K, d]");
  TORCH_CHECK(!delta.has_value() || (cpu_float(*delta) && delta->sizes() == x.sizes()), "delta: x's shape, contiguous");
  TORCH_CHECK(thin.has_value() == a_low.has_value(), "thin and a_low go together");
  TORCH_CHECK(!thin.has_value() || thin->dim() == 3, "thin [K, n, r]");
  const int64_t rank = thin.has_value() ? thin->size(2) : 0;
  if (rank) {
    TORCH_CHECK(cpu_float(*thin) && cpu_float(*a_low) && thin->sizes() == at::IntArrayRef({groups, rows, rank}) &&
                    a_low->sizes() == at::IntArrayRef({groups, rank, width}), "thin [K, n, r] and a_low [K, r, d]");
  }
  auto normed = at::empty_like(x);
  float* xs = x.data_ptr<float>();
  float* out = normed.data_ptr<float>();
  const float* hs = delta.has_value() ? delta->data_ptr<float>() : nullptr;
  const float* gs = gains.data_ptr<float>();
  const float* ts = rank ? thin->data_ptr<float>() : nullptr;
  const float* as = rank ? a_low->data_ptr<float>() : nullptr;
  at::parallel_for(0, groups * rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      float* xr = xs + item * width;
      const float* a = as + (item / rows) * rank * width;
      for (int64_t j = 0; j < rank; ++j) {  // the member's rank-r term, into the row while it is in cache
        const float coefficient = ts[item * rank + j];
        for (int64_t k = 0; k < width; k += kVec) {
          const int64_t lanes = std::min(kVec, width - k);
          store(xr + k, load(xr + k, lanes) + coefficient * load(a + j * width + k, lanes), lanes);
        }
      }
      residual_norm(xr, width, hs ? hs + item * width : nullptr, out + item * width, gs, RowGroups{0, item, rows}, 1,
                    width, static_cast<float>(eps));
    }
  });
  return normed;
}

// GFLOP/s of one thread running `iterations` x 12 independent 16-lane multiply-adds (12 chains
// cover the latency of two FMA pipes): the core's arithmetic peak, with no memory traffic.
double fma_gflops(int64_t iterations) {
  vec b = {}, c = {};
  for (int64_t l = 0; l < kVec; ++l) {
    b[l] = 0.999f;
    c[l] = 0.001f;
  }
  vec a0 = c, a1 = c + 1, a2 = c + 2, a3 = c + 3, a4 = c + 4, a5 = c + 5;
  vec a6 = c + 6, a7 = c + 7, a8 = c + 8, a9 = c + 9, a10 = c + 10, a11 = c + 11;
  const auto started = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iterations; ++i) {
    a0 = a0 * b + c; a1 = a1 * b + c; a2 = a2 * b + c; a3 = a3 * b + c; a4 = a4 * b + c; a5 = a5 * b + c;
    a6 = a6 * b + c; a7 = a7 * b + c; a8 = a8 * b + c; a9 = a9 * b + c; a10 = a10 * b + c; a11 = a11 * b + c;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const vec total = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
  TORCH_CHECK(total[0] == total[0], "fma_gflops: non-finite sum");  // keeps the chains live
  return iterations * 12.0 * kVec * 2.0 / seconds / 1e9;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grouped_lstm_chunk", &grouped_lstm_chunk, "Grouped bias-free LSTM chunk (CPU, no autograd)",
        pybind11::arg("gates_in"), pybind11::arg("packed"), pybind11::arg("h0"), pybind11::arg("c0"),
        pybind11::arg("thin_in") = pybind11::none(), pybind11::arg("b_hh") = pybind11::none(),
        pybind11::arg("a_packed") = pybind11::none(), pybind11::arg("window_major") = false,
        pybind11::arg("residual") = pybind11::none(), pybind11::arg("next_gain") = pybind11::none(),
        pybind11::arg("eps") = 1e-5);
  m.def("grouped_gelu", &grouped_gelu, "The MLP's GELU in place with EGGROLL's rank-r terms (CPU, no autograd)",
        pybind11::arg("hidden"), pybind11::arg("normed") = pybind11::none(), pybind11::arg("a_in") = pybind11::none(),
        pybind11::arg("b_in") = pybind11::none(), pybind11::arg("b_out") = pybind11::none());
  m.def("grouped_thin", &grouped_thin, "Each row's products with its group's rank-r factor (CPU, no autograd)",
        pybind11::arg("x"), pybind11::arg("b"));
  m.def("grouped_residual_norm", &grouped_residual_norm, "Residual add and gain-only LayerNorm (CPU, no autograd)",
        pybind11::arg("x"), pybind11::arg("gains"), pybind11::arg("delta") = pybind11::none(),
        pybind11::arg("thin") = pybind11::none(), pybind11::arg("a_low") = pybind11::none(), pybind11::arg("eps") = 1e-5);
  m.def("fma_gflops", &fma_gflops, "One thread's multiply-add throughput, GFLOP/s");
  m.def("grouped_head_nll", &grouped_head_nll, "Tied-head next-byte cross entropy per row (CPU, no autograd)",
        pybind11::arg("features"), pybind11::arg("head_t"), pybind11::arg("targets"),
        pybind11::arg("thin") = pybind11::none(), pybind11::arg("head_low") = pybind11::none());
}
