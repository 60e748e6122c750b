// What the attention kernels over the paged KV cache share (paged_decode.cpp,
// paged_prefill.cpp): the scalar online-softmax walk of one query token over its context
// (any dtype, any head_dim) and the vector helpers of the float32 paths.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef __AVX__
#include <immintrin.h>
#endif

namespace carpool_attention {

template <typename T>
inline T dot(const T* __restrict a, const T* __restrict b, int64_t size) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < size; ++d) sum += a[d] * b[d];
  return sum;
}

template <typename T>
inline void scale_add(T* __restrict acc, const T* __restrict row, T weight, int64_t size) {
#pragma omp simd
  for (int64_t d = 0; d < size; ++d) acc[d] += weight * row[d];
}

template <typename T>
inline void rescale(T* __restrict acc, T factor, int64_t size) {
#pragma omp simd
  for (int64_t d = 0; d < size; ++d) acc[d] *= factor;
}

struct Shape {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
};

// One sequence and one KV head: the `group` query heads that share it.
template <typename T>
void attend_one(const Shape& s, const T* query, const T* k_blocks, const T* v_blocks,
                const int64_t* block_ids, int64_t length, T scale, T* out, T* work) {
  const int64_t G = s.group, D = s.head_dim, B = s.block_size;
  const int64_t token_stride = s.num_kv_heads * D;  // between keys within a block
  const int64_t block_stride = B * token_stride;
  T* q = work;                 // [G, D] query, pre-scaled
  T* acc = q + G * D;          // [G, D] weighted sum of values
  T* scores = acc + G * D;     // [G, B] one block's scores
  T* running_max = scores + G * B;
  T* running_sum = running_max + G;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) q[g * D + d] = query[g * D + d] * scale;
    running_max[g] = -std::numeric_limits<T>::infinity();
    running_sum[g] = 0;
  }
  std::fill(acc, acc + G * D, T(0));
  const int64_t num_blocks = (length + B - 1) / B;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t offset = block_ids[b] * block_stride;
    const T* keys = k_blocks + offset;
    const T* values = v_blocks + offset;
    const int64_t num_keys = std::min(B, length - b * B);
    for (int64_t g = 0; g < G; ++g) {
      T* row = scores + g * B;
      T block_max = running_max[g];
      for (int64_t t = 0; t < num_keys; ++t) {
        row[t] = dot(q + g * D, keys + t * token_stride, D);
        block_max = std::max(block_max, row[t]);
      }
      // Online softmax: what was summed under the old max is rescaled to the new one.
      const T correction = std::exp(running_max[g] - block_max);
      running_max[g] = block_max;
      T* acc_g = acc + g * D;
      if (correction != T(1)) {
        running_sum[g] *= correction;
        rescale(acc_g, correction, D);
      }
      T block_sum = 0;
      for (int64_t t = 0; t < num_keys; ++t) {
        const T weight = std::exp(row[t] - block_max);
        block_sum += weight;
        scale_add(acc_g, values + t * token_stride, weight, D);
      }
      running_sum[g] += block_sum;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const T inverse = T(1) / running_sum[g];
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inverse;
  }
}

// The query and one layer's cache, as both kernels take them; `op` names the kernel in
// the error.
inline void check_query_and_cache(const char* op, const at::Tensor& query,
                                  const at::Tensor& k_blocks, const at::Tensor& v_blocks) {
  TORCH_CHECK(query.dim() == 3, op, ": query must be [n, heads, D], got ", query.sizes());
  TORCH_CHECK(k_blocks.dim() == 4 && k_blocks.sizes() == v_blocks.sizes(), op,
              ": k_blocks and v_blocks must both be [num_blocks, block_size, kv_heads, D], "
              "got ", k_blocks.sizes(), " and ", v_blocks.sizes());
  TORCH_CHECK(k_blocks.is_contiguous() && v_blocks.is_contiguous(), op,
              ": k_blocks and v_blocks must be contiguous (read in place)");
  TORCH_CHECK(query.device().is_cpu() && k_blocks.device().is_cpu() &&
                  v_blocks.device().is_cpu(),
              op, ": CPU tensors only, got query on ", query.device(), ", cache on ",
              k_blocks.device());
  TORCH_CHECK(query.scalar_type() == k_blocks.scalar_type() &&
                  k_blocks.scalar_type() == v_blocks.scalar_type(),
              op, ": query, k_blocks and v_blocks must share a dtype, got ",
              query.scalar_type(), ", ", k_blocks.scalar_type(), ", ", v_blocks.scalar_type());
  TORCH_CHECK(query.size(2) == k_blocks.size(3), op, ": head_dim of query (", query.size(2),
              ") and cache (", k_blocks.size(3), ") differ");
  TORCH_CHECK(query.size(1) % k_blocks.size(2) == 0, op, ": ", query.size(1),
              " query heads are not a multiple of ", k_blocks.size(2), " KV heads");
}

// The scratch attend_one uses: the group's query and accumulator rows, one block's scores
// per query head, the running maxes and sums.
inline int64_t attend_one_work(const Shape& s) {
  return 2 * s.group * s.head_dim + s.group * s.block_size + 2 * s.group;
}

// CARPOOL_NO_VECTOR (-D at build) leaves the plain loops everywhere: how their tests run
// them (tests/unit/generation/test_kernel_isa_builds.py).
#if (defined(__GNUC__) || defined(__clang__)) && !defined(CARPOOL_NO_VECTOR)
#define CARPOOL_VECTOR 1
// Floats in the compiler's vector extension: eight (AVX2/AVX-512 with -march=native, two
// SSE or NEON registers elsewhere), and sixteen (one AVX-512 register) for the paths that
// choose them where __AVX512F__ is defined. The helpers take any of them.
typedef float vfloat __attribute__((vector_size(32)));
typedef int32_t vint __attribute__((vector_size(32)));
typedef float wfloat __attribute__((vector_size(64)));
typedef int32_t wint __attribute__((vector_size(64)));
constexpr int64_t kLanes = 8;

template <typename V>
constexpr int64_t lanes_of = sizeof(V) / sizeof(float);

template <typename V = vfloat>
inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
inline void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }

// Every lane x (a broadcast; `V{} + x` would also add the zeros: 0 + x is not x for -0).
template <typename V = vfloat>
inline V splat(float x) {
  static_assert(lanes_of<V> == 8 || lanes_of<V> == 16, "vfloat or wfloat");
  if constexpr (lanes_of<V> == 8) {
    return V{x, x, x, x, x, x, x, x};
  } else {
    return V{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
  }
}

template <typename V>
inline float horizontal_sum(V v) {
  float sum = 0;
  for (int64_t i = 0; i < lanes_of<V>; ++i) sum += v[i];
  return sum;
}

// {horizontal_sum(a[0]), ..., horizontal_sum(a[7])}: with AVX, a transpose by pairwise adds.
inline vfloat horizontal_sums(const vfloat* a) {
#ifdef __AVX__
  const __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]);
  const __m256 t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
  const __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]);
  const __m256 t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // low 128 bits: a[0..3]'s low halves summed
  const __m256 u1 = _mm256_hadd_ps(t2, t3);
  return (vfloat)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                               _mm256_permute2f128_ps(u0, u1, 0x31));
#else
  vfloat sums;
  for (int64_t i = 0; i < kLanes; ++i) sums[i] = horizontal_sum(a[i]);
  return sums;
#endif
}

// exp(x) for x <= 0 (scores minus their max): Cephes' expf, x = n ln2 + r, |r| <= ln2 / 2,
// exp(r) by a degree-7 polynomial, 2^n by building the float's exponent (relative error
// about 1e-7; below -87 the result is ~1e-38, not 0). VI: V's lanes as int32.
template <typename V, typename VI>
inline V exp_nonpositive_of(V x) {
  const V lowest = splat<V>(-87.0f);
  x = x < lowest ? lowest : x;
  const V round_magic = splat<V>(12582912.0f);  // 1.5 * 2^23: adding it rounds to integer
  V n = (x * 1.44269504088896341f + round_magic) - round_magic;
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = splat<V>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const VI exponent = (__builtin_convertvector(n, VI) + 127) << 23;
  V two_to_n;
  std::memcpy(&two_to_n, &exponent, sizeof two_to_n);
  return p * two_to_n;
}

inline vfloat exp_nonpositive(vfloat x) { return exp_nonpositive_of<vfloat, vint>(x); }
inline wfloat exp_nonpositive(wfloat x) { return exp_nonpositive_of<wfloat, wint>(x); }

// The widest of them the compiler targets: one AVX-512 register where there are such, else
// eight floats.
#ifdef __AVX512F__
using pfloat = wfloat;
#else
using pfloat = vfloat;
#endif
constexpr int64_t kWidth = lanes_of<pfloat>;

#endif  // CARPOOL_VECTOR

}  // namespace carpool_attention
