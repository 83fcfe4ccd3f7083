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
//   q [T, H, D] fp32 (sequences packed; its token rows may lie apart: a view of QKV), k_cache/v_cache
//   [num_blocks, block_size, KVH, D] (int8: D + 4), block_tables [S, M] int32, query_start_loc [S + 1] int32,
//   seq_lens [S] int32, scale  ->  out [T, H, D] fp32 (rows packed)
//
// Query i of sequence s sits at position seq_len - q_len + i and sees keys at positions <= its own.
//
//   one item's scratch; a row r = (head j of the group, query i) is r = j * kQueries + i, and rows go W to a group
//   (W: a vector's lanes, 8 on the 256-bit loops, 16 on the 512-bit ones: paged_prefill_loops.h)
//     qt [groups, D, W]   queries x scale, transposed: a group's W rows are the lanes of every vector
//     kb, vb [8, D]       a block's keys and values, widened to fp32
//     p  [groups, 8, W]   exp(s - m) of the block, key-major (lanes: rows)
//     o  [rows, D]        running sum of p v;   m, l [rows]: running max and sum of exp(s - m)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
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
#include "tandem_cpu.h"

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

// The item's loops, once per vector width (paged_prefill_loops.h): the same bits from either.
namespace avx2 {
using R = __m256;
using Mask = __m256;
constexpr int kW = 8;
constexpr int kScoreGroups = 1;  // groups scored at once: 8 accumulators a group, of 16 registers
inline R load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, R a) { _mm256_storeu_ps(p, a); }
inline R zero() { return _mm256_setzero_ps(); }
inline R set1(float x) { return _mm256_set1_ps(x); }
inline R bcast(const float* p) { return _mm256_broadcast_ss(p); }
inline R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
inline R mul(R a, R b) { return _mm256_mul_ps(a, b); }
inline R add(R a, R b) { return _mm256_add_ps(a, b); }
inline R sub(R a, R b) { return _mm256_sub_ps(a, b); }
inline R max(R a, R b) { return _mm256_max_ps(a, b); }
inline R min(R a, R b) { return _mm256_min_ps(a, b); }
inline R iota() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
inline Mask le(R a, R b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
inline Mask gt(R a, R b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline R select(Mask m, R if_false, R if_true) { return _mm256_blendv_ps(if_false, if_true, m); }
inline R keep(R a, Mask m) { return _mm256_and_ps(a, m); }
inline bool any(Mask m) { return _mm256_movemask_ps(m) != 0; }
inline R exp(R a) { return static_cast<__m256>(Vec(a).exp_u20()); }
#include "paged_prefill_loops.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")  // run only where cpu_isa.cpp found all three
namespace avx512 {
using R = __m512;
using Mask = __mmask16;
constexpr int kW = 16;
constexpr int kScoreGroups = 3;  // 24 accumulators, of 32 registers (the bundled model's 3 heads a KV head)
inline R load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, R a) { _mm512_storeu_ps(p, a); }
inline R zero() { return _mm512_setzero_ps(); }
inline R set1(float x) { return _mm512_set1_ps(x); }
inline R bcast(const float* p) { return _mm512_set1_ps(*p); }
inline R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
inline R mul(R a, R b) { return _mm512_mul_ps(a, b); }
inline R add(R a, R b) { return _mm512_add_ps(a, b); }
inline R sub(R a, R b) { return _mm512_sub_ps(a, b); }
inline R max(R a, R b) { return _mm512_max_ps(a, b); }
inline R min(R a, R b) { return _mm512_min_ps(a, b); }
inline R iota() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline Mask le(R a, R b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
inline Mask gt(R a, R b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline R select(Mask m, R if_false, R if_true) { return _mm512_mask_blend_ps(m, if_false, if_true); }
inline R keep(R a, Mask m) { return _mm512_maskz_mov_ps(m, a); }
inline bool any(Mask m) { return m != 0; }
#include "vec512_exp.h"
inline R exp(R a) { return exp_u20(a); }  // at::vec's exp_u20 on 16 lanes: the same bits
#include "paged_prefill_loops.h"
}  // namespace avx512
#pragma GCC pop_options

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
  const int64_t q_row = q.stride(0);
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  float* op = out.data_ptr<float>();
  // 512-bit vectors where the kernels' instruction set has them: 16 rows a group, half the instructions.
  const bool wide = tandem_cpu::isa() == tandem_cpu::Isa::kAvx512Vnni;
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    Scratch sc;
    for (int64_t w = next++; w < num_items; w = next++) {
      const Item& it = items[w];
      const int64_t q_len = qsl[it.s + 1] - qsl[it.s];
      const int32_t* table = block_tables.data_ptr<int32_t>() + it.s * block_tables.size(1);
      const int64_t i1 = std::min<int64_t>(q_len, it.i0 + kQueries), ctx = lens[it.s] - q_len;
      if (wide)
        avx512::attend_item<D, T>(qp, q_row, kp, vp, table, block_size, row_stride, it.g, num_heads, per_kv,
                                  qsl[it.s], ctx, it.i0, i1, scale, op, sc);
      else
        avx2::attend_item<D, T>(qp, q_row, kp, vp, table, block_size, row_stride, it.g, num_heads, per_kv,
                                qsl[it.s], ctx, it.i0, i1, scale, op, sc);
    }
  });
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                   const at::Tensor& seq_lens, double scale) {
  tandem_cpu::check_attention_inputs(q, k_cache, v_cache, /*strided_rows=*/true);
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
  at::Tensor out = at::empty(q.sizes(), q.options());  // packed rows, whatever q's stride
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
