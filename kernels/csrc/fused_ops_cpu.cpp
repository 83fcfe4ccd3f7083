// The elementwise work between a decoder layer's matmuls, one pass over each row on CPU.
//
// torch runs RMSNorm as ~8 ops (pow, mean, add, rsqrt, mul, ...) at ~90 us a call on this class of
// CPU for one token; a decode step makes 61 of them. Fused, a row is read once to sum its squares and
// once to scale it, and the residual add rides along.
//
//   rms_norm(x [M, H], w [H], eps)             -> x / sqrt(mean(x^2) + eps) * w          (fp32)
//   add_rms_norm_(h [M, H], d [M, H], w, eps)  -> h += d in place; rms_norm(h, w, eps)
//   silu_mul(gu [M, 2I])                       -> silu(gu[:, :I]) * gu[:, I:]            [M, I]
//   rope_(x [T, heads, D], cos [T, D], sin [T, D]) in place, HF's half-split layout:
//       x[..., :D/2], x[..., D/2:]  <-  x1 * cos1 - x2 * sin1,  x2 * cos2 + x1 * sin2
//   argmax_rows(x [M, V])                      -> [M] int64, as torch.argmax(x, -1): the first maximum, or the
//       first NaN (a greedy step's tokens: 8 rows of 49,152 logits in 11-18 us on 2 threads, torch's ~0.1 ms)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "tandem_cpu.h"
#include "thread_team.h"

namespace {

using Vec = at::vec::Vectorized<float>;
// The fewest rows a thread takes. Not fewer in a decode step's thread team: splitting a batch-8 step's norms,
// RoPE and SiLU 4 rows a thread cut their own time (0.46 -> 0.33 ms a step) but slowed the step by ~0.2 ms
// (bench_step_team): the rows then cross between the cores' caches around every op.
constexpr int64_t kRowGrain = 16;

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, name,
              " must be [M, H] fp32 with contiguous rows");
}

// out[:] = x[:] * rsqrt(mean(x^2) + eps) * w[:], for one row of H values.
void norm_row(const float* x, const float* w, float* out, int64_t H, float eps) {
  Vec sq(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= H; i += Vec::size()) {
    const Vec v = Vec::loadu(x + i);
    sq = at::vec::fmadd(v, v, sq);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sq);
  for (; i < H; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(H) + eps);
  const Vec vinv(inv);
  i = 0;
  for (; i + Vec::size() <= H; i += Vec::size()) (Vec::loadu(x + i) * vinv * Vec::loadu(w + i)).store(out + i);
  for (; i < H; ++i) out[i] = x[i] * inv * w[i];
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")  // run only where cpu_isa.cpp found all three
namespace avx512 {
#include "vec512_exp.h"

// out = silu(g) * u over n values on 16 lanes, a lane as at::vec's a / (1 + exp(-a)) * b: the same bits.
// kStream: out 64-byte aligned, n a multiple of 16, written past the cache (non-temporal).
template <bool kStream = false>
void silu_mul_row(float* out, const float* g, const float* u, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  const auto silu_mul = [&](__m512 a, __m512 b) {
    const __m512 e = exp_u20(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), sign)));
    return _mm512_mul_ps(_mm512_div_ps(a, _mm512_add_ps(one, e)), b);
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = silu_mul(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i));
    if constexpr (kStream) _mm512_stream_ps(out + i, v);
    else _mm512_storeu_ps(out + i, v);
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
  if (tail != 0) {
    const __m512 a = _mm512_maskz_loadu_ps(tail, g + i), b = _mm512_maskz_loadu_ps(tail, u + i);
    _mm512_mask_storeu_ps(out + i, tail, silu_mul(a, b));
  }
}
}  // namespace avx512
#pragma GCC pop_options

// out[i] = silu(g[i]) * u[i]: on 512-bit vectors where the kernels run AVX-512 (half the instructions; a batch-8
// decode step's SiLU is ~4 us a layer on one thread), the same bits as at::vec's 256-bit ones.
void silu_mul_span(float* out, const float* g, const float* u, int64_t n, bool wide) {
  if (wide) avx512::silu_mul_row(out, g, u, n);
  else at::vec::map2([](Vec a, Vec b) { return a / (Vec(1.f) + a.neg().exp_u20()) * b; }, out, g, u, n);
}

}  // namespace

namespace tandem_cpu {

void rms_norm_out(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  check_rows(x, "x");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kFloat && w.numel() == x.size(1), "w must be [H] fp32");
  const int64_t M = x.size(0), H = x.size(1);
  check_out(out, M, H);
  tandem_cpu::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      norm_row(x.data_ptr<float>() + m * x.stride(0), w.data_ptr<float>(), out.data_ptr<float>() + m * H, H,
               static_cast<float>(eps));
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  rms_norm_out(x, w, eps, out);
  return out;
}

void add_rms_norm_out_(at::Tensor& h, const at::Tensor& d, const at::Tensor& w, double eps, at::Tensor& out) {
  check_rows(h, "h");
  check_rows(d, "d");
  TORCH_CHECK(h.sizes() == d.sizes(), "h and d must have one shape");
  const int64_t M = h.size(0), H = h.size(1);
  tandem_cpu::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      float* hr = h.data_ptr<float>() + m * h.stride(0);
      const float* dr = d.data_ptr<float>() + m * d.stride(0);
      at::vec::map2([](Vec a, Vec b) { return a + b; }, hr, hr, dr, H);
    }
  });
  rms_norm_out(h, w, eps, out);
}

at::Tensor add_rms_norm_(at::Tensor& h, const at::Tensor& d, const at::Tensor& w, double eps) {
  at::Tensor out = at::empty(h.sizes(), h.options());
  add_rms_norm_out_(h, d, w, eps, out);
  return out;
}

void silu_mul_out(const at::Tensor& gu, at::Tensor& out) {
  check_rows(gu, "gu");
  TORCH_CHECK(gu.size(1) % 2 == 0, "gu must hold gate and up halves");
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  check_out(out, M, I);
  const bool wide = tandem_cpu::isa() == tandem_cpu::Isa::kAvx512Vnni;
  tandem_cpu::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* g = gu.data_ptr<float>() + m * gu.stride(0);
      silu_mul_span(out.data_ptr<float>() + m * I, g, g + I, I, wide);
    }
  });
}

void silu_mul_units(float* out, const float* gu, int64_t units, int64_t unit, bool stream) {
  const bool wide = tandem_cpu::isa() == tandem_cpu::Isa::kAvx512Vnni;
  if (stream && unit % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 64 == 0) {
    for (int64_t k = 0; k < units; ++k) {
      float* o = out + k * unit;
      const float *g = gu + 2 * k * unit, *u = gu + (2 * k + 1) * unit;
      if (wide) {
        avx512::silu_mul_row<true>(o, g, u, unit);
        continue;
      }
      alignas(32) float line[16];  // at::vec's values, 16 at a time, then past the cache
      for (int64_t i = 0; i < unit; i += 16) {
        silu_mul_span(line, g + i, u + i, 16, false);
        _mm256_stream_ps(o + i, _mm256_load_ps(line));
        _mm256_stream_ps(o + i + 8, _mm256_load_ps(line + 8));
      }
    }
    return;
  }
  for (int64_t k = 0; k < units; ++k)
    silu_mul_span(out + k * unit, gu + 2 * k * unit, gu + (2 * k + 1) * unit, unit, wide);
}

at::Tensor silu_mul(const at::Tensor& gu) {
  at::Tensor out = at::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  silu_mul_out(gu, out);
  return out;
}

void rope_head(float* row, const float* c, const float* s, int64_t D) {
  const int64_t half = D / 2;
  int64_t i = 0;
  for (; i + Vec::size() <= half; i += Vec::size()) {
    const Vec x1 = Vec::loadu(row + i), x2 = Vec::loadu(row + half + i);
    (x1 * Vec::loadu(c + i) - x2 * Vec::loadu(s + i)).store(row + i);
    (x2 * Vec::loadu(c + half + i) + x1 * Vec::loadu(s + half + i)).store(row + half + i);
  }
  for (; i < half; ++i) {
    const float x1 = row[i], x2 = row[half + i];
    row[i] = x1 * c[i] - x2 * s[i];
    row[half + i] = x2 * c[half + i] + x1 * s[half + i];
  }
}

void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1, "x must be [T, heads, D] fp32");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == x.size(0) &&
                  cos.size(1) == x.size(2) && sin.sizes() == cos.sizes(),
              "cos and sin must be [T, D] contiguous");
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2);
  tandem_cpu::parallel_for(0, T, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h)
        rope_head(x.data_ptr<float>() + t * x.stride(0) + h * x.stride(1), cos.data_ptr<float>() + t * D,
                  sin.data_ptr<float>() + t * D, D);
  });
}

// Two passes over a row: its maximum (at::vec::maximum propagates NaN, so a row with one has a NaN maximum), four
// chains of 8 lanes so the max latency overlaps, then the first index holding it, 8 lanes a compare. The second
// pass was scalar: 20 us a row where the maximum lay near the end of 49,152 logits, ~5x the first.
int64_t argmax_row(const float* x, int64_t V) {
  constexpr int64_t kW = Vec::size();
  const Vec lowest(-std::numeric_limits<float>::infinity());
  Vec best[4] = {lowest, lowest, lowest, lowest};
  int64_t i = 0;
  for (; i + 4 * kW <= V; i += 4 * kW)
    for (int64_t c = 0; c < 4; ++c) best[c] = at::vec::maximum(best[c], Vec::loadu(x + i + c * kW));
  for (; i + kW <= V; i += kW) best[0] = at::vec::maximum(best[0], Vec::loadu(x + i));
  const Vec all = at::vec::maximum(at::vec::maximum(best[0], best[1]), at::vec::maximum(best[2], best[3]));
  float top = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, all);
  for (; i < V; ++i) top = std::isnan(x[i]) || std::isnan(top) ? NAN : std::max(top, x[i]);
  const bool nan = std::isnan(top);
  const __m256 t = _mm256_set1_ps(top);
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {  // stops at the first hit: -0 equals +0, as == says
    const __m256 v = _mm256_loadu_ps(x + j);
    const int hits = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, t, _CMP_EQ_OQ));
    if (hits != 0) return j + __builtin_ctz(static_cast<unsigned>(hits));
  }
  for (; j < V; ++j)
    if (nan ? std::isnan(x[j]) : x[j] == top) return j;
  return 0;  // unreachable: top is one of the row's values
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) > 0, "argmax of an empty row");
  const int64_t M = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  tandem_cpu::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x.data_ptr<float>() + r * x.stride(0), V);
  });
  return out;
}

}  // namespace tandem_cpu

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) h, Tensor d, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("rms_norm", &tandem_cpu::rms_norm);
  m.impl("add_rms_norm_", &tandem_cpu::add_rms_norm_);
  m.impl("silu_mul", &tandem_cpu::silu_mul);
  m.impl("rope_", &tandem_cpu::rope_);
  m.impl("argmax_rows", &tandem_cpu::argmax_rows);
}
