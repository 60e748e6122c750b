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
  // Either path's scratch: the vector path's accumulators, maxes and sums of one task's
  // query heads and one block's scores (rounded up to 8 lanes), or attend_one's.
  const int64_t vector_work = s.group * s.head_dim + 2 * s.group + s.block_size + 8;
  const int64_t work_size = std::max(vector_work, attend_one_work(s));
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
