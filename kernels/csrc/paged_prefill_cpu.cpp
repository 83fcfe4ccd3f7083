// Prefill attention on CPU straight from the paged KV cache: causal, each sequence's new queries after its cached
// tokens, flash-attention style (an online softmax over blocks of 8 keys, nothing of [queries, keys] stored).
//
// SDPA over K/V gathered from the cache (kernels/torch_paged.py) ran at ~25-45 GFLOP/s of causal work on two
// Zen 4 cores: it widens the whole gathered cache, and a prompt after a cached prefix needs an explicit mask,
// under which it computes every query against every key. Here a work item is (sequence, KV head, 16 queries):
// the query heads of the KV head share each key block (3 x 16 rows of scores against it), a key block is
// dequantized once per item straight from the cache (fp32, fp16 or int8 rows), and blocks past the item's last
// query are never read.
//
//   q [T, H, D] fp32 (sequences packed), k_cache/v_cache [num_blocks, block_size, KVH, D] (int8: D + 4),
//   block_tables [S, M] int32, query_start_loc [S + 1] int32, seq_lens [S] int32, scale  ->  out [T, H, D] fp32
//
// Query i of sequence s sits at position seq_len - q_len + i and sees keys at positions <= its own.
//
//   one item's scratch; a row r = (head j of the group, query i) is r = j * kQueries + i, and rows go 8 to a group
//     qt [groups, D, 8]   queries x scale, transposed: a group's 8 rows are the lanes of every vector
//     kb, vb [8, D]       a block's keys and values, widened to fp32
//     p  [groups, 8, 8]   exp(s - m) of the block, key-major (lanes: rows)
//     o  [rows, D]        running sum of p v;   m, l [rows]: running max and sum of exp(s - m)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "head_dispatch.h"

namespace {

using Vec = at::vec::Vectorized<float>;  // 8 lanes in this (AVX2) build
constexpr int64_t kKeys = 8;             // keys a block
constexpr int64_t kQueries = 16;         // queries an item
using tandem_cpu::head_row;

// One cache row of D values as fp32 into dst.
template <int64_t D, typename T>
inline void widen_row(const T* row, float* dst) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, row, D * sizeof(float));
  } else if constexpr (std::is_same_v<T, at::Half>) {
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
  } else {
    float scale;
    std::memcpy(&scale, row + D, sizeof(scale));
    const __m256 s = _mm256_set1_ps(scale);
    for (int64_t d = 0; d < D; d += 8) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d));
      _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s));
    }
  }
}

struct Scratch {
  std::vector<float> qt, kb, vb, p, o, m, l;
};

// Scores of 8 rows against a block's 8 keys, rows in lanes: s[t] = sum_d qt[d] k_t[d] (8 accumulators, one a key;
// each d loads the 8 rows' query values once and broadcasts each key's).
template <int64_t D>
inline void scores8(const float* qt, const float* kb, __m256 (&s)[kKeys]) {
  for (int64_t t = 0; t < kKeys; ++t) s[t] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 q = _mm256_loadu_ps(qt + d * 8);
    for (int64_t t = 0; t < kKeys; ++t) s[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(kb + t * D + d), q, s[t]);
  }
}

// o[r] += sum_t p[t][r] v_t for 8 rows at once: 8 independent FMA chains, each key's 8 values loaded once for
// the 8 rows (one chain a row would wait on the FMA latency at every key).
template <int64_t D>
inline void weigh8(const float* p, const float* vb, float* o) {
  for (int64_t d = 0; d < D; d += 8) {
    __m256 acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_loadu_ps(o + r * D + d);
    for (int64_t t = 0; t < kKeys; ++t) {
      const __m256 v = _mm256_loadu_ps(vb + t * D + d);
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + t * 8 + r), v, acc[r]);
    }
    for (int r = 0; r < 8; ++r) _mm256_storeu_ps(o + r * D + d, acc[r]);
  }
}

// One item: queries [i0, i1) of a sequence (its block table at `table`, `ctx` tokens before its first query) for
// the KV head g's per_kv query heads. Rows go 8 to a group (lanes of the scores and of the softmax state); a
// group's rows are one head's queries i0 + 8h .. i0 + 8h + 7 (rows past i1 compute and are never written).
template <int64_t D, typename T>
void attend_item(const float* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t block_size,
                 int64_t row_stride, int64_t g, int64_t num_heads, int64_t per_kv, int64_t q_start, int64_t ctx,
                 int64_t i0, int64_t i1, float scale, float* out, Scratch& sc) {
  constexpr int64_t kGroupsPerHead = kQueries / 8;
  const int64_t rows = per_kv * kQueries, groups = rows / 8, n = i1 - i0;
  const int64_t last_key = ctx + i1 - 1;  // the item's last query sees keys up to here
  sc.qt.assign(rows * D, 0.f);
  sc.o.assign(rows * D, 0.f);
  sc.p.resize(groups * kKeys * 8);
  sc.kb.resize(kKeys * D);
  sc.vb.resize(kKeys * D);
  sc.m.assign(rows, -1e30f);  // finite: exp(m_old - m_new) is then 0, not NaN, at the first block
  sc.l.assign(rows, 0.f);
  for (int64_t j = 0; j < per_kv; ++j)
    for (int64_t i = 0; i < n; ++i) {
      const float* src = q + ((q_start + i0 + i) * num_heads + g * per_kv + j) * D;
      const int64_t r = j * kQueries + i;
      float* dst = sc.qt.data() + (r / 8) * D * 8 + r % 8;  // [group][d][lane]
      for (int64_t d = 0; d < D; ++d) dst[d * 8] = src[d] * scale;
    }
  const int64_t col = g * head_row<T>(D);
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t k0 = 0; k0 <= last_key; k0 += kKeys) {
    const int64_t nk = std::min<int64_t>(kKeys, last_key + 1 - k0);
    for (int64_t t = 0; t < kKeys; ++t) {
      if (t < nk) {
        const int64_t pos = k0 + t;
        const int64_t slot = static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
        widen_row<D, T>(k_cache + slot * row_stride + col, sc.kb.data() + t * D);
        widen_row<D, T>(v_cache + slot * row_stride + col, sc.vb.data() + t * D);
      } else {
        std::fill_n(sc.kb.data() + t * D, D, 0.f);
        std::fill_n(sc.vb.data() + t * D, D, 0.f);
      }
    }
    for (int64_t grp = 0; grp < groups; ++grp) {
      __m256 s[kKeys];
      scores8<D>(sc.qt.data() + grp * D * 8, sc.kb.data(), s);
      // Each lane's query position; a row past the item's queries sees every key of the item (harmless, unused).
      const int64_t first = ctx + i0 + (grp % kGroupsPerHead) * 8;
      const __m256 pos = _mm256_min_ps(_mm256_add_ps(_mm256_set1_ps(static_cast<float>(first)), lane),
                                       _mm256_set1_ps(static_cast<float>(last_key)));
      __m256 seen[kKeys];
      __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < kKeys; ++t) {
        const float key = static_cast<float>(t < nk ? k0 + t : last_key + 1);  // padding keys: seen by none
        seen[t] = _mm256_cmp_ps(_mm256_set1_ps(key), pos, _CMP_LE_OQ);
        top = _mm256_max_ps(top, _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()), s[t],
                                                  seen[t]));
      }
      float* m = sc.m.data() + grp * 8;
      const __m256 m_old = _mm256_loadu_ps(m), m_new = _mm256_max_ps(m_old, top);
      const __m256 rose = _mm256_cmp_ps(m_new, m_old, _CMP_GT_OQ);  // alpha exactly 1 where the max stayed
      const __m256 alpha = _mm256_blendv_ps(_mm256_set1_ps(1.f),
                                            static_cast<__m256>((Vec(m_old) - Vec(m_new)).exp_u20()), rose);
      __m256 sum = _mm256_setzero_ps();
      float* p = sc.p.data() + grp * kKeys * 8;
      for (int64_t t = 0; t < kKeys; ++t) {  // unseen lanes zeroed after the exp (bitwise), whatever it made
        const __m256 e = _mm256_and_ps(static_cast<__m256>((Vec(s[t]) - Vec(m_new)).exp_u20()), seen[t]);
        _mm256_storeu_ps(p + t * 8, e);
        sum = _mm256_add_ps(sum, e);
      }
      float* l = sc.l.data() + grp * 8;
      _mm256_storeu_ps(l, _mm256_fmadd_ps(_mm256_loadu_ps(l), alpha, sum));
      _mm256_storeu_ps(m, m_new);
      // Rows whose max rose scale what they hold by alpha before this block adds to it.
      if (_mm256_movemask_ps(rose) != 0) {
        alignas(32) float a[8];
        _mm256_store_ps(a, alpha);
        for (int r = 0; r < 8; ++r) {
          if (a[r] == 1.f) continue;
          float* o = sc.o.data() + (grp * 8 + r) * D;
          const __m256 ar = _mm256_set1_ps(a[r]);
          for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), ar));
        }
      }
      weigh8<D>(p, sc.vb.data(), sc.o.data() + grp * 8 * D);
    }
  }
  for (int64_t j = 0; j < per_kv; ++j)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = j * kQueries + i;
      const __m256 inv = _mm256_set1_ps(1.f / sc.l[r]);  // l >= 1: the row's largest score adds exp(0)
      float* dst = out + ((q_start + i0 + i) * num_heads + g * per_kv + j) * D;
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(sc.o.data() + r * D + d), inv));
    }
}

template <int64_t D, typename T>
void prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
             const at::Tensor& query_start_loc, const at::Tensor& seq_lens, float scale, at::Tensor& out) {
  const int64_t num_seqs = seq_lens.size(0), num_heads = q.size(1), kv_heads = k_cache.size(2);
  const int64_t per_kv = num_heads / kv_heads, block_size = k_cache.size(1), row_stride = kv_heads * head_row<T>(D);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  // Items: (sequence, KV head, 16 queries). A causal item's work grows with its last query's position, so the
  // threads take them longest first from a shared counter (a static split would give one thread the late ones).
  struct Item { int64_t s, g, i0, keys; };
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[s], "sequence ", s, ": ", q_len, " queries for ", lens[s], " tokens");
    TORCH_CHECK(lens[s] <= block_tables.size(1) * block_size, "sequence ", s, " is longer than its block table");
    for (int64_t g = 0; g < kv_heads; ++g)
      for (int64_t i0 = 0; i0 < q_len; i0 += kQueries)
        items.push_back({s, g, i0, lens[s] - q_len + std::min<int64_t>(q_len, i0 + kQueries)});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.keys > b.keys; });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    Scratch sc;
    for (int64_t w = next++; w < num_items; w = next++) {
      const Item& it = items[w];
      const int64_t q_len = qsl[it.s + 1] - qsl[it.s];
      attend_item<D, T>(qp, kp, vp, block_tables.data_ptr<int32_t>() + it.s * block_tables.size(1), block_size,
                        row_stride, it.g, num_heads, per_kv, qsl[it.s], lens[it.s] - q_len, it.i0,
                        std::min<int64_t>(q_len, it.i0 + kQueries), scale, op, sc);
    }
  });
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                   const at::Tensor& seq_lens, double scale) {
  tandem_cpu::check_attention_inputs(q, k_cache, v_cache);
  const at::ScalarType cache_type = k_cache.scalar_type();
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt, "int32 tables, query starts and lengths only");
  TORCH_CHECK(block_tables.is_contiguous() && query_start_loc.is_contiguous() && seq_lens.is_contiguous(),
              "contiguous tensors only");
  TORCH_CHECK(query_start_loc.numel() == seq_lens.numel() + 1 && block_tables.size(0) == seq_lens.numel(),
              "one block table and length a sequence, one more query start");
  const int32_t queries_end = query_start_loc.data_ptr<int32_t>()[seq_lens.numel()];
  TORCH_CHECK(seq_lens.numel() == 0 || queries_end == q.size(0), "the query starts end at ", queries_end,
              ", not at q's ", q.size(0), " rows");
  at::Tensor out = at::empty_like(q);
  const float fscale = static_cast<float>(scale);
  tandem_cpu::with_head_and_cache(q.size(2), cache_type, [&](auto d, auto t) {
    prefill<decltype(d)::value, decltype(t)>(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, fscale,
                                             out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
