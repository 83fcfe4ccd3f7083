// GGUF weights interleaved by 8 rows: the same blocks as quant_linear_cpu.cpp's, regrouped so the kernel
// multiplies faster from batch ~4.
//
// Row by row, every (block, row of x) pays ~7-10 instructions of bookkeeping (convert, scale, accumulate,
// and a horizontal sum a row) for one weight row: from batch ~4 a step is bound by those, not by the bytes.
// Interleaving 8 weight rows lets one 256-bit lane hold one row's partial sum, so that bookkeeping is shared
// by 8 rows (as llama.cpp's repacked Q4_0 8x8 GEMM does). A group of 8 rows keeps the bytes of its blocks:
//
//   q4_1x8, 160 bytes a (group, block):  | d[8] fp16 | m[8] fp16 | v0 | v1 | v2 | v3 |
//     vk: 32 bytes, 4 a row (row n at bytes 4n .. 4n+3); byte i of row n = q[n][8k + i] | q[n][8k + 4 + i] << 4
//   q8_0x8, 272 bytes a (group, block):  | d[8] fp16 | v0 | ... | v7 |
//     vk: 32 bytes, 4 a row; byte i of row n = q[n][4k + i] (int8)
//
// Q4_1: the low nibbles of vk times x[8k .. 8k+3] (broadcast to every row) and the high nibbles times
// x[8k+4 .. 8k+7] give each row's sum over 8 values. A row's 8 maddubs results add up in int16 without
// overflow (8 * 2 * 15 * 127 = 30480 < 32767); one madd, convert and FMA then finish the block for 8 rows.
// Q8_0: maddubs takes one operand unsigned, so |vk| times x carrying vk's signs (llama.cpp's trick); a pair
// can reach 2 * 127 * 127, so each maddubs result widens to int32 before the next is added.
//
//   q4_1_to_x8 / q8_0_to_x8: w [N, K / 32 * 20 or 34] -> [N / 8, K / 32 * 160 or 272] uint8
//   q4_1x8_linear / q8_0x8_linear: x [M, K] fp32 -> y [M, N] fp32
//   q4_1x8_dequantize / q8_0x8_dequantize: -> [N, K] fp32, bit-exact with the gguf package

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>

#include "quant_blocks.h"
#include "tandem_cpu.h"

namespace {

using namespace tandem_quant;

constexpr int64_t kX8Rows = 8;

struct Q4_1x8 {
  static constexpr int64_t kBytes = 160, kSourceBytes = kQ4_1Bytes;

  static inline uint8_t value(const uint8_t* blk, int64_t j) {  // the GGUF block's j-th 4-bit value
    return j < 16 ? blk[4 + j] & 0x0F : blk[4 + j - 16] >> 4;
  }

  // One source block (row n of the group) into its interleaved (group, block).
  static void repack(const uint8_t* blk, int64_t n, uint8_t* dst) {
    __builtin_memcpy(dst + 2 * n, blk, 2);           // d
    __builtin_memcpy(dst + 16 + 2 * n, blk + 2, 2);  // m
    for (int64_t k = 0; k < 4; ++k)
      for (int64_t i = 0; i < 4; ++i)
        dst[32 + 32 * k + 4 * n + i] = static_cast<uint8_t>(value(blk, 8 * k + i) | value(blk, 8 * k + 4 + i) << 4);
  }

  static void dequantize(const uint8_t* blk, int64_t n, float* row) {  // row n's 32 weights of this block
    const float d = half_to_float(blk + 2 * n), m = half_to_float(blk + 16 + 2 * n);
    for (int64_t k = 0; k < 4; ++k)
      for (int64_t i = 0; i < 4; ++i) {
        const uint8_t byte = blk[32 + 32 * k + 4 * n + i];
        row[8 * k + i] = static_cast<float>(byte & 0x0F) * d + m;  // the gguf package's order
        row[8 * k + 4 + i] = static_cast<float>(byte >> 4) * d + m;
      }
  }

  // y[r, the group's 8 rows] for R rows of quantized x starting at m0.
  template <int R>
  static inline void dot_rows(const QuantizedX& x, int64_t m0, int64_t nb, const uint8_t* group, float* y,
                              int64_t ldy) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = group + b * kBytes;
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
};

struct Q8_0x8 {
  static constexpr int64_t kBytes = 272, kSourceBytes = kQ8_0Bytes;

  static void repack(const uint8_t* blk, int64_t n, uint8_t* dst) {
    __builtin_memcpy(dst + 2 * n, blk, 2);  // d
    for (int64_t k = 0; k < 8; ++k) __builtin_memcpy(dst + 16 + 32 * k + 4 * n, blk + 2 + 4 * k, 4);
  }

  static void dequantize(const uint8_t* blk, int64_t n, float* row) {
    const float d = half_to_float(blk + 2 * n);
    for (int64_t k = 0; k < 8; ++k)
      for (int64_t i = 0; i < 4; ++i)
        row[4 * k + i] = static_cast<float>(static_cast<int8_t>(blk[16 + 32 * k + 4 * n + i])) * d;
  }

  template <int R>
  static inline void dot_rows(const QuantizedX& x, int64_t m0, int64_t nb, const uint8_t* group, float* y,
                              int64_t ldy) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = group + b * kBytes;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
      const __m256i* v = reinterpret_cast<const __m256i*>(blk + 16);
      __m256i magnitude[8];
      for (int k = 0; k < 8; ++k) magnitude[k] = _mm256_abs_epi8(_mm256_loadu_si256(v + k));
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * nb + b;
        const int8_t* qx = x.q.data() + i * kBlock;
        __m256i sum32 = _mm256_setzero_si256();
        for (int k = 0; k < 8; ++k) {  // values 4k .. 4k+3 of each row
          int32_t four;
          __builtin_memcpy(&four, qx + 4 * k, 4);
          const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(four), _mm256_loadu_si256(v + k));
          sum32 = _mm256_add_epi32(sum32, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[k], signed_x), ones));
        }
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum32), _mm256_mul_ps(d, _mm256_set1_ps(x.scale[i])), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
  }
};

template <typename F>
at::Tensor to_x8(const at::Tensor& w, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be [N, bytes] contiguous uint8");
  TORCH_CHECK(K % kBlock == 0 && w.size(1) == K / kBlock * F::kSourceBytes, "w's row bytes do not match K=", K);
  TORCH_CHECK(w.size(0) % kX8Rows == 0, "interleaving by 8 rows needs a multiple of 8 rows, got ", w.size(0));
  const int64_t groups = w.size(0) / kX8Rows, nb = K / kBlock, row_bytes = w.size(1);
  at::Tensor out = at::empty({groups, nb * F::kBytes}, w.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t n = 0; n < kX8Rows; ++n)
          F::repack(wp + (g * kX8Rows + n) * row_bytes + b * F::kSourceBytes, n, op + (g * nb + b) * F::kBytes);
  });
  return out;
}

template <typename F>
at::Tensor x8_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] contiguous fp32");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32, got ", x.size(1));
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be [N / 8, bytes] uint8");
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock, groups = w.size(0), N = groups * kX8Rows;
  TORCH_CHECK(w.size(1) == nb * F::kBytes, "w has ", w.size(1), " bytes a group; K=", K, " needs ", nb * F::kBytes);
  at::Tensor y = at::empty({M, N}, x.options());
  const QuantizedX qx = quantize_x(x.data_ptr<float>(), M, K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // Each thread walks its own groups of weight rows; every group meets all of x (M small: x stays in L1/L2).
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* group = wp + g * nb * F::kBytes;
      float* yg = yp + g * kX8Rows;
      int64_t m = 0;
      for (; m + kRowTile <= M; m += kRowTile) F::template dot_rows<kRowTile>(qx, m, nb, group, yg + m * N, N);
      switch (M - m) {
        case 3: F::template dot_rows<3>(qx, m, nb, group, yg + m * N, N); break;
        case 2: F::template dot_rows<2>(qx, m, nb, group, yg + m * N, N); break;
        case 1: F::template dot_rows<1>(qx, m, nb, group, yg + m * N, N); break;
        default: break;
      }
    }
  });
  return y;
}

template <typename F>
at::Tensor x8_dequantize(const at::Tensor& w, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be [N / 8, bytes] uint8");
  TORCH_CHECK(K % kBlock == 0 && w.size(1) == K / kBlock * F::kBytes, "w's group bytes do not match K=", K);
  const int64_t groups = w.size(0), nb = K / kBlock;
  at::Tensor out = at::empty({groups * kX8Rows, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t n = 0; n < kX8Rows; ++n)
          F::dequantize(wp + (g * nb + b) * F::kBytes, n, op + (g * kX8Rows + n) * K + b * kBlock);
  });
  return out;
}

}  // namespace

namespace tandem_cpu {

at::Tensor q4_1x8_linear(const at::Tensor& x, const at::Tensor& w) { return x8_linear<Q4_1x8>(x, w); }
at::Tensor q8_0x8_linear(const at::Tensor& x, const at::Tensor& w) { return x8_linear<Q8_0x8>(x, w); }

}  // namespace tandem_cpu

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("q4_1_to_x8(Tensor w, int k) -> Tensor");
  m.def("q4_1x8_linear(Tensor x, Tensor w) -> Tensor");
  m.def("q4_1x8_dequantize(Tensor w, int k) -> Tensor");
  m.def("q8_0_to_x8(Tensor w, int k) -> Tensor");
  m.def("q8_0x8_linear(Tensor x, Tensor w) -> Tensor");
  m.def("q8_0x8_dequantize(Tensor w, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("q4_1_to_x8", &to_x8<Q4_1x8>);
  m.impl("q4_1x8_linear", &tandem_cpu::q4_1x8_linear);
  m.impl("q4_1x8_dequantize", &x8_dequantize<Q4_1x8>);
  m.impl("q8_0_to_x8", &to_x8<Q8_0x8>);
  m.impl("q8_0x8_linear", &tandem_cpu::q8_0x8_linear);
  m.impl("q8_0x8_dequantize", &x8_dequantize<Q8_0x8>);
}
