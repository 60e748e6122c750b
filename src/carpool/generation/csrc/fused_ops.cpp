// The elementwise steps of a Llama layer, each one op over float32 rows
// (carpool.generation.llama):
//
//   rms_norm(x, w, eps)          y = w * (x * rsqrt(mean(x^2) + eps)), row by row
//   add_rms_norm(x, d, w, eps)   s = x + d, and rms_norm(s, w, eps): (s, y)
//   silu_mul(gate_up)            [T, 2I] -> silu(gate) * up, [T, I]
//   rotary_(qkv, cos, sin, R, D) the first R heads of D of each row of qkv rotated in place
//                                (Hugging Face's rotate_half: the two halves of a head)
//
// Each replaces a chain of torch ops, every one of which reads and writes the whole
// activation and is dispatched on its own (RMSNorm: pow, mean, add, rsqrt, mul, mul;
// rotary: slices, neg, cat, mul, mul, add, for q and again for k; SwiGLU: chunk, silu,
// mul). Here each op reads its rows once (RMSNorm twice: the sum of squares, then the
// scaling) and writes them once, and a layer dispatches 4 ops where it dispatched about 30
// (docs/generation.md, "Fused elementwise ops").
#include "attention_common.h"

namespace carpool_fused {

#ifdef CARPOOL_VECTOR
using carpool_attention::exp_nonpositive;
using carpool_attention::kWidth;
using carpool_attention::load;
using carpool_attention::pfloat;
using carpool_attention::splat;
using carpool_attention::store;
#endif

// A task's least work in floats: a decode step's few rows stay on one thread.
constexpr int64_t kGrainFloats = 1 << 15;

int64_t grain_rows(int64_t row_floats) {
  return std::max<int64_t>(1, kGrainFloats / std::max<int64_t>(1, row_floats));
}

void check_rows(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.device().is_cpu(), op, ": ",
              name, " must be float32 [rows, features] on the CPU, got ", t.scalar_type(), " ",
              t.sizes(), " on ", t.device());
}

at::Tensor checked_weight(const char* op, const at::Tensor& weight, int64_t size) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == size && weight.scalar_type() == at::kFloat &&
                  weight.device().is_cpu(),
              op, ": weight must be float32 [", size, "] on the CPU, got ", weight.scalar_type(),
              " ", weight.sizes(), " on ", weight.device());
  return weight.contiguous();
}

// One row: y = w * (x * inv), inv = 1 / sqrt(mean(x^2) + eps), in Hugging Face's order.
inline void norm_row(const float* __restrict x, const float* __restrict w, float* __restrict y,
                     int64_t size, float eps) {
  float squares = 0;
#pragma omp simd reduction(+ : squares)
  for (int64_t j = 0; j < size; ++j) squares += x[j] * x[j];
  const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(size) + eps);
#pragma omp simd
  for (int64_t j = 0; j < size; ++j) y[j] = w[j] * (x[j] * inverse);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  constexpr const char* op = "carpool::rms_norm";
  check_rows(op, "x", x);
  const at::Tensor xc = x.contiguous();
  const at::Tensor w = checked_weight(op, weight, x.size(1));
  at::Tensor y = at::empty_like(xc);
  const int64_t H = xc.size(1);
  const float* in = xc.data_ptr<float>();
  const float* wd = w.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, xc.size(0), grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      norm_row(in + t * H, wd, out + t * H, H, static_cast<float>(eps));
    }
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  constexpr const char* op = "carpool::add_rms_norm";
  check_rows(op, "x", x);
  check_rows(op, "delta", delta);
  TORCH_CHECK(x.sizes() == delta.sizes(), op, ": x and delta must have one shape, got ",
              x.sizes(), " and ", delta.sizes());
  const at::Tensor xc = x.contiguous(), dc = delta.contiguous();
  const at::Tensor w = checked_weight(op, weight, x.size(1));
  at::Tensor sum = at::empty_like(xc);
  at::Tensor y = at::empty_like(xc);
  const int64_t H = xc.size(1);
  const float* a = xc.data_ptr<float>();
  const float* b = dc.data_ptr<float>();
  const float* wd = w.data_ptr<float>();
  float* s = sum.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, xc.size(0), grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = s + t * H;
#pragma omp simd
      for (int64_t j = 0; j < H; ++j) row[j] = a[t * H + j] + b[t * H + j];
      norm_row(row, wd, out + t * H, H, static_cast<float>(eps));
    }
  });
  return {sum, y};
}

// y = silu(g) * u over one row of `size`; silu(g) = g / (1 + exp(-g)), as torch computes it.
inline void silu_mul_row(const float* g, const float* u, float* y, int64_t size) {
  int64_t j = 0;
#ifdef CARPOOL_VECTOR
  const pfloat zero{}, one = splat<pfloat>(1.0f);
  for (; j + kWidth <= size; j += kWidth) {
    const pfloat x = load<pfloat>(g + j);
    const auto negative = x < zero;
    // e = exp(-|x|) <= 1; exp(-x) is e for x >= 0 and 1 / e below, where
    // x / (1 + 1/e) = x e / (1 + e): no exp of a large positive number.
    const pfloat e = exp_nonpositive(negative ? x : -x);
    const pfloat numerator = negative ? x * e : x;
    store(y + j, numerator / (one + e) * load<pfloat>(u + j));
  }
#endif
  for (; j < size; ++j) y[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  constexpr const char* op = "carpool::silu_mul";
  check_rows(op, "gate_up", gate_up);
  TORCH_CHECK(gate_up.size(1) % 2 == 0, op, ": gate_up must be [rows, 2 * inner], got ",
              gate_up.size(1), " columns (odd)");
  const at::Tensor x = gate_up.contiguous();
  const int64_t T = x.size(0), inner = x.size(1) / 2;
  at::Tensor y = at::empty({T, inner}, x.options());
  const float* in = x.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, T, grain_rows(2 * inner), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = in + t * 2 * inner;
      silu_mul_row(row, row + inner, out + t * inner, inner);
    }
  });
  return y;
}

// The first num_heads heads of head_dim of each row of qkv rotated in place by the row's
// cos/sin [head_dim] (both halves of each alike, as Hugging Face's rotary makes them):
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, x1 and x2 a head's two halves.
void rotary_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
             int64_t head_dim) {
  constexpr const char* op = "carpool::rotary_";
  check_rows(op, "qkv", qkv);
  TORCH_CHECK(qkv.stride(1) == 1, op, ": qkv's rows must be contiguous, got strides ",
              qkv.strides());
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && num_heads >= 0 &&
                  num_heads * head_dim <= qkv.size(1),
              op, ": ", num_heads, " heads of ", head_dim,
              " (even) must fit a row of qkv, which has ", qkv.size(1));
  const int64_t T = qkv.size(0);
  for (const at::Tensor* angle : {&cos, &sin}) {
    TORCH_CHECK(angle->scalar_type() == at::kFloat && angle->device().is_cpu() &&
                    angle->numel() == T * head_dim && angle->size(0) == T &&
                    angle->size(-1) == head_dim,
                op, ": cos and sin must be float32 [", T, ", ", head_dim,
                "] (or [T, 1, D]) on the CPU, got ", angle->scalar_type(), " ",
                angle->sizes());
  }
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  const int64_t half = head_dim / 2, row_stride = qkv.stride(0);
  float* data = qkv.data_ptr<float>();
  const float* cd = c.data_ptr<float>();
  const float* sd = s.data_ptr<float>();
  at::parallel_for(0, T, grain_rows(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = cd + t * head_dim;
      const float* st = sd + t * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* x = data + t * row_stride + h * head_dim;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = x[j], x2 = x[j + half];
          x[j] = x1 * ct[j] - x2 * st[j];
          x[j + half] = x2 * ct[j + half] + x1 * st[j + half];
        }
      }
    }
  });
}

}  // namespace carpool_fused

TORCH_LIBRARY_FRAGMENT(carpool, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(carpool_fused::rms_norm));
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(carpool_fused::add_rms_norm));
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(carpool_fused::silu_mul));
  m.def("rotary_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
  m.impl("rotary_", c10::DispatchKey::CPU, TORCH_FN(carpool_fused::rotary_));
}
