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
//   dequantize: w  ->  [N, K] fp32, bit-exact with the gguf package (embedding lookups, tests)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "quant_blocks.h"
#include "tandem_cpu.h"

namespace {

using namespace tandem_quant;

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
void quant_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  check_args(x, w, F::kBytes);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), row_bytes = w.size(1);
  tandem_cpu::check_out(y, M, N);
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // Each thread walks its own weight rows; every row meets all of x (M small: x stays in L1/L2).
  const QuantizedX& qx = quantize_x(xp, M, K);
  tandem_cpu::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    linear_block<F>(qx, M, K, wp, row_bytes, yp, N, begin, end);
  });
}

template <typename F>
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w) {
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  quant_linear_out<F>(x, w, y);
  return y;
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

}  // namespace

namespace tandem_cpu {

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& w) { return quant_linear<Q4_1>(x, w); }
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& w) { return quant_linear<Q8_0>(x, w); }
void q4_1_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) { quant_linear_out<Q4_1>(x, w, y); }
void q8_0_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) { quant_linear_out<Q8_0>(x, w, y); }

}  // namespace tandem_cpu

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("q4_1_linear(Tensor x, Tensor w) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor w) -> Tensor");
  m.def("q4_1_dequantize(Tensor w, int k) -> Tensor");
  m.def("q8_0_dequantize(Tensor w, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("q4_1_linear", &tandem_cpu::q4_1_linear);
  m.impl("q8_0_linear", &tandem_cpu::q8_0_linear);
  m.impl("q4_1_dequantize", &dequantize<Q4_1>);
  m.impl("q8_0_dequantize", &dequantize<Q8_0>);
}
