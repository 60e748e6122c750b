// y = x W^T + b in float32 on weights packed once into panels: the generation runner's
// Linear layers (carpool.generation.runner.FastLinear).
//
// A decode step multiplies few rows (one per running sequence) by every weight of the
// model: the step is a stream of the weights from memory, and what counts is reading them
// at the speed the memory gives. Packed, W is a row of panels of kPanel output columns;
// within a panel, the kPanel weights of each input k are contiguous, so a panel is read
// strictly in order, once for every MR rows of x:
//
//   packed [N / kPanel][K][kPanel]      panel p, input k: W[p*kPanel .. p*kPanel+kPanel-1, k]
//   acc[i] (kPanel floats, 2 vectors) += x[m+i, k] * packed[p][k]       for k = 0 .. K-1
//   y[m+i, p*kPanel ..] = acc[i] (+ b)
//
// No sum across a vector's lanes, no padding of x. With many rows (a prefill chunk) the
// same loop runs MR rows at a time while the panel stays in L2; it kept pace with
// oneDNN's prepacked kernel there, and took 0.6-0.8 of its time with 1 to 8 rows
// (docs/generation.md, "The Linear layers in a kernel of their own").
#include <algorithm>

#include "attention_common.h"

namespace carpool_linear {

#ifdef CARPOOL_VECTOR
using carpool_attention::kWidth;
using carpool_attention::load;
using carpool_attention::pfloat;
using carpool_attention::splat;
using carpool_attention::store;
constexpr int64_t kPanel = 2 * kWidth;  // 32 floats with AVX-512, else 16
// Rows of x a pass: 2 * MR accumulators, the panel's two vectors and one of x in registers.
#ifdef __AVX512F__
constexpr int kRows = 8;  // 16 + 2 + 1 of 32
#else
constexpr int kRows = 4;  // 8 + 2 + 1 of 16
#endif

// x's rows m .. m+MR-1 against one panel: `cols` (<= kPanel) outputs of each row to y.
template <int MR>
void panel_rows(const float* __restrict x, const float* __restrict panel, const float* bias,
                float* y, int64_t K, int64_t N, int64_t cols) {
  pfloat low[MR] = {}, high[MR] = {};
  for (int64_t k = 0; k < K; ++k) {
    pfloat w0 = load<pfloat>(panel + k * kPanel);
    pfloat w1 = load<pfloat>(panel + k * kPanel + kWidth);
#ifdef __AVX__  // where a vector is one register
    // In registers: left to itself the compiler may read them again from memory for each
    // row of x, and the loads, not the multiply-adds, set the pace.
    asm("" : "+v"(w0), "+v"(w1));
#endif
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const pfloat xi = splat<pfloat>(x[i * K + k]);
      low[i] += xi * w0;
      high[i] += xi * w1;
    }
  }
  for (int i = 0; i < MR; ++i) {
    float row[kPanel];
    store(row, low[i]);
    store(row + kWidth, high[i]);
    float* out = y + i * N;
    if (bias == nullptr) {
      std::copy(row, row + cols, out);
    } else {
      for (int64_t j = 0; j < cols; ++j) out[j] = row[j] + bias[j];
    }
  }
}

// All of x's rows against one panel: MR rows a pass.
void panel_all_rows(const float* x, const float* panel, const float* b, float* y, int64_t M,
                    int64_t K, int64_t N, int64_t cols) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) panel_rows<kRows>(x + m * K, panel, b, y + m * N, K, N, cols);
  // What is left, in as few passes over the panel as the tiles allow (3 rows: 2 + 1).
  if (kRows > 4 && m + 4 <= M) {
    panel_rows<4>(x + m * K, panel, b, y + m * N, K, N, cols);
    m += 4;
  }
  for (; m + 2 <= M; m += 2) panel_rows<2>(x + m * K, panel, b, y + m * N, K, N, cols);
  for (; m < M; ++m) panel_rows<1>(x + m * K, panel, b, y + m * N, K, N, cols);
}
#else   // no vector extension: the same layout, plain loops
constexpr int64_t kPanel = 16;

void panel_all_rows(const float* x, const float* panel, const float* b, float* y, int64_t M,
                    int64_t K, int64_t N, int64_t cols) {
  for (int64_t m = 0; m < M; ++m) {
    float acc[kPanel] = {};
    for (int64_t k = 0; k < K; ++k) {
      const float xk = x[m * K + k];
      for (int64_t j = 0; j < kPanel; ++j) acc[j] += xk * panel[k * kPanel + j];
    }
    for (int64_t j = 0; j < cols; ++j) y[m * N + j] = b ? acc[j] + b[j] : acc[j];
  }
}
#endif  // CARPOOL_VECTOR

// Rows of x a task takes at most: a prefill chunk's rows are split too, so that a layer
// with few panels (N = 768: 24) still gives every thread work.
constexpr int64_t kTaskRows = 64;

void multiply(const float* x, const float* packed, const float* bias, float* y, int64_t M,
              int64_t K, int64_t N) {
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  const int64_t row_blocks = (M + kTaskRows - 1) / kTaskRows;
  // Task t: panel t / row_blocks, rows (t % row_blocks) * kTaskRows ..; a thread's tasks are
  // consecutive, so it takes a panel's row blocks one after another while the panel is in
  // its cache. Each output is one task's, summed in one order: any thread count gives the
  // same bits.
  at::parallel_for(0, num_panels * row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = t / row_blocks, m = (t % row_blocks) * kTaskRows;
      const int64_t n = p * kPanel;
      panel_all_rows(x + m * K, packed + p * K * kPanel, bias == nullptr ? nullptr : bias + n,
                     y + m * N + n, std::min(kTaskRows, M - m), K, N, std::min(kPanel, N - n));
    }
  });
}

at::Tensor pack_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "carpool::pack_linear: weight must be float32 [out, in] on the CPU, got ",
              weight.scalar_type(), " ", weight.sizes(), " on ", weight.device());
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({num_panels, K, kPanel}, weight.options());
  const at::Tensor wc = weight.contiguous();
  const float* w = wc.data_ptr<float>();
  float* out = packed.data_ptr<float>();
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      float* panel = out + p * K * kPanel;
      for (int64_t j = 0; j < cols; ++j) {
        const float* row = w + (p * kPanel + j) * K;
        for (int64_t k = 0; k < K; ++k) panel[k * kPanel + j] = row[k];
      }
    }
  });
  return packed;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias, int64_t out_features) {
  constexpr const char* op = "carpool::packed_linear";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), op,
              ": x must be float32 [rows, in] on the CPU, got ", x.scalar_type(), " ",
              x.sizes(), " on ", x.device());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              op, ": packed must be what carpool::pack_linear made here, [panels, in, ",
              kPanel, "] float32, got ", packed.scalar_type(), " ", packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(packed.size(1) == K, op, ": x has ", K, " columns, the weight ", packed.size(1));
  TORCH_CHECK(N > (packed.size(0) - 1) * kPanel && N <= packed.size(0) * kPanel, op,
              ": out_features ", N, " does not fit ", packed.size(0), " panels of ", kPanel);
  const float* bias_data = nullptr;
  at::Tensor bias_contiguous;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat,
                op, ": bias must be float32 [", N, "], got ", bias->scalar_type(), " ",
                bias->sizes());
    bias_contiguous = bias->contiguous();
    bias_data = bias_contiguous.data_ptr<float>();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    multiply(xc.data_ptr<float>(), packed.data_ptr<float>(), bias_data, y.data_ptr<float>(), M,
             K, N);
  }
  return y;
}

}  // namespace carpool_linear

TORCH_LIBRARY_FRAGMENT(carpool, m) {
  m.def("pack_linear(Tensor weight) -> Tensor");
  m.impl("pack_linear", c10::DispatchKey::CPU, TORCH_FN(carpool_linear::pack_linear));
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.impl("packed_linear", c10::DispatchKey::CPU, TORCH_FN(carpool_linear::packed_linear));
}
