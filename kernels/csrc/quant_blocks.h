// What the quantized linear kernels share (quant_linear_cpu.cpp: weights as the GGUF's blocks, row by row;
// quant_linear_x8_cpu.cpp: the same blocks interleaved by 8 rows): x rounded to 8 bits a block of 32, as
// llama.cpp's Q8 does, and small AVX2 helpers. See quant_linear_cpu.cpp for the block formats.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "tandem_cpu.h"
#include "thread_team.h"

namespace tandem_quant {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowTile = 4;  // rows of x that share each unpacked block
constexpr int64_t kQ4_1Bytes = 20, kQ8_0Bytes = 34;  // one block of 32 weights

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// x quantized per block of 32: q [M, K] int8, scale and sum of the quantized values [M, K / 32] fp32.
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline void quantize_block(const float* x, int8_t* q, float* scale, float* sum) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
  }
  const float m = hmax(amax);
  const __m256 inv = _mm256_set1_ps(m > 0.f ? 127.f / m : 0.f);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // round to nearest
  *scale = m / 127.f;
  // The sum of the *quantized* block: with it the m term carries the same rounding as the d term, and the
  // two cancel (sum (d q + m)(x - e) errs by sum w e; an exact sum x would leave d sum q e, q all >= 0).
  *sum = *scale * hsum(_mm256_cvtepi32_ps(
                      _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]))));
  // packs work within 128-bit lanes; the permute restores element order 0..31.
  const __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]), i16b = _mm256_packs_epi32(i32[2], i32[3]);
  const __m256i i8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16a, i16b),
                                                 _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), i8);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")  // run only where cpu_isa.cpp found them (its "avx512_vnni")
namespace avx512 {
// quantize_block for n consecutive blocks of x, 16 at a time on 512-bit vectors: their maxima first, then one
// vdivps each for the 16 blocks' 127 / max and max / 127 (two scalar divides a block were ~half its time), and the
// sum of a block's int8 values by psadbw. The same operations a lane, so the same bits (the integer sum exactly):
// 22 -> 13 cycles a block standalone; a batch-8 decode step quantizes ~800 a layer on its leader while the team
// waits: the stack -2.0% (6 rounds of 30 calls, 0.960-1.008), batch 1 no change.
inline void quantize_blocks(const float* x, int8_t* q, float* scale, float* sum, int64_t n) {
  const __m128i bias = _mm_set1_epi8(static_cast<char>(0x80));
  for (int64_t b0 = 0; b0 < n; b0 += 16) {
    const int64_t k = n - b0 < 16 ? n - b0 : 16;
    const __mmask16 valid = static_cast<__mmask16>((1u << k) - 1);
    alignas(64) float top[16] = {}, inv[16], total[16] = {};
    for (int64_t i = 0; i < k; ++i) {
      const float* xb = x + (b0 + i) * kBlock;
      top[i] = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb)), _mm512_abs_ps(_mm512_loadu_ps(xb + 16))));
    }
    const __m512 tops = _mm512_load_ps(top);
    const __mmask16 positive = _mm512_cmp_ps_mask(tops, _mm512_setzero_ps(), _CMP_GT_OQ);  // else inv 0
    _mm512_store_ps(inv, _mm512_maskz_div_ps(positive, _mm512_set1_ps(127.f), tops));
    for (int64_t i = 0; i < k; ++i) {
      const float* xb = x + (b0 + i) * kBlock;
      int8_t* qb = q + (b0 + i) * kBlock;
      const __m512 s = _mm512_set1_ps(inv[i]);
      const __m128i p0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb), s)));
      const __m128i p1 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16), s)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), p0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), p1);
      // sum q = sum (q + 128) - 32 * 128, the biased bytes summed by psadbw against zero
      const __m128i both = _mm_add_epi64(_mm_sad_epu8(_mm_xor_si128(p0, bias), _mm_setzero_si128()),
                                         _mm_sad_epu8(_mm_xor_si128(p1, bias), _mm_setzero_si128()));
      total[i] = static_cast<float>(_mm_cvtsi128_si32(both) + _mm_extract_epi32(both, 2) - 32 * 128);
    }
    const __m512 scales = _mm512_div_ps(tops, _mm512_set1_ps(127.f));
    _mm512_mask_storeu_ps(scale + b0, valid, scales);
    _mm512_mask_storeu_ps(sum + b0, valid, _mm512_mul_ps(scales, _mm512_load_ps(total)));
  }
}
}  // namespace avx512
#pragma GCC pop_options

// Into this thread's own buffers, reused call to call (valid until its next quantize_x): a decode step quantizes x
// ~120 times, and fresh vectors were three mallocs each (glibc consolidates its fast bins before every one of
// 1 KB or more). The buffers keep the largest x seen: a prefill step's, ~1.1 bytes a value (8,192 tokens of the
// default model's 1,536-wide down projection: ~14 MB, held by the thread that ran it).
inline QuantizedX& this_threads_x() {
  thread_local QuantizedX buffers;
  return buffers;
}

inline const QuantizedX& quantize_x(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / kBlock;
  QuantizedX& out = this_threads_x();  // a reference, so the team's workers fill the caller's buffers, not theirs
  out.q.resize(M * K);
  out.scale.resize(M * nb);
  out.sum.resize(M * nb);
  const bool wide = tandem_cpu::isa() == tandem_cpu::Isa::kAvx512Vnni;
  tandem_cpu::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    if (wide) {
      avx512::quantize_blocks(x + begin * kBlock, out.q.data() + begin * kBlock, &out.scale[begin], &out.sum[begin],
                              end - begin);
      return;
    }
    for (int64_t i = begin; i < end; ++i)
      quantize_block(x + i * kBlock, out.q.data() + i * kBlock, &out.scale[i], &out.sum[i]);
  });
  return out;
}

inline __m256 i32_sum_to_float(__m256i p16) {  // 16 i16 pair sums -> 8 fp32
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

}  // namespace tandem_quant
