// at::vec's exp_u20 on 512-bit registers, for the kernels' AVX-512 loops: this build's at::vec is 8 lanes wide
// (CPU_CAPABILITY_AVX2). The same operations a lane as at::vec's, so the same bits (checked against it bit for bit
// over 2M values and the edge cases). Included inside a namespace of 512-bit loops, in a `#pragma GCC target`
// region with avx512f (as paged_decode_loops.h is), after <immintrin.h>.

inline __m512 exp_u20(__m512 x) {
  const __m512 ln_min = _mm512_castsi512_ps(_mm512_set1_epi32(0xc2aeac50));
  const __m512 ln_max = _mm512_castsi512_ps(_mm512_set1_epi32(0x42b17218));
  const __m512 one = _mm512_set1_ps(1.f);
  const __mmask16 too_small = _mm512_cmp_ps_mask(x, ln_min, _CMP_LT_OS);
  const __m512 src = _mm512_max_ps(_mm512_min_ps(x, ln_max), ln_min);
  // fx = floor(x log2(e) + 1/2); r = x - fx ln(2); exp(x) = 2^fx exp(r), exp(r) by a degree-5 polynomial
  const __m512 fx = _mm512_roundscale_ps(
      _mm512_fmadd_ps(src, _mm512_castsi512_ps(_mm512_set1_epi32(0x3fb8aa3b)), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(fx, _mm512_castsi512_ps(_mm512_set1_epi32(0x3f317218)), src);
  __m512 y = _mm512_fmadd_ps(r, _mm512_set1_ps(0.00828929059f), _mm512_set1_ps(0.0418978221f));
  y = _mm512_fmadd_ps(r, y, _mm512_set1_ps(0.166676521f));
  y = _mm512_fmadd_ps(r, y, _mm512_set1_ps(0.499991506f));
  y = _mm512_fmadd_ps(r, y, _mm512_set1_ps(0.999999701f));
  y = _mm512_fmadd_ps(r, y, one);
  const __m512i n = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_sub_ps(fx, one)), _mm512_set1_epi32(127)), 23);  // 2^(fx - 1)
  const __m512 scale = _mm512_mask_blend_ps(too_small, _mm512_castsi512_ps(n), _mm512_setzero_ps());
  return _mm512_mul_ps(_mm512_mul_ps(y, scale), _mm512_set1_ps(2.f));
}
