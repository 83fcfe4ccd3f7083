// Linear layers straight from GGML-quantized weights on CPU: y = x @ W^T with W kept as the GGUF's
// bytes, so a decode step reads ~4.5 bits a weight (Q4_1) or ~8.5 (Q8_0) instead of 32.
//
// A block holds 32 consecutive weights of one output row (row n, columns 32b .. 32b+31):
//
//   Q4_1, 20 bytes:  | d fp16 | m fp16 | qs[16] |   w[j] = d * q[j] + m,
//                    q[j] = qs[j] & 15 (j < 16), qs[j - 16] >> 4 (j >= 16)
//   Q8_0, 34 bytes:  | d fp16 | qs[32] int8 |      w[j] = d * qs[j]
//
// Each block is unpacked to fp32 once (mul then add, the same two roundings as the gguf package's
// dequantize, which is what HF runs) and multiplied into up to kRowTile rows of x held in registers;
// only the summation order differs from x @ dequantize(W)^T. Rows of W are split over ATen's
// intra-op thread pool (the caller's torch thread count). Activations stay fp32: no int8 rounding.
//
//   x [M, K] fp32, w [N, K / 32 * block_bytes] uint8  ->  y [M, N] fp32
//   dequantize: w  ->  [N, K] fp32 (for large M, where a BLAS matmul over the whole weight wins)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowTile = 4;

// One block's 32 weights as four vectors of 8 floats.
struct Unpacked {
  __m256 v[4];
};

inline __m256 half_to_vec(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _mm256_set1_ps(_cvtsh_ss(h));
}

struct Q4_1 {
  static constexpr int64_t kBytes = 20;
  static inline Unpacked unpack(const uint8_t* blk) {
    const __m256 d = half_to_vec(blk), m = half_to_vec(blk + 2);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(qs, mask);                     // q[0..15]
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);  // q[16..31]
    Unpacked u;
    u.v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    u.v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    u.v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    u.v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    for (auto& v : u.v) v = _mm256_add_ps(_mm256_mul_ps(v, d), m);
    return u;
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = 34;
  static inline Unpacked unpack(const uint8_t* blk) {
    const __m256 d = half_to_vec(blk);
    Unpacked u;
    for (int i = 0; i < 4; ++i) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i));
      u.v[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d);
    }
    return u;
  }
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[r, n] for the R rows of x starting at x (stride K) and one weight row.
template <typename F, int R>
inline void dot_rows(const float* x, int64_t K, const uint8_t* wrow, float* y, int64_t ldy) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const Unpacked u = F::unpack(wrow + b * F::kBytes);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * K + b * kBlock;
      for (int i = 0; i < 4; ++i) acc[r] = _mm256_fmadd_ps(u.v[i], _mm256_loadu_ps(xb + 8 * i), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(acc[r]);
}

// Past kRowTile rows of x, unpacking a block again for every tile costs more than the multiplies: unpack
// two weight rows once into fp32 scratch (L1-resident: K <= a few thousand) and run 2 x kRowTile tiles.
template <typename F>
void unpack_row(const uint8_t* wrow, int64_t K, float* out) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const Unpacked u = F::unpack(wrow + b * F::kBytes);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + b * kBlock + 8 * i, u.v[i]);
  }
}

// y[r, 0] and y[r, 1] for R rows of x against two unpacked weight rows.
template <int R>
inline void dot_two(const float* x, int64_t K, const float* w0, const float* w1, float* y, int64_t ldy) {
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      a0[r] = _mm256_fmadd_ps(v0, xv, a0[r]);
      a1[r] = _mm256_fmadd_ps(v1, xv, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    y[r * ldy] = hsum(a0[r]);
    y[r * ldy + 1] = hsum(a1[r]);
  }
}

void dot_two_rows(const float* x, int64_t M, int64_t K, const float* w0, const float* w1, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + kRowTile <= M; m += kRowTile) dot_two<kRowTile>(x + m * K, K, w0, w1, y + m * ldy, ldy);
  switch (M - m) {
    case 3: dot_two<3>(x + m * K, K, w0, w1, y + m * ldy, ldy); break;
    case 2: dot_two<2>(x + m * K, K, w0, w1, y + m * ldy, ldy); break;
    case 1: dot_two<1>(x + m * K, K, w0, w1, y + m * ldy, ldy); break;
    default: break;
  }
}

// Weight rows [begin, end) against all of x: y[:, begin:end].
template <typename F>
void linear_block(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N,
                  int64_t begin, int64_t end) {
  if (M <= kRowTile) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* wrow = w + n * row_bytes;
      switch (M) {
        case 4: dot_rows<F, 4>(x, K, wrow, y + n, N); break;
        case 3: dot_rows<F, 3>(x, K, wrow, y + n, N); break;
        case 2: dot_rows<F, 2>(x, K, wrow, y + n, N); break;
        default: dot_rows<F, 1>(x, K, wrow, y + n, N); break;
      }
    }
    return;
  }
  std::vector<float> scratch(2 * K);
  float* w0 = scratch.data();
  float* w1 = w0 + K;
  float pair[2 * 1];
  for (int64_t n = begin; n < end; n += 2) {
    unpack_row<F>(w + n * row_bytes, K, w0);
    if (n + 1 < end) {
      unpack_row<F>(w + (n + 1) * row_bytes, K, w1);
      dot_two_rows(x, M, K, w0, w1, y + n, N);
    } else {  // an odd last row: pair it with itself, keep one column
      for (int64_t m = 0; m < M; ++m) {
        dot_two<1>(x + m * K, K, w0, w0, pair, 1);
        y[m * N + n] = pair[0];
      }
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
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    linear_block<F>(xp, M, K, wp, row_bytes, yp, N, begin, end);
  });
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
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t b = 0; b < K / kBlock; ++b) {
        const Unpacked u = F::unpack(wp + n * row_bytes + b * F::kBytes);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(op + n * K + b * kBlock + 8 * i, u.v[i]);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("q4_1_linear(Tensor x, Tensor w) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor w) -> Tensor");
  m.def("q4_1_dequantize(Tensor w, int k) -> Tensor");
  m.def("q8_0_dequantize(Tensor w, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("q4_1_linear", &quant_linear<Q4_1>);
  m.impl("q8_0_linear", &quant_linear<Q8_0>);
  m.impl("q4_1_dequantize", &dequantize<Q4_1>);
  m.impl("q8_0_dequantize", &dequantize<Q8_0>);
}
