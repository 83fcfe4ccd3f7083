// Decode attention on CPU straight from the paged KV cache: one query token per sequence.
//
// One work item per (sequence, KV head): the query heads sharing that KV head are scored together,
// so every K and V row of the sequence is read from memory once (the torch path copies K out of the
// cache before scoring it, and its V pass reads each row once per query head). Scores are kept in
// fp32 and softmaxed with the row max subtracted; items run on the step's thread team (else ATen's
// intra-op pool), each thread taking the longest left next. The loops over tokens (paged_decode_loops.h)
// are built for 256-bit and 512-bit vectors and follow the kernels' instruction set (cpu_isa.cpp); the
// softmax is written with ATen's own vector types (at::vec), as PyTorch's CPU attention kernels are.
//
//   q [B, H, D] fp32 (its rows may lie apart: a view of QKV), k_cache/v_cache [num_blocks, block_size, KVH, D]
//   fp32 or fp16, block_tables [B, M] int32, seq_lens [B] int32, scale  ->  out [B, H, D] fp32
//
// An int8 cache is [num_blocks, block_size, KVH, D + 4]: each head row holds D values quantized symmetrically
// (x ~ q * scale, scale = max|x| / 127) and then its scale as 4 bytes of fp32, so a block is still one run of
// bytes (the KV transports and the prefix cache move it unchanged) at 68 bytes a row of 64 instead of fp16's 128.
// Scores take each token's K scale once for its 8-token sums; the value pass folds V's scale into the weight.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <cstring>
#include <cstdint>
#include <immintrin.h>
#include <type_traits>
#include <vector>

#include "head_dispatch.h"
#include "tandem_cpu.h"
#include "thread_team.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kMaxHeadsPerKV = 16;

struct Shape {
  int64_t num_heads, kv_heads, per_kv, block_size, max_blocks, row_stride, head_stride;  // strides in elements
};

constexpr int64_t kScaleBytes = tandem_cpu::kInt8RowScaleBytes;  // after a head row's D values

// The scale of the int8 head row starting at `row` (unaligned: rows are D + 4 bytes).
template <int64_t D>
inline float row_scale(const int8_t* row) {
  float scale;
  std::memcpy(&scale, row + D, sizeof(scale));
  return scale;
}

using tandem_cpu::head_row;

// The 8 horizontal sums of a[0..7], as one vector (lane t = sum of a[t]).
inline __m256 sum8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// In place: scores -> exp(scores - max); returns 1 / sum, and the max in *max_out.
float softmax_numerators(float* x, int64_t len, float* max_out) {
  const float max = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x, len);
  *max_out = max;
  Vec sum(0.f);
  int64_t t = 0;
  for (; t + Vec::size() <= len; t += Vec::size()) {
    Vec e = (Vec::loadu(x + t) - Vec(max)).exp_u20();
    e.store(x + t);
    sum = sum + e;
  }
  float total = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
  if (t < len) {
    Vec e = (Vec::loadu(x + t, len - t) - Vec(max)).exp_u20();
    e.store(x + t, len - t);
    float tail[Vec::size()] = {};
    e.store(tail, len - t);
    for (int64_t i = 0; i < len - t; ++i) total += tail[i];
  }
  return 1.f / total;
}

// What a work item's fetcher brings in ahead of its loops (the blocks of a sequence lie anywhere in the cache, so
// the hardware prefetcher cannot run ahead across them).
enum class Reach {
  kHead,     // its own head's rows of each block (a unit of one KV head; every unit on the 512-bit path)
  kBlock,    // each block whole, every KV head's rows: one run of bytes (the first head of a unit that takes all)
  kNothing,  // a later head of such a unit: its rows came with the first head's
};

template <_mm_hint kHint, typename T>
__attribute__((always_inline)) inline void prefetch_block(const T* cache, int32_t block, const Shape& s, int64_t col,
                                                          Reach reach) {
  const char* start = reinterpret_cast<const char*>(cache + block * s.block_size * s.row_stride);
  const int64_t row_bytes = s.row_stride * static_cast<int64_t>(sizeof(T));
  if (reach == Reach::kBlock) {
    for (int64_t b = 0; b < s.block_size * row_bytes; b += 64) _mm_prefetch(start + b, kHint);
    return;
  }
  const char* row = start + col * static_cast<int64_t>(sizeof(T));
  const int64_t head_bytes = s.head_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t r = 0; r < s.block_size; ++r, row += row_bytes)
    for (int64_t b = 0; b < head_bytes; b += 64) _mm_prefetch(row + b, kHint);
}

// A work item's blocks fetched ahead of the loops over them: its K blocks for the score pass, then its V blocks
// for the value pass, as one run, kBlocksAhead blocks along it. One block ahead (16 rows, ~30 ns of work against a
// miss of ~100+ ns) left attention waiting on memory: batch 8 of 150 tokens ran in ~17 us from cache and ~60 from
// memory.
//
// The 256-bit path fetches into L2, and a unit that takes all KV heads fetches each block whole with its first head
// (one run of ~50 lines, not 3 x 16 pieces of rows): a block is more lines than L1 has misses in flight, and the
// loops' reads then come from L2 (~15 cycles) without waiting. On a 2-core AVX2 EPYC, 30 layers' attention alone,
// in-process A/B, blocks shuffled: batch 20 of 560 tokens 17.6 -> 14.8 ms into L2 head by head, 14.6 whole; batch 8
// of 1,500 -17%, batch 2 of 800 -16%, batch 8 of 150 -7%; engine decode steps -6 to -11%. The 512-bit path keeps
// its heads' rows into L1: on a Zen 5 host its loops ran 73-92 us against ~55 at batch 8 of 150 tokens into L2.
constexpr int64_t kBlocksAhead = 2;

template <typename T>
struct BlockFetcher {
  const T *k_cache, *v_cache;
  const int32_t* table;
  int64_t blocks;  // the item's, in each cache
  const Shape& s;
  int64_t col;  // the head's first element in a row
  Reach reach;
  bool into_l2;

  __attribute__((always_inline)) void fetch(const T* cache, int32_t block) const {
    if (into_l2) prefetch_block<_MM_HINT_T1>(cache, block, s, col, reach);
    else prefetch_block<_MM_HINT_T0>(cache, block, s, col, reach);
  }
  void start() const {
    if (reach == Reach::kNothing) return;
    for (int64_t b = 0; b < std::min(kBlocksAhead, blocks); ++b) fetch(k_cache, table[b]);
  }
  // Block `at` of the K pass (value false) or the V pass is starting. Always inlined, as is prefetch_block: called
  // out of line from the 512-bit loops the same fetches cost 10-15 us more a batch-8 call.
  __attribute__((always_inline)) void reached(bool value, int64_t at) const {
    if (reach == Reach::kNothing) return;
    const int64_t ahead = (value ? blocks : 0) + at + kBlocksAhead;
    if (ahead < blocks) fetch(k_cache, table[ahead]);
    else if (ahead < 2 * blocks) fetch(v_cache, table[ahead - blocks]);
  }
};

// max |x[i]| over n values, n a multiple of 8 (0 for all zeros).
inline float abs_max(const float* x, int64_t n) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 top = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float most = 0.f;
  for (const float l : lanes) most = std::max(most, l);
  return most;
}

// The queries of a group rounded to int16 (15 bits a head: the largest value to 32767), with each head's scale.
// On 8 lanes: cvtps rounds to nearest even as std::nearbyint does under the default rounding mode, so the integers
// are the scalar loop's (which, a call to nearbyint a value, was ~8% of a batch-8 call at 170 tokens).
template <int64_t D>
void round_queries(const float* q_scaled, int64_t per_kv, int16_t (*rounded)[D], float* q_scale) {
  static_assert(D % 16 == 0, "two registers of 8 a pack");
  for (int64_t j = 0; j < per_kv; ++j) {
    const float* qj = q_scaled + j * D;
    const float top = abs_max(qj, D);
    q_scale[j] = top / 32767.f;
    const __m256 inv = _mm256_set1_ps(top > 0.f ? 32767.f / top : 0.f);
    for (int64_t d = 0; d < D; d += 16) {
      const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(qj + d), inv));
      const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(qj + d + 8), inv));
      // packs works within 128-bit lanes: (lo 0-3, hi 0-3, lo 4-7, hi 4-7), put back in order.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rounded[j] + d), packed);
    }
  }
}

// The loops over a sequence's cached tokens, once per vector width. A cache row's values load as fp32: the
// cache holds fp32, fp16 (half the bytes a step reads; F16C widens them exactly) or int8 (widened exactly; the
// row's scale is applied by the loops).
namespace avx2 {
using R = __m256;
constexpr int64_t kW = 8;
constexpr int kHeadsAtOnce = 3;  // 3 * (4 + 1) + 1 = 16 registers
inline R load(const float* p) { return _mm256_loadu_ps(p); }
inline R load(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline R load(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline R zero() { return _mm256_setzero_ps(); }
inline R mul(R a, R b) { return _mm256_mul_ps(a, b); }
inline R add(R a, R b) { return _mm256_add_ps(a, b); }
inline R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
inline R broadcast(float x) { return _mm256_set1_ps(x); }
inline void store(float* p, R a) { _mm256_storeu_ps(p, a); }
inline __m256 fold(R a) { return a; }
#include "paged_decode_loops.h"

// The 8 horizontal sums of a[0..7] in int32, as sum8 adds floats (lane t = sum of a[t]).
inline __m256i sum8_epi32(const __m256i* a) {
  const __m256i s01 = _mm256_hadd_epi32(a[0], a[1]), s23 = _mm256_hadd_epi32(a[2], a[3]);
  const __m256i s45 = _mm256_hadd_epi32(a[4], a[5]), s67 = _mm256_hadd_epi32(a[6], a[7]);
  const __m256i s0123 = _mm256_hadd_epi32(s01, s23), s4567 = _mm256_hadd_epi32(s45, s67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20),
                          _mm256_permute2x128_si256(s0123, s4567, 0x31));
}

// score() for an int8 cache in integers, as the 512-bit loops score it: the group's queries rounded to int16
// (round_queries), 16 K values widened to int16 a register, and one vpmaddwd a 16 products (the float path: a
// widening and a conversion for each 8 values and an FMA each 8 products). A token's whole dot product is summed
// in int32 (at most D x 127 x 32767 < 2^31 for D <= 256), converted once and scaled as
// avx512::score_int8_columns does it. Batch 16 at 1,500 tokens, attention alone: -21 to -25% (bench_decode_attention).
template <int64_t D>
void score_int8(const float* q_scaled, const int8_t* k_cache, const int32_t* table, int64_t len, const Shape& s,
                int64_t g, float* scores, int64_t stride, const BlockFetcher<int8_t>& fetch) {
  static_assert(D % 16 == 0, "16 int16 values a register");
  constexpr int64_t kChunks = D / 16;
  alignas(32) int16_t rounded[kMaxHeadsPerKV][D];
  float q_scale[kMaxHeadsPerKV];
  round_queries<D>(q_scaled, s.per_kv, rounded, q_scale);
  alignas(32) __m256i partial[kMaxHeadsPerKV][8];
  alignas(32) float k_scale[8] = {};
  for (int64_t t0 = 0; t0 < len; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, len - t0);
    each_key_row(k_cache, table, t0, n, s, g, fetch, [&](int64_t i, const int8_t* k) {
      k_scale[i] = row_scale<D>(k);
      __m256i kv[kChunks];
      for (int64_t c = 0; c < kChunks; ++c)
        kv[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + 16 * c)));
      for (int64_t j = 0; j < s.per_kv; ++j) {
        const __m256i* qj = reinterpret_cast<const __m256i*>(rounded[j]);
        __m256i acc = _mm256_madd_epi16(kv[0], _mm256_load_si256(qj));
        for (int64_t c = 1; c < kChunks; ++c)
          acc = _mm256_add_epi32(acc, _mm256_madd_epi16(kv[c], _mm256_load_si256(qj + c)));
        partial[j][i] = acc;
      }
    });
    for (int64_t j = 0; j < s.per_kv; ++j) {
      for (int64_t i = n; i < 8; ++i) partial[j][i] = _mm256_setzero_si256();
      const __m256 scales = _mm256_mul_ps(_mm256_load_ps(k_scale), _mm256_set1_ps(q_scale[j]));
      _mm256_storeu_ps(scores + j * stride + t0, _mm256_mul_ps(_mm256_cvtepi32_ps(sum8_epi32(partial[j])), scales));
    }
  }
}
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")  // run only where cpu_isa.cpp found all three
namespace avx512 {
using R = __m512;
constexpr int64_t kW = 16;
constexpr int kHeadsAtOnce = 4;  // 4 * (4 + 1) + 1 = 21 of 32 registers
inline R load(const float* p) { return _mm512_loadu_ps(p); }
inline R load(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline R load(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline R zero() { return _mm512_setzero_ps(); }
inline R mul(R a, R b) { return _mm512_mul_ps(a, b); }
inline R add(R a, R b) { return _mm512_add_ps(a, b); }
inline R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
inline R broadcast(float x) { return _mm512_set1_ps(x); }
inline void store(float* p, R a) { _mm512_storeu_ps(p, a); }
inline __m256 fold(R a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#include "paged_decode_loops.h"
#include "vec512_exp.h"

// softmax_numerators on 16 lanes.
inline float softmax_numerators(float* x, int64_t len, float* max_out) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(x + t));
  const __mmask16 tail = static_cast<__mmask16>((1u << (len - t)) - 1);
  top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, x + t));
  const float max = _mm512_reduce_max_ps(top);
  *max_out = max;
  const __m512 vmax = _mm512_set1_ps(max);
  __m512 sum = _mm512_setzero_ps();
  for (t = 0; t + 16 <= len; t += 16) {
    const __m512 e = exp_u20(_mm512_sub_ps(_mm512_loadu_ps(x + t), vmax));
    _mm512_storeu_ps(x + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 e = exp_u20(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + t), vmax));
  _mm512_mask_storeu_ps(x + t, tail, e);
  sum = _mm512_mask_add_ps(sum, tail, sum, e);
  return 1.f / _mm512_reduce_add_ps(sum);
}

// score() for an int8 cache, in integers: the group's queries are rounded to int16 (15 bits a head, against
// K's 8: adding ~1e-5 of the query's largest value), and one vpdpwssd multiplies 32 K values by them and adds
// pairs into 16 int32 lanes. A token's K row takes one widening a 32 values (the float path: a widening and a
// conversion a 16) and each head two instructions where it took five. Lane sums stay below 2^31 (2 x D / 32
// products of at most 127 x 32767 each) and, for D <= 128, below 2^24, so converting them is exact.
template <int64_t D>
void score_int8(const float* q_scaled, const int8_t* k_cache, const int32_t* table, int64_t len, const Shape& s,
                int64_t g, float* scores, int64_t stride, const BlockFetcher<int8_t>& fetch) {
  static_assert(D % 32 == 0, "32 int16 values a register");
  constexpr int64_t kChunks = D / 32;
  alignas(64) int16_t rounded[kMaxHeadsPerKV][D];
  float q_scale[kMaxHeadsPerKV];
  round_queries<D>(q_scaled, s.per_kv, rounded, q_scale);
  __m512i q16[kMaxHeadsPerKV][kChunks];
  for (int64_t j = 0; j < s.per_kv; ++j)
    for (int64_t c = 0; c < kChunks; ++c) q16[j][c] = _mm512_load_si512(rounded[j] + 32 * c);
  alignas(32) __m256 partial[kMaxHeadsPerKV][8];
  alignas(32) float k_scale[8] = {};
  for (int64_t t0 = 0; t0 < len; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, len - t0);
    each_key_row(k_cache, table, t0, n, s, g, fetch, [&](int64_t i, const int8_t* k) {
      k_scale[i] = row_scale<D>(k);
      __m512i kv[kChunks];
      for (int64_t c = 0; c < kChunks; ++c)
        kv[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + 32 * c)));
      for (int64_t j = 0; j < s.per_kv; ++j) {
        __m512i acc = _mm512_madd_epi16(kv[0], q16[j][0]);
        for (int64_t c = 1; c < kChunks; ++c) acc = _mm512_dpwssd_epi32(acc, kv[c], q16[j][c]);
        partial[j][i] = fold(_mm512_cvtepi32_ps(acc));
      }
    });
    for (int64_t j = 0; j < s.per_kv; ++j) {
      for (int64_t i = n; i < 8; ++i) partial[j][i] = _mm256_setzero_ps();
      const __m256 scales = _mm256_mul_ps(_mm256_load_ps(k_scale), _mm256_set1_ps(q_scale[j]));
      _mm256_storeu_ps(scores + j * stride + t0, _mm256_mul_ps(sum8(partial[j]), scales));
    }
  }
}

// 16 rows of 16 dwords, a register each, half transposed: after this, r[4i + k]'s 128-bit lane L holds dword
// 4L + k of rows 4i .. 4i + 3 (unpacks within lanes); column_sums finishes each column across the lanes.
inline void transpose16_in_lanes(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
}

// kH heads' (from head j0) int32 sums for 16 tokens whose rows start at `rows`, `row_bytes` apart: each dword
// column c of the rows (values 4c .. 4c + 3 of 16 tokens) split into its even and odd values as int16 pairs, each
// meeting the heads' matching query pairs in one vpdpwssd.
template <int64_t D, int kH>
inline void column_sums(const int8_t* rows, int64_t row_bytes, const int32_t (*q_even)[D / 4],
                        const int32_t (*q_odd)[D / 4], int64_t j0, __m512i* acc) {
  // Two sums a head, the even values' and the odd's: one chain of 2 x D / 4 vpdpwssd a head waited on each result
  // in turn (integers: the same sums in either order).
  __m512i sum_even[kH], sum_odd[kH];
  for (int j = 0; j < kH; ++j) sum_even[j] = sum_odd[j] = _mm512_setzero_si512();
  for (int64_t c0 = 0; c0 < D / 4; c0 += 16) {
    __m512i r[16];
    for (int t = 0; t < 16; ++t) r[t] = _mm512_loadu_si512(rows + t * row_bytes + 4 * c0);
    transpose16_in_lanes(r);
    for (int k = 0; k < 4; ++k) {
      const __m512i v0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44), v1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
      const __m512i w0 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
      const __m512i w1 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
      const __m512i cols[4] = {_mm512_shuffle_i32x4(v0, w0, 0x88), _mm512_shuffle_i32x4(v0, w0, 0xDD),
                               _mm512_shuffle_i32x4(v1, w1, 0x88), _mm512_shuffle_i32x4(v1, w1, 0xDD)};
      for (int L = 0; L < 4; ++L) {  // column 4L + k: lane t holds row t's dword
        const int64_t c = c0 + 4 * L + k;
        const __m512i even = _mm512_srai_epi16(_mm512_slli_epi16(cols[L], 8), 8);
        const __m512i odd = _mm512_srai_epi16(cols[L], 8);
        for (int j = 0; j < kH; ++j) {
          sum_even[j] = _mm512_dpwssd_epi32(sum_even[j], even, _mm512_set1_epi32(q_even[j0 + j][c]));
          sum_odd[j] = _mm512_dpwssd_epi32(sum_odd[j], odd, _mm512_set1_epi32(q_odd[j0 + j][c]));
        }
      }
    }
  }
  for (int j = 0; j < kH; ++j) acc[j] = _mm512_add_epi32(sum_even[j], sum_odd[j]);
}

// score_int8 16 tokens at a time, tokens in lanes: each 16 rows of K (64 values at a time) are transposed in
// registers so that one vpdpwssd adds 2 products to each of 16 tokens' sums (the row-major loop adds 32 products to
// one token's and then sums its lanes), for up to 4 of the group's heads at once. A token's whole dot product is
// summed in int32 (at most D x 128 x 32767 < 2^31 for D <= 256) and converted once. For blocks of a multiple of 16
// tokens (rows past a sequence's end lie in its last block: read, never stored).
template <int64_t D>
void score_int8_columns(const float* q_scaled, const int8_t* k_cache, const int32_t* table, int64_t len,
                        const Shape& s, int64_t g, float* scores, int64_t stride, const BlockFetcher<int8_t>& fetch) {
  static_assert(D % 64 == 0, "64 int8 values a row register");
  constexpr int64_t kCols = D / 4;  // dwords of a row: 4 values each
  alignas(64) int16_t rounded[kMaxHeadsPerKV][D];
  float q_scale[kMaxHeadsPerKV];
  round_queries<D>(q_scaled, s.per_kv, rounded, q_scale);
  // Dword c of a row (values 4c .. 4c + 3): its even values meet (q[4c], q[4c + 2]), its odd (q[4c+1], q[4c+3]).
  int32_t q_even[kMaxHeadsPerKV][kCols], q_odd[kMaxHeadsPerKV][kCols];
  const auto pack = [](int16_t lo, int16_t hi) {
    return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(lo)) |
                                static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16);
  };
  for (int64_t j = 0; j < s.per_kv; ++j)
    for (int64_t c = 0; c < kCols; ++c) {
      q_even[j][c] = pack(rounded[j][4 * c], rounded[j][4 * c + 2]);
      q_odd[j][c] = pack(rounded[j][4 * c + 1], rounded[j][4 * c + 3]);
    }
  const int64_t row_bytes = s.row_stride;  // int8: bytes
  const __m512i scale_at = _mm512_add_epi32(
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int32_t>(row_bytes))),
      _mm512_set1_epi32(static_cast<int32_t>(D)));  // each row's scale, after its D values
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t block = t0 / s.block_size, offset = t0 % s.block_size, n = std::min<int64_t>(16, len - t0);
    if (offset == 0) fetch.reached(false, block);
    const int8_t* rows = k_cache + (table[block] * s.block_size + offset) * s.row_stride + g * s.head_stride;
    __m512i acc[kMaxHeadsPerKV];
    for (int64_t j0 = 0; j0 < s.per_kv; j0 += 4) {
      switch (std::min<int64_t>(4, s.per_kv - j0)) {
        case 4: column_sums<D, 4>(rows, row_bytes, q_even, q_odd, j0, acc + j0); break;
        case 3: column_sums<D, 3>(rows, row_bytes, q_even, q_odd, j0, acc + j0); break;
        case 2: column_sums<D, 2>(rows, row_bytes, q_even, q_odd, j0, acc + j0); break;
        default: column_sums<D, 1>(rows, row_bytes, q_even, q_odd, j0, acc + j0); break;
      }
    }
    const __m512 k_scale = _mm512_i32gather_ps(scale_at, rows, 1);
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t j = 0; j < s.per_kv; ++j) {
      const __m512 scales = _mm512_mul_ps(k_scale, _mm512_set1_ps(q_scale[j]));
      _mm512_mask_storeu_ps(scores + j * stride + t0, valid, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[j]), scales));
    }
  }
}
}  // namespace avx512
#pragma GCC pop_options

// With fewer (sequence, KV head) items than the threads can share evenly (batch 1 or 2), each sequence is cut
// into this many token ranges, each attended alone and then merged by its softmax maximum and sum (as
// flash-decoding does on GPUs); ranges are whole blocks of at least kMinSplitTokens.
constexpr int64_t kMinSplitTokens = 128, kMaxSplits = 64;

int64_t token_splits(int64_t items, int64_t max_len) {
  const int64_t threads = tandem_cpu::num_threads();
  if (threads <= 1 || items >= 2 * threads) return 1;
  const int64_t want = (2 * threads + items - 1) / items;
  return std::max<int64_t>(1, std::min({want, max_len / kMinSplitTokens, kMaxSplits}));
}

// One (sequence, KV head, token range) into out_g [per_kv, D] (normalized within the range), with each query
// head's softmax maximum and sum where asked (a range of a split sequence).
template <int64_t D, typename T>
void attend_range(const float* q_scaled, const T* kp, const T* vp, const int32_t* table, int64_t len, const Shape& s,
                  int64_t g, Reach reach, bool wide, std::vector<float>& scores, float* out_g, float* max_out,
                  float* sum_out) {
  const int64_t stride = (len + Vec::size() - 1) / Vec::size() * Vec::size();
  scores.resize(s.per_kv * stride);
  float inv_sum[kMaxHeadsPerKV], max[kMaxHeadsPerKV];
  const int64_t blocks = (len + s.block_size - 1) / s.block_size;
  const BlockFetcher<T> fetch{kp, vp, table, blocks, s, g * s.head_stride, reach, !wide};
  fetch.start();
  const auto row_major = [&] {  // a token's row at a time
    if constexpr (std::is_same_v<T, int8_t> && D % 32 == 0) {
      if (wide) avx512::score_int8<D>(q_scaled, kp, table, len, s, g, scores.data(), stride, fetch);
      else avx2::score_int8<D>(q_scaled, kp, table, len, s, g, scores.data(), stride, fetch);
    } else {
      if (wide) avx512::score<D, T>(q_scaled, kp, table, len, s, g, scores.data(), stride, fetch);
      else avx2::score<D, T>(q_scaled, kp, table, len, s, g, scores.data(), stride, fetch);
    }
  };
  if constexpr (std::is_same_v<T, int8_t> && D % 64 == 0) {
    if (wide && s.block_size % 16 == 0)
      avx512::score_int8_columns<D>(q_scaled, kp, table, len, s, g, scores.data(), stride, fetch);
    else
      row_major();
  } else {
    row_major();
  }
  for (int64_t j = 0; j < s.per_kv; ++j)
    inv_sum[j] = wide ? avx512::softmax_numerators(scores.data() + j * stride, len, &max[j])
                      : softmax_numerators(scores.data() + j * stride, len, &max[j]);
  if (wide) avx512::weigh_values<D, T>(scores.data(), stride, vp, table, len, s, g, inv_sum, out_g, fetch);
  else avx2::weigh_values<D, T>(scores.data(), stride, vp, table, len, s, g, inv_sum, out_g, fetch);
  if (max_out != nullptr)
    for (int64_t j = 0; j < s.per_kv; ++j) max_out[j] = max[j], sum_out[j] = 1.f / inv_sum[j];
}

template <int64_t D, typename T>
void attend(const at::Tensor& q, const T* kp, const T* vp, int64_t block_size, int64_t kv_heads,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, float scale, at::Tensor& out) {
  const int64_t batch = q.size(0);
  const Shape s{q.size(1), kv_heads, q.size(1) / kv_heads, block_size, block_tables.size(1),
                kv_heads * head_row<T>(D), head_row<T>(D)};
  const float* qp = q.data_ptr<float>();
  const int64_t q_row = q.stride(0);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  // 512-bit vectors (half the instructions) where the kernels' instruction set has them; D = 16 fills one.
  const bool wide = tandem_cpu::isa() == tandem_cpu::Isa::kAvx512Vnni;
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] > 0 && lens[b] <= s.max_blocks * s.block_size, "sequence length ", lens[b], " out of range");
    max_len = std::max<int64_t>(max_len, lens[b]);
  }
  const int64_t items = batch * s.kv_heads, splits = token_splits(items, max_len);
  // A range's tokens, in whole blocks; a split sequence's ranges leave their parts here to be merged.
  const int64_t range = (max_len + splits - 1) / splits;
  const int64_t range_len = (range + s.block_size - 1) / s.block_size * s.block_size;
  std::vector<float> part_out, part_max, part_sum;
  if (splits > 1) {
    part_out.resize(items * splits * s.per_kv * D);
    part_max.assign(items * splits * s.per_kv, 0.f);
    part_sum.assign(items * splits * s.per_kv, 0.f);  // 0: a range past its sequence's end
  }
  // Work goes out a (sequence, token range) at a time, all its KV heads together (they share the cache lines of
  // each token's row; a head at a time where there are too few ranges for the threads to share), and the threads
  // take the longest left next from a shared counter: a range's time follows its length, and a batch's long
  // sequences (old chats) sit together, so an even split gave one thread all of them (batch 16, 4 of 1,600 tokens
  // first and 12 of 350: two threads no faster than one).
  const int64_t threads = tandem_cpu::num_threads();
  const int64_t unit_heads = batch * splits >= 2 * threads ? s.kv_heads : 1, head_groups = s.kv_heads / unit_heads;
  const int64_t num_units = batch * splits * head_groups;
  const auto range_tokens = [&](int64_t unit) {  // unit: (sequence, token range, group of unit_heads KV heads)
    const int64_t r = unit / head_groups;
    return std::min<int64_t>(lens[r / splits] - (r % splits) * range_len, range_len);
  };
  thread_local std::vector<int64_t> order;  // kept between calls, as the scratch below
  order.resize(num_units);
  for (int64_t u = 0; u < num_units; ++u) order[u] = u;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return range_tokens(a) > range_tokens(b); });
  const int64_t* longest_first = order.data();  // the leader's: in the loop below, `order` is each thread's own
  std::atomic<int64_t> next{0};
  tandem_cpu::parallel_for(0, std::min(threads, num_units), 1, [&](int64_t, int64_t) {
    // Each thread's scratch, kept between calls: fresh vectors were two mallocs a thread a layer.
    thread_local std::vector<float> scores, q_scaled;
    q_scaled.resize(s.per_kv * D);
    for (int64_t taken = next++; taken < num_units; taken = next++) {
      const int64_t unit = longest_first[taken], len = range_tokens(unit);
      if (len <= 0) continue;
      const int64_t r = unit / head_groups, b = r / splits, part = r % splits;
      const int32_t* table = tables + b * s.max_blocks + part * range_len / s.block_size;
      const int64_t g0 = unit % head_groups * unit_heads;
      for (int64_t g = g0; g < g0 + unit_heads; ++g) {
        const int64_t work = (b * s.kv_heads + g) * splits + part;
        const float* qg = qp + b * q_row + g * s.per_kv * D;
        for (int64_t i = 0; i < s.per_kv * D; ++i) q_scaled[i] = qg[i] * scale;
        const bool whole = splits == 1;  // a whole sequence writes its output; a range leaves its part to merge
        const Reach reach = wide || unit_heads < s.kv_heads ? Reach::kHead
                            : g == g0                         ? Reach::kBlock
                                                              : Reach::kNothing;
        attend_range<D, T>(q_scaled.data(), kp, vp, table, len, s, g, reach, wide, scores,
                           whole ? op + (b * s.num_heads + g * s.per_kv) * D : part_out.data() + work * s.per_kv * D,
                           whole ? nullptr : part_max.data() + work * s.per_kv,
                           whole ? nullptr : part_sum.data() + work * s.per_kv);
      }
    }
  });
  if (splits == 1) return;
  // out = sum over ranges of out_r * sum_r * exp(max_r - max) / (sum over ranges of sum_r * exp(max_r - max))
  for (int64_t item = 0; item < items; ++item) {
    const int64_t b = item / s.kv_heads, g = item % s.kv_heads;
    for (int64_t j = 0; j < s.per_kv; ++j) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t part = 0; part < splits; ++part) {
        const int64_t at = (item * splits + part) * s.per_kv + j;
        if (part_sum[at] > 0.f) top = std::max(top, part_max[at]);
      }
      float weight[kMaxSplits], total = 0.f;
      for (int64_t part = 0; part < splits; ++part) {
        const int64_t at = (item * splits + part) * s.per_kv + j;
        weight[part] = part_sum[at] > 0.f ? part_sum[at] * std::exp(part_max[at] - top) : 0.f;
        total += weight[part];
      }
      float* o = op + (b * s.num_heads + g * s.per_kv + j) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      for (int64_t part = 0; part < splits; ++part) {
        if (weight[part] == 0.f) continue;
        const float w = weight[part] / total;
        const float* src = part_out.data() + ((item * splits + part) * s.per_kv + j) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * src[d];
      }
    }
  }
}

// One head row of D fp32 values (D a multiple of 8) into D int8 values and their fp32 scale:
// scale = max|x| / 127, q = x / scale rounded to nearest even (0 and scale 0 for a row of zeros).
void quantize_head_row(const float* x, int64_t d, int8_t* out) {
  const float scale = abs_max(x, d) / 127.f;
  std::memcpy(out + d, &scale, sizeof(scale));
  if (scale == 0.f) {
    std::memset(out, 0, d);
    return;
  }
  const __m256 div = _mm256_set1_ps(scale), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 v = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_div_ps(_mm256_loadu_ps(x + i), div)));
    const __m256i n = _mm256_cvtps_epi32(v);  // the default rounding: to nearest even
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), _mm_packs_epi16(w16, w16));
  }
}

}  // namespace

namespace tandem_cpu {

void check_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& out) {
  tandem_cpu::check_attention_inputs(q, k_cache, v_cache, /*strided_rows=*/true);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables only");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(q.size(1) / k_cache.size(2) <= kMaxHeadsPerKV, "too many query heads per KV head");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == at::kFloat,
              "out must be contiguous fp32 of q's shape");
}

void decode_attention_unchecked(const at::Tensor& q, const CacheLayer& layer, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const float fscale = static_cast<float>(scale);
  tandem_cpu::with_head_and_cache(q.size(2), layer.dtype, [&](auto d, auto t) {
    using T = decltype(t);
    attend<decltype(d)::value, T>(q, static_cast<const T*>(layer.k), static_cast<const T*>(layer.v),
                                  layer.block_size, layer.kv_heads, block_tables, seq_lens, fscale, out);
  });
}

CacheLayer cache_layer(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  return {k_cache.data_ptr(), v_cache.data_ptr(), k_cache.scalar_type(), k_cache.size(0), k_cache.size(1),
          k_cache.size(2), k_cache.size(3)};
}

void paged_decode_attention_out(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                at::Tensor& out) {
  check_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out);
  decode_attention_unchecked(q, cache_layer(k_cache, v_cache), block_tables, seq_lens, scale, out);
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  at::Tensor out = at::empty(q.sizes(), q.options());
  paged_decode_attention_out(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  return out;
}

constexpr int64_t kStoreGrain = 64;  // tokens a thread takes at least

// Each token's K and V rows into its cache slot (slot -1: a padding token, skipped): one copy a row, where
// the torch path's validity mask, gathers and index_copy_ cost ~40 us a layer for a single decode token.
// fp32 rows into an fp16 cache are rounded to nearest even, as torch's .to(float16) rounds; into an int8 cache
// each head row is quantized as kernels/kv_quant.py's reference does (its bits exactly).
//   k, v [T, KVH, D] (rows may be strided views of a fused QKV), caches [num_blocks, block_size, KVH, D]
//   (int8: [..., KVH, D + 4])
void check_store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "bad shapes");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "K and V must share a dtype, and so must their caches");
  const bool to_half = k.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kHalf;
  const bool to_int8 = k.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() || to_half || to_int8, "rows of ", k.scalar_type(),
              " cannot go into a cache of ", k_cache.scalar_type(), " (same dtype, or fp32 into fp16 or int8)");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "each token's K and V heads must be one contiguous row");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches only");
  const int64_t head_dim = k.size(2);
  TORCH_CHECK(k_cache.size(2) == k.size(1) && k_cache.size(3) == (to_int8 ? head_dim + kScaleBytes : head_dim),
              "head shapes disagree: cache rows of ", k_cache.size(2), " x ", k_cache.size(3), " for K of ", k.size(1),
              " x ", head_dim, to_int8 ? " (int8: D + 4)" : "");
  TORCH_CHECK(!to_int8 || head_dim % 8 == 0, "an int8 cache needs a head size that is a multiple of 8, not ", head_dim);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt, "integer slots");
  TORCH_CHECK(slot_mapping.numel() == k.size(0), "one slot a token: ", slot_mapping.numel(), " for ", k.size(0));
  // Here, before any row is written: a bad slot writes nothing.
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const auto check_slots = [&](const auto* sp) {
    for (int64_t t = 0; t < slots.numel(); ++t)
      TORCH_CHECK(sp[t] < num_slots, "slot ", sp[t], " past the cache's ", num_slots);
  };
  if (slots.scalar_type() == at::kLong) check_slots(slots.data_ptr<int64_t>());
  else check_slots(slots.data_ptr<int32_t>());
}

void store_head_unchecked(const CacheLayer& layer, bool value, int64_t slot, int64_t head, const float* src) {
  const int64_t elem = static_cast<int64_t>(c10::elementSize(layer.dtype));
  char* dst = static_cast<char*>(value ? layer.v : layer.k) + (slot * layer.kv_heads + head) * layer.row * elem;
  if (layer.dtype == at::kChar) {
    quantize_head_row(src, layer.row - kScaleBytes, reinterpret_cast<int8_t*>(dst));
    return;
  }
  if (layer.dtype == at::kFloat) {
    std::memcpy(dst, src, layer.row * sizeof(float));
    return;
  }
  auto* to = reinterpret_cast<uint16_t*>(dst);  // fp16: rounded to nearest even, as torch's .to(float16)
  int64_t i = 0;
  for (; i + 8 <= layer.row; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < layer.row; ++i) to[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

// store_kv's work once checked: each token's K and V rows into its slot.
static void store_kv_unchecked(const at::Tensor& k, const at::Tensor& v, const CacheLayer& layer,
                               const at::Tensor& slot_mapping) {
  const bool to_half = k.scalar_type() == at::kFloat && layer.dtype == at::kHalf;
  const bool to_int8 = k.scalar_type() == at::kFloat && layer.dtype == at::kChar;
  const int64_t head_dim = k.size(2);
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t row_bytes = layer.kv_heads * layer.row * static_cast<int64_t>(c10::elementSize(layer.dtype));
  const int64_t* sp = slots.data_ptr<int64_t>();
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const auto put = [&](bool value, int64_t slot, const char* src) {
    if (!to_int8 && !to_half) {  // the cache's own dtype
      std::memcpy(static_cast<char*>(value ? layer.v : layer.k) + slot * row_bytes, src, row_bytes);
      return;
    }
    for (int64_t h = 0; h < k.size(1); ++h)
      store_head_unchecked(layer, value, slot, h, reinterpret_cast<const float*>(src) + h * head_dim);
  };
  // A prompt's rows on every thread (a 350-token prefill quantized its 2,100 head rows a layer on one: ~80 us);
  // a decode step's few under the grain, inline.
  tandem_cpu::parallel_for(0, k.size(0), kStoreGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (sp[t] < 0) continue;
      put(false, sp[t], kp + t * k.stride(0) * k.element_size());
      put(true, sp[t], vp + t * v.stride(0) * v.element_size());
    }
  });
}

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  check_store_kv(k, v, k_cache, v_cache, slot_mapping);
  store_kv_unchecked(k, v, cache_layer(k_cache, v_cache), slot_mapping);
}

}  // namespace tandem_cpu

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("paged_decode_attention", &tandem_cpu::paged_decode_attention);
  m.impl("store_kv", &tandem_cpu::store_kv);
}
