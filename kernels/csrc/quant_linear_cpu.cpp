// Linear layers straight from GGML-quantized weights on CPU: y = x @ W^T with W kept as the GGUF's
// bytes, so a decode step reads ~4.5 bits a weight (Q4_1) or ~8.5 (Q8_0) instead of 32.
//
// A block holds 32 consecutive weights of one output row (row n, columns 32b .. 32b+31):
//
//   Q4_1, 20 bytes:  | d fp16 | m fp16 | qs[16] |   w[j] = d * q[j] + m,
//                    q[j] = qs[j] & 15 (j < 16), qs[j - 16] >> 4 (j >= 16)
//   Q8_0, 34 bytes:  | d fp16 | qs[32] int8 |      w[j] = d * qs[j]
//
// As llama.cpp does, x is quantized per block of 32 too (Q8 with an fp32 scale dx = max|x| / 127, and
// the block's sum sx = dx * sum qx), so a block's dot product is one integer multiply-add pass:
//
//   sum_j w[j] x[j]  ~=  d * dx * sum_j q[j] qx[j]  +  m * sx          (Q4_1; Q8_0 has no m term)
//
// AVX2 does sum_j q[j] qx[j] in three instructions (maddubs: u8 x s8 -> pairs of i16; madd: -> i32;
// cvt), where an fp32 unpack of the same block takes ~30: decode at small batch is then bound by the
// weight bytes, not the unpacking. Up to kRowTile rows of x share each unpacked block; weight rows are
// split over ATen's intra-op thread pool (the caller's torch thread count).
//
//   x [M, K] fp32, w [N, K / 32 * block_bytes] uint8  ->  y [M, N] fp32
//   dequantize: w  ->  [N, K] fp32, bit-exact with the gguf package (for BLAS on long prefill chunks)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "tandem_cpu.h"

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowTile = 4;

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

void quantize_block(const float* x, int8_t* q, float* scale, float* sum) {
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

QuantizedX quantize_x(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / kBlock;
  QuantizedX out{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_block(x + i * kBlock, out.q.data() + i * kBlock, &out.scale[i], &out.sum[i]);
  });
  return out;
}

inline __m256 i32_sum_to_float(__m256i p16) {  // 16 i16 pair sums -> 8 fp32
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

struct Q4_1 {
  static constexpr int64_t kBytes = 20;
  struct Unpacked {
    __m256i q;  // 32 u8 in 0..15, element order
    float d, m;
  };
  static inline Unpacked unpack(const uint8_t* blk) {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(qs, 4), qs);
    return {_mm256_and_si256(both, _mm256_set1_epi8(0x0F)), half_to_float(blk), half_to_float(blk + 2)};
  }
  // acc += d * dx * sum q qx; returns the scalar term m * sx.
  static inline float dot(const Unpacked& u, const int8_t* qx, float dx, float sx, __m256& acc) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
    acc = _mm256_fmadd_ps(i32_sum_to_float(_mm256_maddubs_epi16(u.q, x)), _mm256_set1_ps(u.d * dx), acc);
    return u.m * sx;
  }
  static inline void dequantize(const uint8_t* blk, float* out) {
    const Unpacked u = unpack(blk);
    alignas(32) uint8_t q[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(q), u.q);
    for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(q[j]) * u.d + u.m;  // the gguf package's order
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = 34;
  struct Unpacked {
    __m256i q, abs_q;  // signed weights and their magnitudes (maddubs takes one operand unsigned)
    float d;
  };
  static inline Unpacked unpack(const uint8_t* blk) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    return {q, _mm256_sign_epi8(q, q), half_to_float(blk)};
  }
  static inline float dot(const Unpacked& u, const int8_t* qx, float dx, float, __m256& acc) {
    const __m256i x = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx)), u.q);
    acc = _mm256_fmadd_ps(i32_sum_to_float(_mm256_maddubs_epi16(u.abs_q, x)), _mm256_set1_ps(u.d * dx), acc);
    return 0.f;
  }
  static inline void dequantize(const uint8_t* blk, float* out) {
    const float d = half_to_float(blk);
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(q[j]) * d;
  }
};

// y[r, n] for R rows of quantized x (starting at row m0) against one weight row.
template <typename F, int R>
inline void dot_rows(const QuantizedX& x, int64_t m0, int64_t K, const uint8_t* wrow, float* y, int64_t ldy) {
  const int64_t nb = K / kBlock;
  __m256 acc[R];
  float extra[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    extra[r] = 0.f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const typename F::Unpacked u = F::unpack(wrow + b * F::kBytes);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * nb + b;
      extra[r] += F::dot(u, x.q.data() + i * kBlock, x.scale[i], x.sum[i], acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(acc[r]) + extra[r];
}

// Weight rows [begin, end) against all of x: y[:, begin:end].
template <typename F>
void linear_block(const QuantizedX& x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, float* y,
                  int64_t N, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* wrow = w + n * row_bytes;
    int64_t m = 0;
    for (; m + kRowTile <= M; m += kRowTile) dot_rows<F, kRowTile>(x, m, K, wrow, y + m * N + n, N);
    switch (M - m) {
      case 3: dot_rows<F, 3>(x, m, K, wrow, y + m * N + n, N); break;
      case 2: dot_rows<F, 2>(x, m, K, wrow, y + m * N + n, N); break;
      case 1: dot_rows<F, 1>(x, m, K, wrow, y + m * N + n, N); break;
      default: break;
    }
  }
}

void check_args(const at::Tensor& x, const at::Tensor& w, int64_t block_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] contiguous fp32");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32, got ", x.size(1));
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be [N, bytes] contiguous uint8");
  TORCH_CHECK(w.size(1) == x.size(1) / kBlock * block_bytes, "w has ", w.size(1), " bytes a row; K=", x.size(1),
              " needs ", x.size(1) / kBlock * block_bytes);
}

template <typename F>
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w) {
  check_args(x, w, F::kBytes);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), row_bytes = w.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // Each thread walks its own weight rows; every row meets all of x (M small: x stays in L1/L2).
  const QuantizedX qx = quantize_x(xp, M, K);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    linear_block<F>(qx, M, K, wp, row_bytes, yp, N, begin, end);
  });
  return y;
}

// x as the blockwise kernel sees it (dx * qx, each block of 32 rounded to 8 bits), in fp32: the BLAS path
// multiplies this, so both paths multiply the same numbers (their fp32 rounding still differs).
at::Tensor q8_round(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] contiguous fp32");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32, got ", x.size(1));
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  const QuantizedX qx = quantize_x(x.data_ptr<float>(), M, K);
  at::Tensor out = at::empty({M, K}, x.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t j = 0; j < kBlock; ++j) op[i * kBlock + j] = qx.scale[i] * static_cast<float>(qx.q[i * kBlock + j]);
  });
  return out;
}

template <typename F>
at::Tensor dequantize(const at::Tensor& w, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be [N, bytes] contiguous uint8");
  TORCH_CHECK(K % kBlock == 0 && w.size(1) == K / kBlock * F::kBytes, "w's row bytes do not match K=", K);
  const int64_t N = w.size(0), row_bytes = w.size(1);
  at::Tensor out = at::empty({N, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < K / kBlock; ++b) F::dequantize(wp + n * row_bytes + b * F::kBytes, op + n * K + b * kBlock);
  });
  return out;
}


// ---- Q4_1 interleaved by 8 rows ("q4_1x8") ----------------------------------------------------------
//
// Above, every (block, row of x) pays ~10 instructions of fp32 bookkeeping (convert, scale, accumulate) for
// one weight row: from batch ~4 the step is bound by those, not by the bytes. Interleaving 8 weight rows
// lets one 256-bit lane hold one row's partial sum, so that bookkeeping is shared by 8 rows (as llama.cpp's
// repacked Q4_0 8x8 GEMM does). One (group of 8 rows, block) is 160 bytes:
//
//   | d[8] fp16 | m[8] fp16 | v0 | v1 | v2 | v3 |     vk: 32 bytes, 4 a row (row n at bytes 4n .. 4n+3):
//     byte i of row n = q[n][8k + i] | q[n][8k + 4 + i] << 4                           (i = 0..3)
//
// so the low nibbles of vk times x[8k .. 8k+3] (broadcast to every row) and the high nibbles times
// x[8k+4 .. 8k+7] give each row's sum over 8 values. A row's 8 maddubs results add up in int16 without
// overflow (8 * 2 * 15 * 127 = 30480 < 32767); one madd, convert and FMA then finish the block for all 8 rows.

constexpr int64_t kX8Rows = 8;
constexpr int64_t kX8Bytes = 160;

inline uint8_t q4_1_value(const uint8_t* blk, int64_t j) {  // the GGUF block's j-th 4-bit value
  return j < 16 ? blk[4 + j] & 0x0F : blk[4 + j - 16] >> 4;
}

// y[r, 8 rows of group g] for R rows of quantized x starting at m0.
template <int R>
inline void x8_dot_rows(const QuantizedX& x, int64_t m0, int64_t nb, const uint8_t* group, float* y, int64_t ldy) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * kX8Bytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    __m256i q[8];
    for (int k = 0; k < 4; ++k) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * k));
      q[2 * k] = _mm256_and_si256(v, low);
      q[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * nb + b;
      const int8_t* qx = x.q.data() + i * kBlock;
      __m256i sum16 = _mm256_setzero_si256();
      for (int k = 0; k < 8; ++k) {  // q[k] holds values 4k .. 4k+3 of each row (k even: low, odd: high nibbles)
        int32_t four;
        __builtin_memcpy(&four, qx + 4 * k, 4);
        sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(q[k], _mm256_set1_epi32(four)));
      }
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16, ones));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(x.scale[i])), acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.sum[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

}  // namespace

namespace tandem_cpu {

at::Tensor q4_1_to_x8(const at::Tensor& w, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be [N, bytes] contiguous uint8");
  TORCH_CHECK(K % kBlock == 0 && w.size(1) == K / kBlock * Q4_1::kBytes, "w's row bytes do not match K=", K);
  TORCH_CHECK(w.size(0) % kX8Rows == 0, "q4_1x8 needs a multiple of 8 rows, got ", w.size(0));
  const int64_t groups = w.size(0) / kX8Rows, nb = K / kBlock, row_bytes = w.size(1);
  at::Tensor out = at::empty({groups, nb * kX8Bytes}, w.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* dst = op + g * nb * kX8Bytes + b * kX8Bytes;
        for (int64_t n = 0; n < kX8Rows; ++n) {
          const uint8_t* blk = wp + (g * kX8Rows + n) * row_bytes + b * Q4_1::kBytes;
          __builtin_memcpy(dst + 2 * n, blk, 2);       // d
          __builtin_memcpy(dst + 16 + 2 * n, blk + 2, 2);  // m
          for (int64_t k = 0; k < 4; ++k)
            for (int64_t i = 0; i < 4; ++i)
              dst[32 + 32 * k + 4 * n + i] =
                  static_cast<uint8_t>(q4_1_value(blk, 8 * k + i) | q4_1_value(blk, 8 * k + 4 + i) << 4);
        }
      }
  });
  return out;
}

at::Tensor q4_1x8_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] contiguous fp32");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32, got ", x.size(1));
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be [N / 8, bytes] uint8");
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock, groups = w.size(0), N = groups * kX8Rows;
  TORCH_CHECK(w.size(1) == nb * kX8Bytes, "w has ", w.size(1), " bytes a group; K=", K, " needs ", nb * kX8Bytes);
  at::Tensor y = at::empty({M, N}, x.options());
  const QuantizedX qx = quantize_x(x.data_ptr<float>(), M, K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* group = wp + g * nb * kX8Bytes;
      float* yg = yp + g * kX8Rows;
      int64_t m = 0;
      for (; m + kRowTile <= M; m += kRowTile) x8_dot_rows<kRowTile>(qx, m, nb, group, yg + m * N, N);
      switch (M - m) {
        case 3: x8_dot_rows<3>(qx, m, nb, group, yg + m * N, N); break;
        case 2: x8_dot_rows<2>(qx, m, nb, group, yg + m * N, N); break;
        case 1: x8_dot_rows<1>(qx, m, nb, group, yg + m * N, N); break;
        default: break;
      }
    }
  });
  return y;
}

at::Tensor q4_1x8_dequantize(const at::Tensor& w, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be [N / 8, bytes] uint8");
  TORCH_CHECK(K % kBlock == 0 && w.size(1) == K / kBlock * kX8Bytes, "w's group bytes do not match K=", K);
  const int64_t groups = w.size(0), nb = K / kBlock;
  at::Tensor out = at::empty({groups * kX8Rows, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wp + g * nb * kX8Bytes + b * kX8Bytes;
        for (int64_t n = 0; n < kX8Rows; ++n) {
          const float d = half_to_float(blk + 2 * n), m = half_to_float(blk + 16 + 2 * n);
          float* row = op + (g * kX8Rows + n) * K + b * kBlock;
          for (int64_t k = 0; k < 4; ++k)
            for (int64_t i = 0; i < 4; ++i) {
              const uint8_t byte = blk[32 + 32 * k + 4 * n + i];
              row[8 * k + i] = static_cast<float>(byte & 0x0F) * d + m;  // the gguf package's order
              row[8 * k + 4 + i] = static_cast<float>(byte >> 4) * d + m;
            }
        }
      }
  });
  return out;
}

}  // namespace tandem_cpu

namespace {

}  // namespace

namespace tandem_cpu {

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& w) { return quant_linear<Q4_1>(x, w); }
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& w) { return quant_linear<Q8_0>(x, w); }

}  // namespace tandem_cpu

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("q4_1_linear(Tensor x, Tensor w) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor w) -> Tensor");
  m.def("q4_1_dequantize(Tensor w, int k) -> Tensor");
  m.def("q8_round(Tensor x) -> Tensor");
  m.def("q8_0_dequantize(Tensor w, int k) -> Tensor");
  m.def("q4_1_to_x8(Tensor w, int k) -> Tensor");
  m.def("q4_1x8_linear(Tensor x, Tensor w) -> Tensor");
  m.def("q4_1x8_dequantize(Tensor w, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("q4_1_linear", &tandem_cpu::q4_1_linear);
  m.impl("q8_0_linear", &tandem_cpu::q8_0_linear);
  m.impl("q4_1_dequantize", &dequantize<Q4_1>);
  m.impl("q8_round", &q8_round);
  m.impl("q8_0_dequantize", &dequantize<Q8_0>);
  m.impl("q4_1_to_x8", &tandem_cpu::q4_1_to_x8);
  m.impl("q4_1x8_linear", &tandem_cpu::q4_1x8_linear);
  m.impl("q4_1x8_dequantize", &tandem_cpu::q4_1x8_dequantize);
}
