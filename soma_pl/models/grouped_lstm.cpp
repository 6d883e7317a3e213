// Grouped bias-free LSTM layer over a chunk of time steps, on the CPU, for zero-order evaluation.
//
// G groups (experts x perturbed copies) each carry their own recurrent weights and a few rows
// (windows). Each group runs all of the chunk's steps in turn, so its recurrent weights stay in the
// core's cache across them, and groups are shared among threads without any per-step barrier.
// A step is one register-blocked micro-kernel per block of 16 hidden units and up to 4 rows: the
// four gates' pre-activations for those units accumulate in 16 vector registers (input
// projection + h_prev @ W_hh^T), then the gate activations, the cell and the hidden state are
// computed from them before anything is written back. No gate buffer and no library call per step:
// with a few rows per weight set a general GEMM call spends more on its set-up than on the product.
//
// The recurrent weights come packed by the caller (soma_pl.models.recurrence.pack_recurrent):
// [G, nb, d, 4, 16], for each block of 16 hidden units and each input k the 16 weights of each
// gate, zero beyond d, so a step reads them contiguously. Gate order (input, forget, output, cell),
// as in soma_pl.models.stacked. No autograd: used only when gradients are off.
//
// Also here: the tied head's next-byte cross entropy (grouped_head_nll), its logits formed in
// registers and reduced at once, and the core's multiply-add throughput (fma_gflops), the limit
// every ratio of the benchmarks can be read against.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__)
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

constexpr int64_t kLanes = 16;
constexpr int64_t kGates = 4;
constexpr int64_t kMaxRows = 4;

// Sixteen floats; the compiler maps it to one 512-bit register or two / four narrower ones.
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

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
inline vec load(const float* from, int64_t lanes) {
  if (lanes == kLanes) return *reinterpret_cast<const vec_unaligned*>(from);
#if defined(__AVX512F__)
  return (vec)_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << lanes) - 1), from);
#else
  vec v = {};
  for (int64_t l = 0; l < lanes; ++l) v[l] = from[l];
  return v;
#endif
}

inline void store(float* to, vec from, int64_t lanes) {
  if (lanes == kLanes) {
    *reinterpret_cast<vec_unaligned*>(to) = from;
    return;
  }
#if defined(__AVX512F__)
  _mm512_mask_storeu_ps(to, static_cast<__mmask16>((1u << lanes) - 1), (__m512)from);
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
// forget, output, cell): sigmoid(x) = 1 / (1 + exp(-x)), tanh(x) = 2 / (1 + exp(-2x)) - 1.
template <int Rows>
inline void cell_update(vec (*gates)[kGates], vec* cell, vec* hidden) {
  __m512 a[Rows * kGates], t[Rows];
  const __m512 minus_one = _mm512_set1_ps(-1.0f), minus_two = _mm512_set1_ps(-2.0f), two = _mm512_set1_ps(2.0f),
               one = _mm512_set1_ps(1.0f);
  for (int r = 0; r < Rows; ++r)
    for (int q = 0; q < kGates; ++q) a[r * kGates + q] = _mm512_mul_ps((__m512)gates[r][q], q == 3 ? minus_two : minus_one);
  inverse_one_plus_exp<Rows * kGates>(a);
  for (int r = 0; r < Rows; ++r) {
    const __m512 candidate = _mm512_fmsub_ps(two, a[r * kGates + 3], one);
    const __m512 next = _mm512_fmadd_ps(a[r * kGates + 1], (__m512)cell[r], _mm512_mul_ps(a[r * kGates], candidate));
    cell[r] = (vec)next;
    t[r] = _mm512_mul_ps(next, minus_two);
  }
  inverse_one_plus_exp<Rows>(t);
  for (int r = 0; r < Rows; ++r) hidden[r] = (vec)_mm512_mul_ps(a[r * kGates + 2], _mm512_fmsub_ps(two, t[r], one));
}
#else
template <int Rows>
inline void cell_update(vec (*gates)[kGates], vec* cell, vec* hidden) {
  for (int r = 0; r < Rows; ++r) {
    alignas(64) float g[kGates][kLanes];
    alignas(64) float c[kLanes];
    alignas(64) float h[kLanes];
    std::memcpy(g, gates[r], sizeof(g));
    std::memcpy(c, &cell[r], sizeof(c));
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) {
      const float next = sigmoid(g[1][l]) * c[l] + sigmoid(g[0][l]) * tanh_(g[3][l]);
      c[l] = next;
      h[l] = sigmoid(g[2][l]) * tanh_(next);
    }
    std::memcpy(&cell[r], c, sizeof(c));
    std::memcpy(&hidden[r], h, sizeof(h));
  }
}
#endif

// Pins four vectors to registers: without it the compiler folds each load into every multiply-add
// that reads it (a memory operand per row), and the loads, not the multiply-adds, set the pace.
inline void keep_in_registers(vec& a, vec& b, vec& c, vec& d) {
#if defined(__AVX512F__)
  asm("" : "+v"(a), "+v"(b), "+v"(c), "+v"(d));
#else
  (void)a, (void)b, (void)c, (void)d;
#endif
}

// acc[r][q] += h[r][k] * w[k][q] for k in [k0, k1): `Rows` rows of h at stride `h_stride`, four
// vectors of w at w + k * w_stride. The sums are copied into locals for the loop, so the compiler
// keeps all of them in registers (2-4% faster per step than updating them through the pointer).
template <int Rows>
inline void accumulate(vec (*sums)[kGates], const float* w, const float* h, int64_t h_stride, int64_t k0, int64_t k1,
                       int64_t w_stride = kGates * kLanes) {
  vec acc[Rows][kGates];
  for (int r = 0; r < Rows; ++r)
    for (int q = 0; q < kGates; ++q) acc[r][q] = sums[r][q];
  for (int64_t k = k0; k < k1; ++k) {
    const vec_unaligned* wk = reinterpret_cast<const vec_unaligned*>(w + k * w_stride);
    vec w0 = wk[0], w1 = wk[1], w2 = wk[2], w3 = wk[3];
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
//   extra_w, extra_h, extra_k: a further product of extra_k inputs (EGGROLL's rank-r terms), the
//   packed [extra_k][4][16] weights of this unit block and row r's inputs at extra_h + r * extra_k.
template <int Rows>
void unit_block(const float* w, const float* gates_in, int64_t gi_row, const float* h_prev, int64_t hp_row,
                float* h_next, int64_t hn_row, float* c, int64_t width, int64_t j0, int64_t lanes,
                const float* extra_w, const float* extra_h, int64_t extra_k) {
  vec acc[Rows][kGates];
  for (int r = 0; r < Rows; ++r)
    for (int q = 0; q < kGates; ++q) acc[r][q] = load(gates_in + r * gi_row + q * width + j0, lanes);
  if (extra_k) accumulate<Rows>(acc, extra_w, extra_h, extra_k, 0, extra_k);
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

// EGGROLL's rank-r terms of one group, when given: thin_in [T, b, r] (x_t · B_ih), b_hh [d, r] and
// the packed joint factor [nb, 2r, 4, 16] of [A_ih, A_hh]; the gates gain [x_t · B_ih, h · B_hh] · [A_ih, A_hh]^T.
struct LowRank {
  const float* thin_in;
  const float* b_hh;
  const float* a_packed;
  int64_t rank;
};

// One step of `rows` rows of one group, all hidden units; rows at strides gi_row (gates_in), hp_row
// (h_prev), hn_row (h_next). thin: scratch of rows x 2r floats.
void group_step(const float* packed, const float* gates_in, int64_t gi_row, const float* h_prev, int64_t hp_row,
                float* h_next, int64_t hn_row, float* c, int64_t rows, int64_t width, const LowRank* low,
                const float* thin_in, float* thin) {
  const int64_t blocks = (width + kLanes - 1) / kLanes, extra_k = low ? 2 * low->rank : 0;
  if (low) {
    for (int64_t r = 0; r < rows; ++r) {
      float* row = thin + r * extra_k;
      std::memcpy(row, thin_in + r * low->rank, low->rank * sizeof(float));
      for (int64_t j = 0; j < low->rank; ++j) {
        float sum = 0.0f;
        for (int64_t k = 0; k < width; ++k) sum += h_prev[r * hp_row + k] * low->b_hh[k * low->rank + j];
        row[low->rank + j] = sum;
      }
    }
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const float* w = packed + b * width * kGates * kLanes;
    const float* extra_w = low ? low->a_packed + b * extra_k * kGates * kLanes : nullptr;
    const int64_t j0 = b * kLanes, lanes = std::min(kLanes, width - j0);
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
      const int64_t n = std::min(kMaxRows, rows - r0);
      const float* gi = gates_in + r0 * gi_row;
      const float* hp = h_prev + r0 * hp_row;
      float* hn = h_next + r0 * hn_row;
      float* cr = c + r0 * width;
      const float* eh = thin + r0 * extra_k;
      switch (n) {
        case 4: unit_block<4>(w, gi, gi_row, hp, hp_row, hn, hn_row, cr, width, j0, lanes, extra_w, eh, extra_k); break;
        case 3: unit_block<3>(w, gi, gi_row, hp, hp_row, hn, hn_row, cr, width, j0, lanes, extra_w, eh, extra_k); break;
        case 2: unit_block<2>(w, gi, gi_row, hp, hp_row, hn, hn_row, cr, width, j0, lanes, extra_w, eh, extra_k); break;
        default: unit_block<1>(w, gi, gi_row, hp, hp_row, hn, hn_row, cr, width, j0, lanes, extra_w, eh, extra_k); break;
      }
    }
  }
}

constexpr int64_t kVocab = 256;
constexpr int64_t kVocabPart = kGates * kLanes;  // 64 logits per pass: 4 vectors per row

// Logits of `Rows` rows for one quarter of the vocabulary: logits[r][part * 64 + j].
template <int Rows>
void logit_part(const float* head_t, const float* features, int64_t dim, int64_t part, float (*logits)[kVocab]) {
  vec acc[Rows][kGates] = {};
  accumulate<Rows>(acc, head_t + part * kVocabPart, features, dim, 0, dim, kVocab);
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
void nll_rows(const float* head_t, const float* features, const int64_t* targets, float* nll, int64_t dim) {
  alignas(64) float logits[Rows][kVocab];
  for (int64_t part = 0; part < kVocab / kVocabPart; ++part) logit_part<Rows>(head_t, features, dim, part, logits);
  for (int r = 0; r < Rows; ++r) nll[r] = row_nll(logits[r], targets[r]);
}

}  // namespace

// gates_in: [G, T, b, 4d] input projections (contiguous), or [G, b, T, 4d] when window_major;
// packed: [P, nb, d, 4, 16] recurrent weights (nb = ceil(d / 16)), P dividing G, group g running
// packed[g / (G / P)] (P = G: a weight set per group; P = E: EGGROLL's members share their
// expert's); h0, c0: [G, b, d]. With EGGROLL's rank-r terms (time-major only): thin_in [G, T, b, r],
// b_hh [G, d, r], a_packed [G, nb, 2r, 4, 16].
// Returns (out [G, T, b, d], or [G, b, T, d] when window_major; h [G, b, d]; c [G, b, d]). The
// window-major layout is the model's own ([G, b, T, d] streams): no transposed copy either side.
std::vector<at::Tensor> grouped_lstm_chunk(const at::Tensor& gates_in, const at::Tensor& packed,
                                           const at::Tensor& h0, const at::Tensor& c0,
                                           const std::optional<at::Tensor>& thin_in,
                                           const std::optional<at::Tensor>& b_hh,
                                           const std::optional<at::Tensor>& a_packed, bool window_major) {
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
  TORCH_CHECK(!(low_rank && window_major), "the low-rank terms are time-major only");
  int64_t rank = 0;
  if (low_rank) {
    rank = thin_in->size(3);
    TORCH_CHECK(thin_in->is_contiguous() && b_hh->is_contiguous() && a_packed->is_contiguous() &&
                    thin_in->scalar_type() == at::kFloat && b_hh->scalar_type() == at::kFloat &&
                    a_packed->scalar_type() == at::kFloat, "low-rank factors: contiguous float32");
    TORCH_CHECK(thin_in->dim() == 4 && thin_in->size(0) == groups && thin_in->size(1) == steps &&
                    thin_in->size(2) == rows && b_hh->dim() == 3 && b_hh->size(0) == groups &&
                    b_hh->size(1) == width && b_hh->size(2) == rank && a_packed->dim() == 5 &&
                    a_packed->size(0) == groups && a_packed->size(1) == blocks && a_packed->size(2) == 2 * rank &&
                    a_packed->size(3) == kGates && a_packed->size(4) == kLanes,
                "low-rank shape mismatch");
  }
  auto out = window_major ? at::empty({groups, rows, steps, width}, gates_in.options())
                          : at::empty({groups, steps, rows, width}, gates_in.options());
  const Strides gi = window_major ? Strides{kGates * width, steps * kGates * width} : Strides{rows * kGates * width, kGates * width};
  const Strides hs = window_major ? Strides{width, steps * width} : Strides{rows * width, width};
  auto c = c0.contiguous().clone();
  auto h_first = h0.contiguous();
  const float* in = gates_in.data_ptr<float>();
  const float* weights = packed.data_ptr<float>();
  const float* h_start = h_first.data_ptr<float>();
  float* h_all = out.data_ptr<float>();
  float* c_all = c.data_ptr<float>();
  const int64_t state = rows * width, group_weights = packed[0].numel(), sharing = groups / packed.size(0);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> thin(rows * 2 * rank);
    for (int64_t g = begin; g < end; ++g) {
      LowRank low{};
      if (low_rank) {
        low = {nullptr, b_hh->data_ptr<float>() + g * width * rank,
               a_packed->data_ptr<float>() + g * blocks * 2 * rank * kGates * kLanes, rank};
      }
      const float* h_prev = h_start + g * state;
      int64_t hp_row = width;
      for (int64_t t = 0; t < steps; ++t) {
        float* h_next = h_all + g * steps * state + t * hs.step;
        const float* step_thin = low_rank ? thin_in->data_ptr<float>() + (g * steps + t) * rows * rank : nullptr;
        group_step(weights + (g / sharing) * group_weights, in + g * steps * kGates * state + t * gi.step, gi.row,
                   h_prev, hp_row, h_next, hs.row, c_all + g * state, rows, width, low_rank ? &low : nullptr,
                   step_thin, thin.data());
        h_prev = h_next;
        hp_row = hs.row;
      }
    }
  });
  auto h_last = out.select(window_major ? 2 : 1, steps - 1).clone();
  return {out, h_last, c};
}

// features: [G, n, dE] (contiguous); head_t: [P, dE, 256] transposed tied heads (contiguous), P
// dividing G, group g reading head_t[g / (G / P)] (P = 1: one shared head); targets: [G, n] int64 bytes. Returns the
// next-byte cross entropy of every row, [G, n]: the logits are formed 4 rows x 64 at a time in
// registers and reduced at once, never written out.
at::Tensor grouped_head_nll(const at::Tensor& features, const at::Tensor& head_t, const at::Tensor& targets) {
  TORCH_CHECK(features.dim() == 3 && head_t.dim() == 3 && targets.dim() == 2, "bad ranks");
  TORCH_CHECK(features.scalar_type() == at::kFloat && head_t.scalar_type() == at::kFloat &&
                  targets.scalar_type() == at::kLong, "float32 features and head, int64 targets");
  TORCH_CHECK(features.is_contiguous() && head_t.is_contiguous() && targets.is_contiguous(), "must be contiguous");
  const int64_t groups = features.size(0), rows = features.size(1), dim = features.size(2);
  TORCH_CHECK(head_t.size(1) == dim && head_t.size(2) == kVocab && head_t.size(0) > 0 && groups % head_t.size(0) == 0 &&
                  targets.size(0) == groups && targets.size(1) == rows, "shape mismatch");
  auto nll = at::empty({groups, rows}, features.options());
  const float* f = features.data_ptr<float>();
  const float* head = head_t.data_ptr<float>();
  const int64_t* t = targets.data_ptr<int64_t>();
  float* out = nll.data_ptr<float>();
  const int64_t per_group = (rows + kMaxRows - 1) / kMaxRows, sharing = groups / head_t.size(0);
  at::parallel_for(0, groups * per_group, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / per_group, r0 = (item % per_group) * kMaxRows, n = std::min(kMaxRows, rows - r0);
      const float* h = head + (g / sharing) * dim * kVocab;
      const float* fr = f + (g * rows + r0) * dim;
      const int64_t* tr = t + g * rows + r0;
      float* o = out + g * rows + r0;
      switch (n) {
        case 4: nll_rows<4>(h, fr, tr, o, dim); break;
        case 3: nll_rows<3>(h, fr, tr, o, dim); break;
        case 2: nll_rows<2>(h, fr, tr, o, dim); break;
        default: nll_rows<1>(h, fr, tr, o, dim); break;
      }
    }
  });
  return nll;
}

// GFLOP/s of one thread running `iterations` x 12 independent 16-lane multiply-adds (12 chains
// cover the latency of two FMA pipes): the core's arithmetic peak, with no memory traffic.
double fma_gflops(int64_t iterations) {
  vec b = {}, c = {};
  for (int64_t l = 0; l < kLanes; ++l) {
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
  return iterations * 12.0 * kLanes * 2.0 / seconds / 1e9;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grouped_lstm_chunk", &grouped_lstm_chunk, "Grouped bias-free LSTM chunk (CPU, no autograd)",
        pybind11::arg("gates_in"), pybind11::arg("packed"), pybind11::arg("h0"), pybind11::arg("c0"),
        pybind11::arg("thin_in") = pybind11::none(), pybind11::arg("b_hh") = pybind11::none(),
        pybind11::arg("a_packed") = pybind11::none(), pybind11::arg("window_major") = false);
  m.def("fma_gflops", &fma_gflops, "One thread's multiply-add throughput, GFLOP/s");
  m.def("grouped_head_nll", &grouped_head_nll, "Tied-head next-byte cross entropy per row (CPU, no autograd)");
}
