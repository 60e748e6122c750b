// Decode attention over the paged KV cache, read in place (carpool.generation.paged_decode).
//
// One query token per sequence. For each (sequence, KV head) the query heads sharing that
// KV head walk the sequence's block table, score each key of its context, keep a running
// max and sum (online softmax) and accumulate the weighted values; no K/V is copied:
//
//   query      [n, heads, D]                        one token per sequence
//   k/v_blocks [num_blocks, block_size, kv_heads, D] one layer's cache
//   table      [n, max_blocks] int64                 block ids, row i for sequence i
//   lengths    [n] int64                             keys of sequence i: 0 .. lengths[i]
//   out        [n, heads, D]
//
// Registered as torch.ops.carpool.paged_decode (no pybind: a shorter build).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#ifdef __AVX__
#include <immintrin.h>
#endif

namespace {

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

#if defined(__GNUC__) || defined(__clang__)
#define CARPOOL_VECTOR 1
// Eight floats in the compiler's vector extension: AVX2/AVX-512 with -march=native, two
// SSE or NEON registers elsewhere.
typedef float vfloat __attribute__((vector_size(32)));
typedef int32_t vint __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

inline vfloat splat(float x) { return vfloat{} + x; }

inline float horizontal_sum(vfloat v) {
  float sum = 0;
  for (int64_t i = 0; i < kLanes; ++i) sum += v[i];
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
// about 1e-7; below -87 the result is ~1e-38, not 0).
inline vfloat exp_nonpositive(vfloat x) {
  const vfloat lowest = splat(-87.0f);
  x = x < lowest ? lowest : x;
  const vfloat round_magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to integer
  vfloat n = (x * 1.44269504088896341f + round_magic) - round_magic;
  vfloat r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vfloat p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vint exponent = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat two_to_n;
  std::memcpy(&two_to_n, &exponent, sizeof two_to_n);
  return p * two_to_n;
}

// Asks for part `part` of `num_parts` of a block's K and V rows of some heads to be brought
// into the L2 cache: `num_rows` rows of `row_size` floats, `stride` floats apart (one
// contiguous run when they are all the heads), a K line then its V line. Spread over the
// work on the block before (one part per query head) rather than asked all at once, the
// requests do not stall on the core's few outstanding misses, and they arrive in time (a
// block is anywhere in the cache: the hardware's prefetcher does not foresee it). Inlined
// by force: as a call in the loop over heads it cost the kernel a third more time.
__attribute__((always_inline)) inline void prefetch_part(const float* keys, const float* values, int64_t stride,
                          int64_t num_rows, int64_t row_size, int64_t part, int64_t num_parts) {
  constexpr int64_t kLineFloats = 64 / sizeof(float);
  if (row_size == stride) {
    const int64_t num_lines = (num_rows * row_size + kLineFloats - 1) / kLineFloats;
    const int64_t begin = num_lines * part / num_parts, end = num_lines * (part + 1) / num_parts;
    for (int64_t line = begin; line < end; ++line) {
      __builtin_prefetch(keys + line * kLineFloats, 0, 2);
      __builtin_prefetch(values + line * kLineFloats, 0, 2);
    }
    return;
  }
  const int64_t begin = num_rows * part / num_parts, end = num_rows * (part + 1) / num_parts;
  for (int64_t row = begin; row < end; ++row) {
    for (int64_t i = 0; i < row_size; i += kLineFloats) {
      __builtin_prefetch(keys + row * stride + i, 0, 2);
      __builtin_prefetch(values + row * stride + i, 0, 2);
    }
  }
}

// float32 with head_dim kD (a multiple of kLanes), KV heads [h_begin, h_end) of one
// sequence. Blocks are the outer loop: a block's rows for these heads are read once, while
// the next block is prefetched (prefetch_part); within a block, each query head scores the
// keys, updates its running max and sum, and adds the weighted values to its accumulator
// (kept in `work` between blocks, in registers within one).
template <int64_t kD>
void attend_heads_vector(const Shape& s, const float* query, const float* k_blocks,
                         const float* v_blocks, const int64_t* block_ids, int64_t length,
                         float scale, int64_t h_begin, int64_t h_end, float* out,
                         float* work) {
  constexpr int64_t C = kD / kLanes;
  const int64_t B = s.block_size;
  const int64_t token_stride = s.num_kv_heads * kD;
  const int64_t block_stride = B * token_stride;
  const int64_t num_blocks = (length + B - 1) / B;
  const int64_t first_head = h_begin * s.group;  // query heads [first_head, last_head)
  const int64_t num_heads = (h_end - h_begin) * s.group;
  float* accs = work;                          // [num_heads, kD]
  float* maxes = accs + num_heads * kD;        // [num_heads]
  float* sums = maxes + num_heads;             // [num_heads]
  float* scores = sums + num_heads;            // [B rounded up to kLanes]
  std::fill(accs, accs + num_heads * kD, 0.0f);
  std::fill(maxes, maxes + num_heads, -std::numeric_limits<float>::infinity());
  std::fill(sums, sums + num_heads, 0.0f);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t num_keys = std::min(B, length - b * B);
    const int64_t padded = (num_keys + kLanes - 1) / kLanes * kLanes;
    for (int64_t j = 0; j < num_heads; ++j) {
      const int64_t head = first_head + j;
      const int64_t offset = block_ids[b] * block_stride + (head / s.group) * kD;
      const float* keys = k_blocks + offset;
      const float* values = v_blocks + offset;
      if (b + 1 < num_blocks) {  // this head's share of the next block, while this one computes
        const int64_t next = block_ids[b + 1] * block_stride + h_begin * kD;
        const int64_t row_size = (h_end - h_begin) * kD;
        prefetch_part(k_blocks + next, v_blocks + next, token_stride, B, row_size, j, num_heads);
      }
      vfloat q[C];
      for (int64_t c = 0; c < C; ++c) q[c] = load(query + head * kD + c * kLanes) * scale;
      int64_t t = 0;
      for (; t + 8 <= num_keys; t += 8) {  // eight keys at a time: eight independent sums
        const float* k0 = keys + t * token_stride;
        vfloat a[8] = {};
        for (int64_t c = 0; c < C; ++c) {
          for (int64_t i = 0; i < 8; ++i) a[i] += q[c] * load(k0 + i * token_stride + c * kLanes);
        }
        store(scores + t, horizontal_sums(a));
      }
      for (; t < num_keys; ++t) {
        vfloat a{};
        for (int64_t c = 0; c < C; ++c) a += q[c] * load(keys + t * token_stride + c * kLanes);
        scores[t] = horizontal_sum(a);
      }
      float block_max = maxes[j];
      for (t = 0; t < num_keys; ++t) block_max = std::max(block_max, scores[t]);
      for (t = num_keys; t < padded; ++t) scores[t] = block_max;  // exp of 0, not used
      for (t = 0; t < padded; t += kLanes) {
        store(scores + t, exp_nonpositive(load(scores + t) - block_max));
      }
      // Online softmax: what was summed under the old max is rescaled to the new one.
      const float correction = std::exp(maxes[j] - block_max);
      maxes[j] = block_max;
      float block_sum = 0;
      for (t = 0; t < num_keys; ++t) block_sum += scores[t];
      sums[j] = sums[j] * correction + block_sum;
      vfloat acc[C];
      for (int64_t c = 0; c < C; ++c) acc[c] = load(accs + j * kD + c * kLanes) * correction;
      for (t = 0; t < num_keys; ++t) {
        const float* row = values + t * token_stride;
        for (int64_t c = 0; c < C; ++c) acc[c] += scores[t] * load(row + c * kLanes);
      }
      for (int64_t c = 0; c < C; ++c) store(accs + j * kD + c * kLanes, acc[c]);
    }
  }
  for (int64_t j = 0; j < num_heads; ++j) {
    const float inverse = 1.0f / sums[j];
    for (int64_t d = 0; d < kD; ++d) out[(first_head + j) * kD + d] = accs[j * kD + d] * inverse;
  }
}
#endif

void check_inputs(const at::Tensor& query, const at::Tensor& k_blocks,
                  const at::Tensor& v_blocks, const at::Tensor& table,
                  const at::Tensor& lengths) {
  TORCH_CHECK(query.dim() == 3, "paged_decode: query must be [n, heads, D], got ",
              query.sizes());
  TORCH_CHECK(k_blocks.dim() == 4 && k_blocks.sizes() == v_blocks.sizes(),
              "paged_decode: k_blocks and v_blocks must both be [num_blocks, block_size, "
              "kv_heads, D], got ", k_blocks.sizes(), " and ", v_blocks.sizes());
  TORCH_CHECK(k_blocks.is_contiguous() && v_blocks.is_contiguous(),
              "paged_decode: k_blocks and v_blocks must be contiguous (read in place)");
  TORCH_CHECK(query.device().is_cpu() && k_blocks.device().is_cpu() &&
                  v_blocks.device().is_cpu(),
              "paged_decode: CPU tensors only, got query on ", query.device(), ", cache on ",
              k_blocks.device());
  TORCH_CHECK(query.scalar_type() == k_blocks.scalar_type() &&
                  k_blocks.scalar_type() == v_blocks.scalar_type(),
              "paged_decode: query, k_blocks and v_blocks must share a dtype, got ",
              query.scalar_type(), ", ", k_blocks.scalar_type(), ", ", v_blocks.scalar_type());
  TORCH_CHECK(query.size(2) == k_blocks.size(3), "paged_decode: head_dim of query (",
              query.size(2), ") and cache (", k_blocks.size(3), ") differ");
  TORCH_CHECK(query.size(1) % k_blocks.size(2) == 0, "paged_decode: ", query.size(1),
              " query heads are not a multiple of ", k_blocks.size(2), " KV heads");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == query.size(0),
              "paged_decode: table must be [n=", query.size(0), ", max_blocks], got ",
              table.sizes());
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == query.size(0),
              "paged_decode: lengths must be [n=", query.size(0), "], got ", lengths.sizes());
}

// Every length in 1 .. max_blocks * block_size; every block id it reaches in range.
void check_tables(const int64_t* table, const int64_t* lengths, int64_t n, int64_t max_blocks,
                  int64_t block_size, int64_t num_blocks) {
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(lengths[i] >= 1 && lengths[i] <= max_blocks * block_size,
                "paged_decode: sequence ", i, " has context length ", lengths[i],
                ", expected 1 to ", max_blocks * block_size, " (its table's blocks)");
    const int64_t used = (lengths[i] + block_size - 1) / block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int64_t id = table[i * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_decode: sequence ", i, " block ", b,
                  " is ", id, ", expected 0 to ", num_blocks - 1);
    }
  }
}

// The vector path where it applies (float32, head_dim 32/64/128/256); false: it does not.
template <typename T>
bool attend_fast(const Shape&, const T*, const T*, const T*, const int64_t*, int64_t, double,
                 int64_t, int64_t, T*, T*) {
  return false;
}

#ifdef CARPOOL_VECTOR
template <>
bool attend_fast<float>(const Shape& s, const float* q, const float* k, const float* v,
                        const int64_t* ids, int64_t length, double scale, int64_t h_begin,
                        int64_t h_end, float* out, float* work) {
  using Vector = void (*)(const Shape&, const float*, const float*, const float*,
                          const int64_t*, int64_t, float, int64_t, int64_t, float*, float*);
  Vector attend = nullptr;
  switch (s.head_dim) {
    case 32: attend = attend_heads_vector<32>; break;
    case 64: attend = attend_heads_vector<64>; break;
    case 128: attend = attend_heads_vector<128>; break;
    case 256: attend = attend_heads_vector<256>; break;
    default: return false;
  }
  attend(s, q, k, v, ids, length, static_cast<float>(scale), h_begin, h_end, out, work);
  return true;
}
#endif

// One task per (sequence, KV head). One task per sequence (all its KV heads, its blocks
// read front to back) measured no faster with the prefetching of prefetch_part (88 M
// Llama's 64 sequences: 3.2 ms a layer against 3.0), and gives threads coarser work.
template <typename T>
void run(const at::Tensor& query, const at::Tensor& k_blocks, const at::Tensor& v_blocks,
         const at::Tensor& table, const at::Tensor& lengths, double scale, at::Tensor& out) {
  const int64_t n = query.size(0);
  Shape s{query.size(1), k_blocks.size(2), query.size(1) / k_blocks.size(2), query.size(2),
          k_blocks.size(1), table.size(1)};
  const T* q = query.data_ptr<T>();
  const T* k = k_blocks.data_ptr<T>();
  const T* v = v_blocks.data_ptr<T>();
  const int64_t* ids = table.data_ptr<int64_t>();
  const int64_t* lens = lengths.data_ptr<int64_t>();
  T* o = out.data_ptr<T>();
  const int64_t heads_per_task = 1;
  const int64_t tasks_per_seq = s.num_kv_heads / heads_per_task;
  // Either path's scratch: [q, acc] per query head, max and sum, one block's scores.
  const int64_t work_size = 2 * s.num_heads * s.head_dim + 2 * s.num_heads + s.block_size + 8;
  at::parallel_for(0, n * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> work(work_size);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / tasks_per_seq;
      const int64_t h_begin = task % tasks_per_seq * heads_per_task;
      const int64_t h_end = h_begin + heads_per_task;
      const T* q_seq = q + i * s.num_heads * s.head_dim;
      T* o_seq = o + i * s.num_heads * s.head_dim;
      const int64_t* row = ids + i * s.max_blocks;
      if (attend_fast(s, q_seq, k, v, row, lens[i], scale, h_begin, h_end, o_seq, work.data())) {
        continue;
      }
      for (int64_t h = h_begin; h < h_end; ++h) {
        const int64_t head_offset = h * s.group * s.head_dim;
        attend_one<T>(s, q_seq + head_offset, k + h * s.head_dim, v + h * s.head_dim, row,
                      lens[i], static_cast<T>(scale), o_seq + head_offset, work.data());
      }
    }
  });
}

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& k_blocks,
                        const at::Tensor& v_blocks, const at::Tensor& table,
                        const at::Tensor& lengths, double scale) {
  check_inputs(query, k_blocks, v_blocks, table, lengths);
  const at::Tensor q = query.contiguous();
  const at::Tensor ids = table.to(at::kLong).contiguous();
  const at::Tensor lens = lengths.to(at::kLong).contiguous();
  check_tables(ids.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), ids.size(0), ids.size(1),
               k_blocks.size(1), k_blocks.size(0));
  at::Tensor out = at::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat:
      run<float>(q, k_blocks, v_blocks, ids, lens, scale, out);
      break;
    case at::kDouble:
      run<double>(q, k_blocks, v_blocks, ids, lens, scale, out);
      break;
    default:
      TORCH_CHECK(false, "paged_decode: float32 or float64, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(carpool, m) {
  m.def("paged_decode(Tensor query, Tensor k_blocks, Tensor v_blocks, Tensor table, "
        "Tensor lengths, float scale) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
