// The inner loops of quant_linear_x8_cpu.cpp, compiled once per instruction set: that file includes this
// header inside a namespace that first defines
//
//   constexpr bool kVnni;      // whether dpbusd (u8 x s8, 4 products summed into i32) is there
//   constexpr int kRowTile;    // rows of x that share one unpacked block (32 vector registers: 8, 16: 4)
//   __m256i dpbusd(acc, u, s)  // acc + the 4-product sums (only called where kVnni)
//
// under the matching `#pragma GCC target`. No #include here: it is textually part of that namespace.
//
// The integer sums are the same on every path (no step saturates: see each format's note), and the float
// work after them is the same in the same order, so every path gives bit-identical outputs.

// One (group, block) of kBytes pulled into L1 ahead of its loop. A group is a few KB (Q4_1 at K = 576: 18 blocks,
// 2.9 KB), too short a stream for the hardware prefetcher to catch before it ends: each block of a group fetches
// the same block of the next group, as the 512-bit pairs fetch the next pair's (quant_x8_dot512.h). Engine decode
// steps under AVX2, alternated with the loops before it (this VM's Emerald Rapids, 2 threads, 3 pairs of runs):
// batch 1 2.9-3.3 ms against 4.6-9.1 with the weights in L3, 4.9-6.5 against 6.5-8.6 from memory; batch 8
// 11.3-16.3 against 13.7-20.3. AVX-VNNI alike (batch 1 2.8-3.9 against 5.4-7.9).
template <int64_t kBytes>
__attribute__((always_inline)) inline void prefetch_block(const uint8_t* blk) {
  const char* at = reinterpret_cast<const char*>(blk);
  for (int64_t o = 0; o < kBytes; o += 64) _mm_prefetch(at + o, _MM_HINT_T0);
  _mm_prefetch(at + kBytes - 1, _MM_HINT_T0);  // a block ends mid-line
}

// Where a group's loop finds the next group's blocks to prefetch: at `at`, `stride` bytes apart; none at null.
struct NextGroup {
  const uint8_t* at;
  int64_t stride;
};

// y[r, the group's 8 rows] for R rows of quantized x starting at m0 (layout: quant_linear_x8_cpu.cpp); the
// group's blocks lie `stride` bytes apart (X8Layout: its pair's other group between them, or none); `next`: the
// group to come, prefetched alongside (null in all but a group's first tile of rows).
//
// Without VNNI (AVX2): each 32 bytes of the block unpacked and met by every row of x before the next are loaded,
// so a tile holds R int16 sums, not the block's 8 unpacked registers: with those, AVX2's 16 registers spilled the
// accumulators to the stack at R = 4. 8 maddubs results add up in int16 without overflow (8 * 2 * 15 * 127 =
// 30480 < 32767), so the sums are the VNNI path's integers; the float work after them is the same.
template <int R>
inline void q4_1x8_dot_rows_k_outer(const tandem_quant::QuantizedX& x, int64_t m0, int64_t nb, const uint8_t* group,
                                    int64_t stride, float* y, int64_t ldy, NextGroup next) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  // Row r's block b: its values at q0 + (r * nb + b) * 32, its scale and sum at [r * nb + b]. Raw pointers: through
  // x's vectors GCC reloaded them every block, holding a register less for the sums.
  const int8_t* const q0 = x.q.data() + m0 * nb * 32;
  const float* const scale0 = x.scale.data() + m0 * nb;
  const float* const sum0 = x.sum.data() + m0 * nb;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * stride;
    if (next.at != nullptr) prefetch_block<160>(next.at + b * next.stride);
    __m256i sum16[R];
    for (int k = 0; k < 4; ++k) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * k));
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      _Pragma("GCC unroll 8")
      for (int r = 0; r < R; ++r) {
        const int8_t* qx = q0 + (r * nb + b) * 32 + 8 * k;
        int32_t a, c;
        __builtin_memcpy(&a, qx, 4);
        __builtin_memcpy(&c, qx + 4, 4);
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)),
                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(c)));
        sum16[r] = k == 0 ? p : _mm256_add_epi16(sum16[r], p);
        __asm__("" : "+x"(sum16[r]));  // keeps GCC from hoisting every product ahead and spilling them (seen at R = 4)
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; ++r) {
      const __m256 sum = tandem_quant::i32_sum_to_float(sum16[r]);
      acc[r] = _mm256_fmadd_ps(sum, _mm256_mul_ps(d, _mm256_set1_ps(scale0[r * nb + b])), acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sum0[r * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

// With VNNI: y[r, the group's 8 rows] for R rows of quantized x starting at m0, each block unpacked once into 8
// registers for all R rows (32 registers hold them beside R = 8 accumulators; AVX-VNNI's 16 hold them at R = 4).
template <int R>
inline void q4_1x8_dot_rows(const tandem_quant::QuantizedX& x, int64_t m0, int64_t nb, const uint8_t* group,
                            int64_t stride, float* y, int64_t ldy, NextGroup next) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * stride;
    if (next.at != nullptr) prefetch_block<160>(next.at + b * next.stride);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    __m256i q[8];
    for (int k = 0; k < 4; ++k) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * k));
      q[2 * k] = _mm256_and_si256(v, low);
      q[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    _Pragma("GCC unroll 8")  // acc[] stays in registers only with the rows unrolled
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * nb + b;
      const int8_t* qx = x.q.data() + i * 32;
      // Two chains of 4, so the dpbusd latency overlaps (a chain of 8 waits on each result in turn).
      __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
      for (int k = 0; k < 8; k += 2) {  // q[k] holds values 4k .. 4k+3 of each row
        int32_t a, c;
        __builtin_memcpy(&a, qx + 4 * k, 4);
        __builtin_memcpy(&c, qx + 4 * k + 4, 4);
        even = dpbusd(even, q[k], _mm256_set1_epi32(a));
        odd = dpbusd(odd, q[k + 1], _mm256_set1_epi32(c));
      }
      const __m256i sum32 = _mm256_add_epi32(even, odd);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum32), _mm256_mul_ps(d, _mm256_set1_ps(x.scale[i])), acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.sum[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

// Q8_0 with VNNI: both sides signed, so |v| times x carrying v's signs (llama.cpp's trick), each block's 8
// magnitudes made once for all R rows.
template <int R>
inline void q8_0x8_dot_rows(const tandem_quant::QuantizedX& x, int64_t m0, int64_t nb, const uint8_t* group,
                            int64_t stride, float* y, int64_t ldy, NextGroup next) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * stride;
    if (next.at != nullptr) prefetch_block<272>(next.at + b * next.stride);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256i* v = reinterpret_cast<const __m256i*>(blk + 16);
    __m256i magnitude[8];
    for (int k = 0; k < 8; ++k) magnitude[k] = _mm256_abs_epi8(_mm256_loadu_si256(v + k));
    _Pragma("GCC unroll 8")  // acc[] stays in registers only with the rows unrolled
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * nb + b;
      const int8_t* qx = x.q.data() + i * 32;
      __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
      for (int k = 0; k < 8; k += 2) {  // values 4k .. 4k+3 of each row
        int32_t a, c;
        __builtin_memcpy(&a, qx + 4 * k, 4);
        __builtin_memcpy(&c, qx + 4 * k + 4, 4);
        const __m256i sa = _mm256_sign_epi8(_mm256_set1_epi32(a), _mm256_loadu_si256(v + k));
        const __m256i sc = _mm256_sign_epi8(_mm256_set1_epi32(c), _mm256_loadu_si256(v + k + 1));
        even = dpbusd(even, magnitude[k], sa);
        odd = dpbusd(odd, magnitude[k + 1], sc);
      }
      const __m256i sum32 = _mm256_add_epi32(even, odd);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum32), _mm256_mul_ps(d, _mm256_set1_ps(x.scale[i])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

// Q8_0 without VNNI, k outer as q4_1x8_dot_rows_k_outer: each 32 bytes' magnitudes made and met by every row
// (holding all 8 spilled the accumulators at R = 4). A maddubs pair reaches at most 2 * 128 * 127 = 32512 (v =
// -128 reads as 128 unsigned): no saturation; each widens to int32 (madd) before the next is added. The int32
// sums are the VNNI path's integers in another order.
template <int R>
inline void q8_0x8_dot_rows_k_outer(const tandem_quant::QuantizedX& x, int64_t m0, int64_t nb, const uint8_t* group,
                                    int64_t stride, float* y, int64_t ldy, NextGroup next) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int8_t* const q0 = x.q.data() + m0 * nb * 32;  // as in q4_1x8_dot_rows_k_outer
  const float* const scale0 = x.scale.data() + m0 * nb;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * stride;
    if (next.at != nullptr) prefetch_block<272>(next.at + b * next.stride);
    __m256i sum32[R];
    for (int k = 0; k < 8; ++k) {  // values 4k .. 4k+3 of each row
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * k));
      const __m256i magnitude = _mm256_abs_epi8(v);
      _Pragma("GCC unroll 8")
      for (int r = 0; r < R; ++r) {
        int32_t a;
        __builtin_memcpy(&a, q0 + (r * nb + b) * 32 + 4 * k, 4);
        const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(a), v);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones);
        sum32[r] = k == 0 ? p : _mm256_add_epi32(sum32[r], p);
        __asm__("" : "+x"(sum32[r]));  // as in q4_1x8_dot_rows_k_outer
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum32[r]), _mm256_mul_ps(d, _mm256_set1_ps(scale0[r * nb + b])),
                               acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

// Groups [g0, g1) of 8 weight rows (of N) against all M rows of x, into y (GroupOutput). `pairs`: the x8p layout
// (X8Layout).
template <bool kQ4_1>
inline void x8_groups(const tandem_quant::QuantizedX& x, int64_t M, int64_t nb, const uint8_t* w, int64_t g0,
                      int64_t g1, const GroupOutput& y, int64_t N, bool pairs) {
  const X8Layout layout{nb, N / 8, kQ4_1 ? 160 : 272, pairs};
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = w + layout.offset(g, 0);
    const int64_t stride = layout.stride(g);
    float* yg = y.group(g);
    // The next group's blocks ride along with this group's first tile of rows; later tiles find this group in cache.
    NextGroup next = g + 1 < g1 ? NextGroup{w + layout.offset(g + 1, 0), layout.stride(g + 1)} : NextGroup{nullptr, 0};
    int64_t m = 0;
    auto rows = [&](auto tile) {
      constexpr int T = decltype(tile)::value;
      if constexpr (kQ4_1 && !kVnni) q4_1x8_dot_rows_k_outer<T>(x, m, nb, group, stride, yg + m * y.ld, y.ld, next);
      else if constexpr (kQ4_1) q4_1x8_dot_rows<T>(x, m, nb, group, stride, yg + m * y.ld, y.ld, next);
      else if constexpr (!kVnni) q8_0x8_dot_rows_k_outer<T>(x, m, nb, group, stride, yg + m * y.ld, y.ld, next);
      else q8_0x8_dot_rows<T>(x, m, nb, group, stride, yg + m * y.ld, y.ld, next);
      next.at = nullptr;
      m += T;
    };
    while (m + kRowTile <= M) rows(std::integral_constant<int, kRowTile>{});
    if (M - m >= 4 && kRowTile > 4) rows(std::integral_constant<int, 4>{});
    switch (M - m) {
      case 3: rows(std::integral_constant<int, 3>{}); break;
      case 2: rows(std::integral_constant<int, 2>{}); break;
      case 1: rows(std::integral_constant<int, 1>{}); break;
      default: break;
    }
  }
}
