// Prefill attention over the paged KV cache, read in place (carpool.generation.paged_decode).
//
// One chunk of one sequence: `n` query tokens at positions num_cached .. num_cached + n - 1,
// whose own K/V the layer has already written into the cache. The query at position p
// attends keys 0 .. p (causal, across the cached prefix and the chunk alike), read through
// the sequence's block table; nothing is gathered or padded:
//
//   query      [n, heads, D]
//   k/v_blocks [num_blocks, block_size, kv_heads, D]   one layer's cache
//   block_ids  [>= ceil((num_cached + n) / block_size)] int64, the sequence's blocks
//   out        [n, heads, D]
//
// float32 with head_dim 32/64/128/256 (16 floats a vector with AVX-512, else 8): one task
// per (KV head, tile of 32 query rows). A tile's query vectors (rows x the query heads
// sharing the KV head) walk the keys up to the tile's last position in spans of about 128
// (whole blocks); each span's keys are transposed once per tile into [D, keys], so a
// query's scores are D broadcast multiply-adds on whole vectors of keys (no horizontal
// sums), four query vectors at a time sharing each load; then one online-softmax update
// per query vector and span (running max; running sum as a vector) and the weighted
// values added, the four again sharing each value row. Other dtypes and head sizes: the
// scalar walk of attention_common.h, one query token at a time.
//
// Registered as torch.ops.carpool.paged_prefill.
#include "attention_common.h"

namespace {

using namespace carpool_attention;

constexpr int64_t kTileRows = 32;  // query rows per task

#ifdef CARPOOL_VECTOR
constexpr int64_t kQuad = 4;         // query vectors scored together
constexpr int64_t kSpanKeys = 128;   // keys per online-softmax update (whole blocks)

// Scores of kNum query vectors `qs` (kD floats each, pre-scaled) against `kt` [kD, P], a
// span's keys transposed (P a multiple of kWidth): into `scores` [kNum, P].
template <int64_t kD, int64_t kNum>
inline void score_span(const float* qs, const float* kt, int64_t P, float* scores) {
  for (int64_t j = 0; j < P; j += kWidth) {
    pfloat acc[kNum][2] = {};
    for (int64_t d = 0; d < kD; d += 2) {  // two partial sums a query: shorter chains
      const pfloat k0 = load<pfloat>(kt + d * P + j), k1 = load<pfloat>(kt + (d + 1) * P + j);
      for (int64_t i = 0; i < kNum; ++i) {
        acc[i][0] += splat<pfloat>(qs[i * kD + d]) * k0;
        acc[i][1] += splat<pfloat>(qs[i * kD + d + 1]) * k1;
      }
    }
    for (int64_t i = 0; i < kNum; ++i) store(scores + i * P + j, acc[i][0] + acc[i][1]);
  }
}

// The online-softmax update of kNum query vectors with a span's `scores` [kNum, P], of
// which query i uses its first valid[i] (>= 1): exp in place, the running max and the
// running sums (a vector per query, lanes summed at the end) updated, the accumulators
// `accs` [kNum, kD] rescaled and given the weighted value rows `rows[t]`.
template <int64_t kD, int64_t kNum>
inline void absorb_span(float* scores, int64_t P, const int64_t* valid,
                        const float* const* rows, float* maxes, float* sums, float* accs) {
  constexpr int64_t C = kD / kWidth;
  int64_t most = 0;
  pfloat acc[kNum][C];
  for (int64_t i = 0; i < kNum; ++i) {
    float* row = scores + i * P;
    float span_max = maxes[i];
    pfloat sum{};
    if (valid[i] == P) {  // every key of the span (all spans but the diagonal's): vectors
      pfloat m = splat<pfloat>(span_max);
      for (int64_t t = 0; t < P; t += kWidth) {
        const pfloat x = load<pfloat>(row + t);
        m = x > m ? x : m;
      }
      for (int64_t l = 0; l < kWidth; ++l) span_max = std::max(span_max, m[l]);
      const pfloat shift = splat<pfloat>(span_max);
      for (int64_t t = 0; t < P; t += kWidth) {
        const pfloat e = exp_nonpositive(load<pfloat>(row + t) - shift);
        store(row + t, e);
        sum += e;
      }
    } else {
      for (int64_t t = 0; t < valid[i]; ++t) span_max = std::max(span_max, row[t]);
      const pfloat shift = splat<pfloat>(span_max);
      for (int64_t t = 0; t < P; t += kWidth) {
        store(row + t, exp_nonpositive(load<pfloat>(row + t) - shift));
      }
      for (int64_t t = valid[i]; t < P; ++t) row[t] = 0.0f;  // adds nothing below
      for (int64_t t = 0; t < P; t += kWidth) sum += load<pfloat>(row + t);
    }
    const pfloat correction = splat<pfloat>(std::exp(maxes[i] - span_max));
    maxes[i] = span_max;
    store(sums + i * kWidth, load<pfloat>(sums + i * kWidth) * correction + sum);
    for (int64_t c = 0; c < C; ++c) acc[i][c] = load<pfloat>(accs + i * kD + c * kWidth) * correction;
    most = std::max(most, valid[i]);
  }
  for (int64_t t = 0; t < most; ++t) {
    pfloat v[C];
    for (int64_t c = 0; c < C; ++c) v[c] = load<pfloat>(rows[t] + c * kWidth);
    for (int64_t i = 0; i < kNum; ++i) {
      const pfloat weight = splat<pfloat>(scores[i * P + t]);
      for (int64_t c = 0; c < C; ++c) acc[i][c] += weight * v[c];
    }
  }
  for (int64_t i = 0; i < kNum; ++i) {
    for (int64_t c = 0; c < C; ++c) store(accs + i * kD + c * kWidth, acc[i][c]);
  }
}

// Scratch of one task of prefill_tile, in floats.
int64_t tile_work(const Shape& s, int64_t span_keys) {
  const int64_t vectors = kTileRows * s.group;
  const int64_t P = (span_keys + kWidth - 1) / kWidth * kWidth;
  return vectors * (2 * s.head_dim + 1 + kWidth) + s.head_dim * P + kQuad * P;
}

// Query rows [r0, r1) of the chunk, the query heads of KV head `kv_head` (file comment).
// Keys go in spans of `span_keys` (whole blocks): one softmax update per span.
// `work`: tile_work floats; `value_rows`: span_keys pointers (the caller's, per task).
template <int64_t kD>
void prefill_tile(const Shape& s, const float* query, const float* k_blocks,
                  const float* v_blocks, const int64_t* block_ids, int64_t num_cached,
                  int64_t r0, int64_t r1, int64_t kv_head, float scale, int64_t span_keys,
                  float* out, float* work, const float** value_rows) {
  const int64_t G = s.group, B = s.block_size;
  const int64_t token_stride = s.num_kv_heads * kD;
  const int64_t block_stride = B * token_stride;
  const int64_t span_p = (span_keys + kWidth - 1) / kWidth * kWidth;
  const int64_t num_vectors = (r1 - r0) * G;  // vector i: row r0 + i / G, head i % G
  float* qs = work;                            // [num_vectors, kD], scaled
  float* accs = qs + num_vectors * kD;         // [num_vectors, kD]
  float* maxes = accs + num_vectors * kD;      // [num_vectors]
  float* sums = maxes + num_vectors;           // [num_vectors, kWidth]
  float* kt = sums + num_vectors * kWidth;     // [kD, P] a span's keys, transposed
  float* scores = kt + kD * span_p;            // [kQuad, P]
  for (int64_t i = 0; i < num_vectors; ++i) {
    const int64_t head = kv_head * G + i % G;
    const float* q = query + ((r0 + i / G) * s.num_heads + head) * kD;
    for (int64_t d = 0; d < kD; ++d) qs[i * kD + d] = q[d] * scale;
  }
  std::fill(accs, accs + num_vectors * kD, 0.0f);
  std::fill(maxes, maxes + num_vectors, -std::numeric_limits<float>::infinity());
  std::fill(sums, sums + num_vectors * kWidth, 0.0f);
  const int64_t last = num_cached + r1 - 1;  // the tile's last position
  for (int64_t first_key = 0; first_key <= last; first_key += span_keys) {
    const int64_t num_keys = std::min(span_keys, last + 1 - first_key);
    const int64_t P = (num_keys + kWidth - 1) / kWidth * kWidth;
    for (int64_t t = 0; t < num_keys; ++t) {
      const int64_t key = first_key + t;
      const int64_t offset = block_ids[key / B] * block_stride + (key % B) * token_stride +
                             kv_head * kD;
      const float* k = k_blocks + offset;
      for (int64_t d = 0; d < kD; ++d) kt[d * P + t] = k[d];
      value_rows[t] = v_blocks + offset;
    }
    for (int64_t d = 0; d < kD; ++d) std::fill(kt + d * P + num_keys, kt + (d + 1) * P, 0.0f);
    // Rows whose position is before this span see none of it; rows are in position order.
    const int64_t first_row = std::max(r0, first_key - num_cached);
    int64_t valid[kQuad];
    int64_t i = (first_row - r0) * G;
    for (; i + kQuad <= num_vectors; i += kQuad) {
      for (int64_t j = 0; j < kQuad; ++j) {
        valid[j] = std::min(num_keys, num_cached + r0 + (i + j) / G + 1 - first_key);
      }
      score_span<kD, kQuad>(qs + i * kD, kt, P, scores);
      absorb_span<kD, kQuad>(scores, P, valid, value_rows, maxes + i,
                             sums + i * kWidth, accs + i * kD);
    }
    for (; i < num_vectors; ++i) {
      valid[0] = std::min(num_keys, num_cached + r0 + i / G + 1 - first_key);
      score_span<kD, 1>(qs + i * kD, kt, P, scores);
      absorb_span<kD, 1>(scores, P, valid, value_rows, maxes + i, sums + i * kWidth,
                         accs + i * kD);
    }
  }
  for (int64_t i = 0; i < num_vectors; ++i) {
    const int64_t head = kv_head * G + i % G;
    float* o = out + ((r0 + i / G) * s.num_heads + head) * kD;
    const float inverse = 1.0f / horizontal_sum(load<pfloat>(sums + i * kWidth));
    for (int64_t d = 0; d < kD; ++d) o[d] = accs[i * kD + d] * inverse;
  }
}

using Tile = void (*)(const Shape&, const float*, const float*, const float*, const int64_t*,
                      int64_t, int64_t, int64_t, int64_t, float, int64_t, float*, float*,
                      const float**);

Tile vector_tile(int64_t head_dim) {
  switch (head_dim) {
    case 32: return prefill_tile<32>;
    case 64: return prefill_tile<64>;
    case 128: return prefill_tile<128>;
    case 256: return prefill_tile<256>;
    default: return nullptr;
  }
}
#endif

template <typename T>
void run(const at::Tensor& query, const at::Tensor& k_blocks, const at::Tensor& v_blocks,
         const int64_t* ids, int64_t num_cached, double scale, at::Tensor& out) {
  const int64_t n = query.size(0);
  Shape s{query.size(1), k_blocks.size(2), query.size(1) / k_blocks.size(2), query.size(2),
          k_blocks.size(1), 0};
  const T* q = query.data_ptr<T>();
  const T* k = k_blocks.data_ptr<T>();
  const T* v = v_blocks.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t num_tiles = (n + kTileRows - 1) / kTileRows;
  const int64_t num_tasks = num_tiles * s.num_kv_heads;
  const int64_t D = s.head_dim, B = s.block_size, G = s.group;
#ifdef CARPOOL_VECTOR
  if constexpr (std::is_same_v<T, float>) {
    const Tile tile = vector_tile(D);
    if (tile != nullptr) {
      const int64_t span_keys = std::max<int64_t>(1, kSpanKeys / B) * B;
      const int64_t work_size = tile_work(s, span_keys);
      at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> work(work_size);
        std::vector<const float*> value_rows(span_keys);  // a span's value rows, per key
        for (int64_t task = begin; task < end; ++task) {
          const int64_t r0 = task / s.num_kv_heads * kTileRows;
          const int64_t r1 = std::min(n, r0 + kTileRows);
          tile(s, q, k, v, ids, num_cached, r0, r1, task % s.num_kv_heads,
               static_cast<float>(scale), span_keys, o, work.data(), value_rows.data());
        }
      });
      return;
    }
  }
#endif
  // Any dtype and head_dim: each query token walks its own context (attention_common.h).
  const int64_t work_size = attend_one_work(s);
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> work(work_size);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r0 = task / s.num_kv_heads * kTileRows;
      const int64_t r1 = std::min(n, r0 + kTileRows);
      const int64_t h = task % s.num_kv_heads;
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t head_offset = (r * s.num_heads + h * G) * D;
        attend_one<T>(s, q + head_offset, k + h * D, v + h * D, ids, num_cached + r + 1,
                      static_cast<T>(scale), o + head_offset, work.data());
      }
    }
  });
}

at::Tensor paged_prefill(const at::Tensor& query, const at::Tensor& k_blocks,
                         const at::Tensor& v_blocks, const at::Tensor& block_ids,
                         int64_t num_cached, double scale) {
  check_query_and_cache("paged_prefill", query, k_blocks, v_blocks);
  TORCH_CHECK(num_cached >= 0, "paged_prefill: num_cached must be >= 0, got ", num_cached);
  TORCH_CHECK(block_ids.dim() == 1, "paged_prefill: block_ids must be 1-D, got ",
              block_ids.sizes());
  const at::Tensor q = query.contiguous();
  const at::Tensor ids = block_ids.to(at::kLong).contiguous();
  const int64_t block_size = k_blocks.size(1);
  const int64_t needed = (num_cached + q.size(0) + block_size - 1) / block_size;
  TORCH_CHECK(ids.size(0) >= needed, "paged_prefill: ", num_cached + q.size(0),
              " positions need ", needed, " blocks, block_ids has ", ids.size(0));
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < needed; ++b) {
    TORCH_CHECK(id[b] >= 0 && id[b] < k_blocks.size(0), "paged_prefill: block ", b, " is ",
                id[b], ", expected 0 to ", k_blocks.size(0) - 1);
  }
  at::Tensor out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  switch (q.scalar_type()) {
    case at::kFloat:
      run<float>(q, k_blocks, v_blocks, id, num_cached, scale, out);
      break;
    case at::kDouble:
      run<double>(q, k_blocks, v_blocks, id, num_cached, scale, out);
      break;
    default:
      TORCH_CHECK(false, "paged_prefill: float32 or float64, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(carpool, m) {
  m.def("paged_prefill(Tensor query, Tensor k_blocks, Tensor v_blocks, Tensor block_ids, "
        "int num_cached, float scale) -> Tensor");
  m.impl("paged_prefill", c10::DispatchKey::CPU, TORCH_FN(paged_prefill));
}
