// Grouped bias-free LSTM layer over a chunk of time steps, on the CPU, for zero-order evaluation.
//
// G groups (experts x perturbed copies) each carry their own recurrent weights. The time loop runs
// here instead of in Python: per step one batched GEMM (ATen's baddbmm, so MKL / oneDNN) adds the
// recurrent term to the precomputed input projections, then one fused pass computes the four gate
// activations, the cell and the hidden state in place. Groups are taken in blocks whose recurrent
// weights fit in the core's cache, so each block's weights stay resident across the chunk's steps.
//
// Gate rows are ordered (input, forget, output, cell), as in soma_pl.models.stacked. No autograd:
// the Python caller uses this only when gradients are off (zero-order losses, evaluation).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// exp(x) by Cody-Waite range reduction and a degree-6 minimax polynomial (the Cephes expf
// coefficients): within 2 ulp of expf on [-87.3, 88.3], inputs clamped to that range. Branch-free
// arithmetic and a bit cast, so the compiler vectorizes the loops that call it. A NaN input fails
// both clamps and stays NaN through the polynomial.
inline float fast_exp(float x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.3f ? 88.3f : x;
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const uint32_t bits = (static_cast<uint32_t>(static_cast<int32_t>(k)) + 127u) << 23;
  return p * __builtin_bit_cast(float, bits);
}

inline float sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }

inline float tanh_(float x) { return 2.0f / (1.0f + fast_exp(-2.0f * x)) - 1.0f; }

// One step's gate activations, cell and hidden state for `groups` x `batch` rows of width `width`.
// gates: [groups * batch, 4 * width] pre-activations; c: [groups * batch, width], updated in place;
// h: the step's slice of the output, row (g, i) at h + g * group_stride + i * width.
void cell_rows(const float* gates, float* c, float* h, int64_t groups, int64_t batch, int64_t width,
               int64_t group_stride) {
  at::parallel_for(0, groups * batch, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* gi = gates + row * 4 * width;
      const float* gf = gi + width;
      const float* go = gi + 2 * width;
      const float* gg = gi + 3 * width;
      float* cr = c + row * width;
      float* hr = h + (row / batch) * group_stride + (row % batch) * width;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) {
        const float cell = sigmoid(gf[j]) * cr[j] + sigmoid(gi[j]) * tanh_(gg[j]);
        cr[j] = cell;
        hr[j] = sigmoid(go[j]) * tanh_(cell);
      }
    }
  });
}

}  // namespace

// gates_in: [G, T, b, 4d] input projections (contiguous); w_hh_t: [G, d, 4d] transposed recurrent
// weights (contiguous); h0, c0: [G, b, d]; block: groups per cache block.
// Returns (out [G, T, b, d], h [G, b, d], c [G, b, d]).
std::vector<at::Tensor> grouped_lstm_chunk(const at::Tensor& gates_in, const at::Tensor& w_hh_t,
                                           const at::Tensor& h0, const at::Tensor& c0, int64_t block) {
  TORCH_CHECK(gates_in.dim() == 4 && w_hh_t.dim() == 3 && h0.dim() == 3 && c0.dim() == 3, "bad ranks");
  TORCH_CHECK(gates_in.scalar_type() == at::kFloat && w_hh_t.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(gates_in.is_contiguous() && w_hh_t.is_contiguous(), "gates_in and w_hh_t must be contiguous");
  const int64_t groups = gates_in.size(0), steps = gates_in.size(1), batch = gates_in.size(2);
  const int64_t width = w_hh_t.size(1);
  TORCH_CHECK(gates_in.size(3) == 4 * width && w_hh_t.size(2) == 4 * width && w_hh_t.size(0) == groups,
              "shape mismatch");
  auto out = at::empty({groups, steps, batch, width}, gates_in.options());
  auto c = c0.contiguous().clone();
  auto h_first = h0.contiguous();
  auto gates = at::empty({std::min(block, groups), batch, 4 * width}, gates_in.options());
  for (int64_t g0 = 0; g0 < groups; g0 += block) {
    const int64_t size = std::min(block, groups - g0);
    auto weights = w_hh_t.narrow(0, g0, size);
    auto block_in = gates_in.narrow(0, g0, size);
    auto block_out = out.narrow(0, g0, size);
    auto block_c = c.narrow(0, g0, size);
    auto step_gates = gates.narrow(0, 0, size);
    at::Tensor h = h_first.narrow(0, g0, size);
    for (int64_t t = 0; t < steps; ++t) {
      at::baddbmm_out(step_gates, block_in.select(1, t), h, weights);
      auto h_next = block_out.select(1, t);  // [size, b, d]; one group's rows are contiguous
      cell_rows(step_gates.data_ptr<float>(), block_c.data_ptr<float>(), h_next.data_ptr<float>(), size,
                batch, width, steps * batch * width);
      h = h_next;
    }
  }
  auto h_last = out.select(1, steps - 1).clone();
  return {out, h_last, c};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grouped_lstm_chunk", &grouped_lstm_chunk, "Grouped bias-free LSTM chunk (CPU, no autograd)");
}
