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
#include "attention_common.h"

namespace {

using namespace carpool_attention;

// The task a thread runs next: its sequence's block ids and block count, and its KV head.
// The last span of a task prefetches the next one's first (a task of a few spans would
// otherwise start each with its first span cold; docs/benchmarks.md, "Huge pages").
struct NextTask {
  const int64_t* block_ids = nullptr;
  int64_t num_blocks = 0;
  int64_t head = 0;
};

#ifdef CARPOOL_VECTOR
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

// Keys per online-softmax update (rounded to whole blocks): a span's K and V rows of one KV
// head, 32 KB, stay in the L1 cache while its heads score it and add its values.
constexpr int64_t kDecodeSpanFloats = 4096;
inline int64_t decode_span_blocks(int64_t head_dim, int64_t block_size) {
  return std::max<int64_t>(1, kDecodeSpanFloats / head_dim / block_size);
}

// The weighted value rows of one span for kNum query heads: acc[i] += scores[i][t] * V[t]
// over the span's keys, each value row loaded once for all kNum heads. `scores` [kNum, P]
// (P: the span's stride), `accs` [kNum, kD] read and written back.
template <int64_t kD, int64_t kNum>
inline void add_values(const float* scores, int64_t P, const float* v_blocks,
                       const int64_t* block_ids, int64_t b0, int64_t b1, int64_t num_keys,
                       int64_t B, int64_t block_stride, int64_t token_stride, int64_t head_offset,
                       float* accs) {
  constexpr int64_t CP = kD / kWidth;
  pfloat acc[kNum][CP];
  for (int64_t i = 0; i < kNum; ++i) {
    for (int64_t c = 0; c < CP; ++c) acc[i][c] = load<pfloat>(accs + i * kD + c * kWidth);
  }
  for (int64_t b = b0; b < b1; ++b) {
    const float* values = v_blocks + block_ids[b] * block_stride + head_offset;
    const int64_t first = (b - b0) * B;
    const int64_t rows = std::min(B, num_keys - first);
    for (int64_t r = 0; r < rows; ++r) {
      pfloat v[CP];
      for (int64_t c = 0; c < CP; ++c) v[c] = load<pfloat>(values + r * token_stride + c * kWidth);
      for (int64_t i = 0; i < kNum; ++i) {
        const pfloat weight = splat<pfloat>(scores[i * P + first + r]);
        for (int64_t c = 0; c < CP; ++c) acc[i][c] += weight * v[c];
      }
    }
  }
  for (int64_t i = 0; i < kNum; ++i) {
    for (int64_t c = 0; c < CP; ++c) store(accs + i * kD + c * kWidth, acc[i][c]);
  }
}

// add_values for `num` (1..kMax) heads, the count made a compile-time one.
template <int64_t kD, int64_t kMax>
inline void add_values_of(int64_t num, const float* scores, int64_t P, const float* v_blocks,
                          const int64_t* block_ids, int64_t b0, int64_t b1, int64_t num_keys,
                          int64_t B, int64_t block_stride, int64_t token_stride,
                          int64_t head_offset, float* accs) {
  if constexpr (kMax > 1) {
    if (num < kMax) {
      add_values_of<kD, kMax - 1>(num, scores, P, v_blocks, block_ids, b0, b1, num_keys, B,
                                  block_stride, token_stride, head_offset, accs);
      return;
    }
  }
  add_values<kD, kMax>(scores, P, v_blocks, block_ids, b0, b1, num_keys, B, block_stride,
                       token_stride, head_offset, accs);
}

// float32 with head_dim kD (a multiple of kWidth), the query heads of KV head `h` of one
// sequence (`query`: the sequence's [heads, kD]). Keys go in spans of whole blocks (about
// kDecodeSpanKeys): each query head scores the span's keys, eight at a time (eight
// independent sums, transposed by pairwise adds), while its share of the next span is
// prefetched (prefetch_part); then per head one online-softmax update for the span, and the
// weighted value rows added for the heads together (add_values), each row loaded once.
template <int64_t kD>
void attend_group_vector(const Shape& s, const float* query, const float* k_blocks,
                         const float* v_blocks, const int64_t* block_ids, int64_t length,
                         float scale, int64_t h, float* out, float* work, const NextTask& next) {
  constexpr int64_t C = kD / kLanes;
  constexpr int64_t CP = kD / kWidth;
  constexpr int64_t kHeadsTogether = std::max<int64_t>(1, std::min<int64_t>(8, 16 / CP));
  const int64_t G = s.group, B = s.block_size;
  const int64_t token_stride = s.num_kv_heads * kD;
  const int64_t block_stride = B * token_stride;
  const int64_t head_offset = h * kD;
  const int64_t num_blocks = (length + B - 1) / B;
  const int64_t span_blocks = decode_span_blocks(kD, B);
  const int64_t P = (span_blocks * B + kWidth - 1) / kWidth * kWidth;
  float* accs = work;                  // [G, kD]
  float* sums = accs + G * kD;         // [G, kWidth]
  float* maxes = sums + G * kWidth;    // [G]
  float* scores = maxes + G;           // [G, P]
  std::fill(accs, accs + G * kD, 0.0f);
  std::fill(sums, sums + G * kWidth, 0.0f);
  std::fill(maxes, maxes + G, -std::numeric_limits<float>::infinity());
  for (int64_t b0 = 0; b0 < num_blocks; b0 += span_blocks) {
    const int64_t b1 = std::min(num_blocks, b0 + span_blocks);
    const int64_t num_keys = std::min(length, b1 * B) - b0 * B;
    const int64_t padded = (num_keys + kWidth - 1) / kWidth * kWidth;
    const int64_t next_end = std::min(num_blocks, b1 + span_blocks);
    for (int64_t g = 0; g < G; ++g) {
      // this head's share of the next span, or after the last the next task's first
      const bool last = b1 == num_blocks;
      const int64_t* ahead_ids = last ? next.block_ids : block_ids + b1;
      const int64_t ahead_blocks = last ? std::min(next.num_blocks, span_blocks) : next_end - b1;
      const int64_t ahead_offset = last ? next.head * kD : head_offset;
      for (int64_t b = 0; b < ahead_blocks; ++b) {
        const int64_t at = ahead_ids[b] * block_stride + ahead_offset;
        prefetch_part(k_blocks + at, v_blocks + at, token_stride, B, kD, g, G);
      }
      vfloat q[C];
      const float* q_head = query + (h * G + g) * kD;
      for (int64_t c = 0; c < C; ++c) q[c] = load(q_head + c * kLanes) * scale;
      float* row = scores + g * P;
      for (int64_t b = b0; b < b1; ++b) {
        const float* keys = k_blocks + block_ids[b] * block_stride + head_offset;
        float* out_row = row + (b - b0) * B;
        const int64_t rows = std::min(B, num_keys - (b - b0) * B);
        int64_t t = 0;
        for (; t + 8 <= rows; t += 8) {  // eight keys at a time: eight independent sums
          const float* k0 = keys + t * token_stride;
          vfloat a[8] = {};
          for (int64_t c = 0; c < C; ++c) {
            for (int64_t i = 0; i < 8; ++i) a[i] += q[c] * load(k0 + i * token_stride + c * kLanes);
          }
          store(out_row + t, horizontal_sums(a));
        }
        for (; t < rows; ++t) {
          vfloat a{};
          for (int64_t c = 0; c < C; ++c) a += q[c] * load(keys + t * token_stride + c * kLanes);
          out_row[t] = horizontal_sum(a);
        }
      }
      // Online softmax over the span: what was summed under the old max is rescaled.
      float span_max = maxes[g];
      pfloat lanes_max = splat<pfloat>(span_max);  // a vector max: one serial chain was slow
      int64_t t = 0;
      for (; t + kWidth <= num_keys; t += kWidth) {
        const pfloat x = load<pfloat>(row + t);
        lanes_max = x > lanes_max ? x : lanes_max;
      }
      for (int64_t l = 0; l < kWidth; ++l) span_max = std::max(span_max, lanes_max[l]);
      for (; t < num_keys; ++t) span_max = std::max(span_max, row[t]);
      for (t = num_keys; t < padded; ++t) row[t] = span_max;
      const pfloat shift = splat<pfloat>(span_max);
      for (t = 0; t < padded; t += kWidth) {
        store(row + t, exp_nonpositive(load<pfloat>(row + t) - shift));
      }
      for (t = num_keys; t < padded; ++t) row[t] = 0.0f;  // adds nothing
      pfloat sum{};
      for (t = 0; t < padded; t += kWidth) sum += load<pfloat>(row + t);
      const float correction = std::exp(maxes[g] - span_max);
      maxes[g] = span_max;
      const pfloat scaled = splat<pfloat>(correction);
      store(sums + g * kWidth, load<pfloat>(sums + g * kWidth) * scaled + sum);
      for (int64_t c = 0; c < CP; ++c) {
        store(accs + g * kD + c * kWidth, load<pfloat>(accs + g * kD + c * kWidth) * scaled);
      }
    }
    for (int64_t g = 0; g < G;) {
      const int64_t num = std::min(G - g, kHeadsTogether);
      add_values_of<kD, kHeadsTogether>(num, scores + g * P, P, v_blocks, block_ids, b0, b1,
                                        num_keys, B, block_stride, token_stride, head_offset,
                                        accs + g * kD);
      g += num;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inverse = 1.0f / horizontal_sum(load<pfloat>(sums + g * kWidth));
    float* o = out + (h * G + g) * kD;
    for (int64_t d = 0; d < kD; ++d) o[d] = accs[g * kD + d] * inverse;
  }
}

// Scratch of attend_group_vector, in floats.
int64_t group_vector_work(const Shape& s) {
  const int64_t span_blocks = decode_span_blocks(s.head_dim, s.block_size);
  const int64_t P = (span_blocks * s.block_size + kWidth - 1) / kWidth * kWidth;
  return s.group * (s.head_dim + kWidth + 1 + P);
}
#endif

void check_inputs(const at::Tensor& query, const at::Tensor& k_blocks,
                  const at::Tensor& v_blocks, const at::Tensor& table,
                  const at::Tensor& lengths) {
  check_query_and_cache("paged_decode", query, k_blocks, v_blocks);
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
                 int64_t, T*, T*, const NextTask&) {
  return false;
}

#ifdef CARPOOL_VECTOR
template <>
bool attend_fast<float>(const Shape& s, const float* q, const float* k, const float* v,
                        const int64_t* ids, int64_t length, double scale, int64_t h,
                        float* out, float* work, const NextTask& next) {
  using Vector = void (*)(const Shape&, const float*, const float*, const float*,
                          const int64_t*, int64_t, float, int64_t, float*, float*,
                          const NextTask&);
  Vector attend = nullptr;
  switch (s.head_dim) {
    case 32: attend = attend_group_vector<32>; break;
    case 64: attend = attend_group_vector<64>; break;
    case 128: attend = attend_group_vector<128>; break;
    case 256: attend = attend_group_vector<256>; break;
    default: return false;
  }
  attend(s, q, k, v, ids, length, static_cast<float>(scale), h, out, work, next);
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
  // Either path's scratch: the vector path's (attend_group_vector) or attend_one's.
  int64_t work_size = attend_one_work(s);
#ifdef CARPOOL_VECTOR
  work_size = std::max(work_size, group_vector_work(s));
#endif
  at::parallel_for(0, n * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> work(work_size);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / s.num_kv_heads;
      const int64_t h = task % s.num_kv_heads;
      const T* q_seq = q + i * s.num_heads * s.head_dim;
      T* o_seq = o + i * s.num_heads * s.head_dim;
      const int64_t* row = ids + i * s.max_blocks;
      NextTask next;  // none after this thread's last
      if (task + 1 < end) {
        const int64_t j = (task + 1) / s.num_kv_heads;
        next = {ids + j * s.max_blocks, (lens[j] + s.block_size - 1) / s.block_size,
                (task + 1) % s.num_kv_heads};
      }
      if (attend_fast(s, q_seq, k, v, row, lens[i], scale, h, o_seq, work.data(), next)) continue;
      const int64_t head_offset = h * s.group * s.head_dim;
      attend_one<T>(s, q_seq + head_offset, k + h * s.head_dim, v + h * s.head_dim, row,
                    lens[i], static_cast<T>(scale), o_seq + head_offset, work.data());
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
