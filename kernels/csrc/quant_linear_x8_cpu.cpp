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
// "x8p" (q4_1x8p, q8_0x8p), the layout where the 512-bit loop multiplies from one row of x: the same groups
// stored two by two, block by block (X8Layout): (group 2p, block b) then (group 2p + 1, block b), so the loop
// that multiplies a pair at once reads one stream of 320 (544) bytes a block. Read as two streams (each group's
// blocks in a run of their own, "x8") it reached ~85% of a plain sum's bandwidth on two Zen 5 cores from DRAM;
// one stream reaches the sum's rate. An odd last group is stored alone after the pairs. The 256-bit loops
// (AVX2, AVX-VNNI) read x8p too, but ~10% slower than x8 from memory: kernels/quant_linear.py picks x8p only
// where the 512-bit loop runs at every batch.
//
// Q4_1: the low nibbles of vk times x[8k .. 8k+3] (broadcast to every row) and the high nibbles times
// x[8k+4 .. 8k+7] give each row's sum over 8 values. A row's 8 maddubs results add up in int16 without
// overflow (8 * 2 * 15 * 127 = 30480 < 32767); one madd, convert and FMA then finish the block for 8 rows.
// Q8_0: maddubs takes one operand unsigned, so |vk| times x carrying vk's signs (llama.cpp's trick); a pair
// can reach 2 * 127 * 127, so each maddubs result widens to int32 before the next is added.
// Where the CPU has VNNI, one dpbusd does what maddubs, the add and the madd do (quant_x8_dot.h holds the
// inner loops, compiled once per instruction set; the best the CPU has is picked at load).
//
//   q4_1_to_x8 / q8_0_to_x8: w [N, K / 32 * 20 or 34] -> [N / 8, K / 32 * 160 or 272] uint8 (x8p: q4_1_to_x8p,
//     ... and a row of it is a group's worth of bytes, not the group: X8Layout says where each group's blocks lie)
//   q4_1x8_linear / q8_0x8_linear: x [M, K] fp32 -> y [M, N] fp32
//   q4_1x8_dequantize / q8_0x8_dequantize: -> [N, K] fp32, bit-exact with the gguf package
//   q4_1x8_rows / q8_0x8_rows: w, ids [T] int64 -> [T, K] fp32, those rows of the same
//   q4_1x8_linear_silu / q8_0x8_linear_silu: x [M, K], w a gate_up whose gate and up rows alternate every 16
//     -> silu(gate) * up [M, N / 2] fp32 (x8_linear_silu_out)
//   (and each of these for x8p: q4_1x8p_linear, ...)
// The instruction set is cpu_isa.cpp's (torch.ops.tandem_cpu.set_isa): every one gives bit-identical outputs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "quant_blocks.h"
#include "tandem_cpu.h"
#include "thread_team.h"

namespace {

using namespace tandem_quant;

constexpr int64_t kX8Rows = 8;
constexpr int64_t kGroupGrain = 4;  // groups of 8 rows: the least a thread takes of a matrix
// From this many rows of x (a prompt's, not a decode batch's) a matrix is bound by its instructions, not by streaming
// its weights: the threads take kGroupGrain groups at a time from a shared counter instead of halves, which left the
// leader waiting on the worker. A fresh prefill of 100 / 250 / 400 tokens: -6%, -6%, -9 to -15% (in-process A/B).
constexpr int64_t kSharedRows = 64;

// Where (group g, block b) lies in a matrix of `groups` groups of `nb` blocks. x8: group after group. x8p
// (`pairs`): groups 2p and 2p + 1 alternate block by block in pair p's 2 * nb blocks; a last group without a
// partner has its nb blocks to itself. Either way a range of whole pairs is one run of bytes (g * nb *
// block_bytes on), as the team's prefetch takes it.
struct X8Layout {
  int64_t nb, groups, block_bytes;
  bool pairs;

  bool paired(int64_t g) const { return pairs && (g | 1) < groups; }
  int64_t stride(int64_t g) const { return paired(g) ? 2 * block_bytes : block_bytes; }  // block b to b + 1
  int64_t offset(int64_t g, int64_t b) const {
    if (!paired(g)) return g * nb * block_bytes + b * block_bytes;
    return (g & ~int64_t{1}) * nb * block_bytes + (g & 1) * block_bytes + 2 * b * block_bytes;
  }
  // Walking a pair (groups g and g + 1, g even in x8p): group g + 1's block lies partner() bytes after group g's,
  // and block b + 1 pair_stride() bytes after block b.
  int64_t partner() const { return pairs ? block_bytes : nb * block_bytes; }
  int64_t pair_stride() const { return pairs ? 2 * block_bytes : block_bytes; }
  // The whole pairs of groups [g0, g1) as [first, end), for the 512-bit and tile loops: a range starting at a
  // pair's second group (x8p: a cut between threads) leaves that group before first, and the groups from end on
  // (one without its partner in the range) are left too, both to the 256-bit loop.
  std::pair<int64_t, int64_t> whole_pairs(int64_t g0, int64_t g1) const {
    const int64_t first = pairs && g0 % 2 == 1 && g0 < g1 ? g0 + 1 : g0;
    int64_t end = first;
    while (end + 2 <= g1 && (!pairs || paired(end))) end += 2;
    return {first, end};
  }
};

// Where the loops write group g's 8 columns for row r of x: at + r * ld + (g - first) * 8. A whole y [M, N] is
// {y, N, 0}; x8_linear_silu_out gives each thread a scratch of its own groups alone.
struct GroupOutput {
  float* at;
  int64_t ld, first;

  float* group(int64_t g) const { return at + (g - first) * 8; }
};

// From this many bytes of output (prefill chunks) the loops write it with non-temporal stores, past the cache:
// quant_x8_amx.h's y and x8_linear_silu_out's act each say why.
constexpr int64_t kStreamedOutputBytes = int64_t{1} << 20;

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
};

// The inner loops, once per instruction set (quant_x8_dot.h). Machines with VNNI (Cascade Lake and later
// Xeons, Alder Lake and later cores, Zen 4) do a 4-product sum in one dpbusd where AVX2 needs maddubs, an
// int16 add and a madd; with AVX-512 there are 32 vector registers, enough for 8 rows of x a tile, and
// 512-bit ones that take two groups at once (quant_x8_dot512.h).
namespace avx2 {
constexpr bool kVnni = false;
constexpr int kRowTile = 4;
inline __m256i dpbusd(__m256i acc, __m256i, __m256i) { return acc; }  // never called: kVnni is false
#include "quant_x8_dot.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avxvnni")
namespace avx_vnni {
constexpr bool kVnni = true;
constexpr int kRowTile = 4;
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#include "quant_x8_dot.h"
}  // namespace avx_vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
namespace avx512_vnni {
constexpr bool kVnni = true;
constexpr int kRowTile = 8;
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#include "quant_x8_dot.h"
#include "quant_x8_dot512.h"
}  // namespace avx512_vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")  // run only where cpu_isa.cpp got tiles
namespace avx512_vnni {
#include "quant_x8_amx.h"
}  // namespace avx512_vnni
#pragma GCC pop_options

template <typename F, bool kPairs>
at::Tensor to_x8(const at::Tensor& w, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be [N, bytes] contiguous uint8");
  TORCH_CHECK(K % kBlock == 0 && w.size(1) == K / kBlock * F::kSourceBytes, "w's row bytes do not match K=", K);
  TORCH_CHECK(w.size(0) % kX8Rows == 0, "interleaving by 8 rows needs a multiple of 8 rows, got ", w.size(0));
  const int64_t groups = w.size(0) / kX8Rows, nb = K / kBlock, row_bytes = w.size(1);
  at::Tensor out = at::empty({groups, nb * F::kBytes}, w.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const X8Layout layout{nb, groups, F::kBytes, kPairs};
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t n = 0; n < kX8Rows; ++n)
          F::repack(wp + (g * kX8Rows + n) * row_bytes + b * F::kSourceBytes, n, op + layout.offset(g, b));
  });
  return out;
}

// The loop over groups for M rows of x on this CPU's instruction set: every one gives the same bits.
template <bool kQ4_1>
auto groups_loop(int64_t M) {
  auto* groups_fn = &avx2::x8_groups<kQ4_1>;
  const tandem_cpu::Isa isa = tandem_cpu::isa();
  if (isa == tandem_cpu::Isa::kAvx512Vnni)
    groups_fn = M < tandem_cpu::min_rows_for_pairs() ? &avx512_vnni::x8_groups<kQ4_1>  // same bits (cpu_isa.cpp)
                                                     : &avx512_vnni::x8_pair_groups<kQ4_1>;
  const int64_t amx_rows = tandem_cpu::amx_min_rows();
  if (amx_rows > 0 && M >= amx_rows) groups_fn = &avx512_vnni::x8_pair_groups_amx<kQ4_1>;  // same bits again
  if (isa == tandem_cpu::Isa::kAvxVnni) groups_fn = &avx_vnni::x8_groups<kQ4_1>;
  return groups_fn;
}

// x [M, K] fp32 and w [N / 8, K / 32 * F::kBytes] checked; returns M, N and w's blocks a group (nb).
template <typename F>
std::tuple<int64_t, int64_t, int64_t> check_x8_operands(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] contiguous fp32");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32, got ", x.size(1));
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be [N / 8, bytes] uint8");
  const int64_t K = x.size(1), nb = K / kBlock;
  TORCH_CHECK(w.size(1) == nb * F::kBytes, "w has ", w.size(1), " bytes a group; K=", K, " needs ", nb * F::kBytes);
  return {x.size(0), w.size(0) * kX8Rows, nb};
}

template <typename F, bool kPairs>
void x8_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, const tandem_cpu::ColumnsDone* after) {
  const auto [M, N, nb] = check_x8_operands<F>(x, w);
  const int64_t groups = N / kX8Rows;
  tandem_cpu::check_out(y, M, N);
  const QuantizedX& qx = quantize_x(x.data_ptr<float>(), M, x.size(1));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const auto groups_fn = groups_loop<F::kBytes == Q4_1x8::kBytes>(M);
  // Each thread walks its own groups of weight rows; every group meets all of x (M small: x stays in L1/L2). In a
  // decode step's thread team the workers have prefetched theirs (x8_prefetch_target): a smaller share for the
  // leader. A row's output does not depend on the cut (an odd group on the 256-bit loop gives the same bits).
  const auto share = [&](int64_t begin, int64_t end) {
    groups_fn(qx, M, nb, wp, begin, end, GroupOutput{yp, N, 0}, N, kPairs);
    if (after != nullptr) (*after)(begin * kX8Rows, end * kX8Rows);
  };
  // (A caller finishing heads of columns as they are done, the decode stack's QKV, keeps its halves.)
  if (M >= kSharedRows && after == nullptr) tandem_cpu::shared_parallel_for(0, groups, kGroupGrain, share);
  else tandem_cpu::prefetched_parallel_for(0, groups, kGroupGrain, share);
}

// gate_up's rows alternate gate and up every kSiluUnit rows (unit u: gate rows 16u .. 16u + 15, then up's; see
// kernels/quant_linear.py pair_gate_up): a unit's gate and up groups are kGroupGrain groups, the least a thread
// takes.
constexpr int64_t kSiluUnit = 16, kUnitGroups = 2 * kSiluUnit / kX8Rows;
static_assert(kUnitGroups == kGroupGrain, "a thread's share holds whole units");

// act [M, N / 2] = silu(gate) * up of y = x w^T, where w is such a gate_up: each thread multiplies its own units
// into a scratch of them alone and applies the SiLU while they sit in its cache. Against the matrix then silu_mul:
// no y [M, N] written out and read back (a 500-token prefill's gate_up is 6 MB a layer, streamed past the cache by
// quant_x8_amx.h, then read again) and no pass of its own in a decode step (the leader's, reading the other core's
// half). The same sums and the same SiLU: the same bits.
template <typename F, bool kPairs>
void x8_linear_silu_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& act) {
  const auto [M, N, nb] = check_x8_operands<F>(x, w);
  const int64_t groups = N / kX8Rows, I = N / 2;
  TORCH_CHECK(groups % kUnitGroups == 0, "gate_up's ", N, " rows are not whole units of gate and up (", kSiluUnit,
              " rows each)");
  tandem_cpu::check_out(act, M, I);
  const QuantizedX& qx = quantize_x(x.data_ptr<float>(), M, x.size(1));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* ap = act.data_ptr<float>();
  const auto groups_fn = groups_loop<F::kBytes == Q4_1x8::kBytes>(M);
  // A prefill chunk's act (1.5 MB at 256 rows here) goes past the cache: each unit writes one line of every row,
  // 6 KB apart, and read for ownership they stalled the loop (500 rows: 1.05x the unfused matrix and silu_mul; on
  // the 256-bit loops 1.08x; streamed, 0.86-0.95x and 0.97x).
  const bool stream = M * I * static_cast<int64_t>(sizeof(float)) >= kStreamedOutputBytes;
  const auto share = [&](int64_t begin, int64_t end) {
    // The units whose first group lies in [begin, end): a cut inside a unit (the team's split is in whole units
    // only once it has learned one) leaves it whole to the thread before.
    const int64_t u0 = (begin + kUnitGroups - 1) / kUnitGroups, u1 = (end + kUnitGroups - 1) / kUnitGroups;
    if (u0 >= u1) return;
    const int64_t ld = (u1 - u0) * 2 * kSiluUnit;
    thread_local std::vector<float> scratch;  // a thread's own: ~50 KB at batch 8, 64 KB a 512-row prefill chunk
    scratch.resize(static_cast<size_t>(M * ld));
    groups_fn(qx, M, nb, wp, u0 * kUnitGroups, u1 * kUnitGroups, GroupOutput{scratch.data(), ld, u0 * kUnitGroups},
              N, kPairs);
    for (int64_t r = 0; r < M; ++r)
      tandem_cpu::silu_mul_units(ap + r * I + u0 * kSiluUnit, scratch.data() + r * ld, u1 - u0, kSiluUnit, stream);
    if (stream) _mm_sfence();  // non-temporal stores are weakly ordered: visible before the threads join
  };
  if (M >= kSharedRows) tandem_cpu::shared_parallel_for(0, groups, kGroupGrain, share);
  else tandem_cpu::prefetched_parallel_for(0, groups, kGroupGrain, share);
}

template <typename F, bool kPairs>
at::Tensor x8_linear_silu(const at::Tensor& x, const at::Tensor& w) {
  at::Tensor act = at::empty({x.size(0), w.size(0) * kX8Rows / 2}, x.options());
  x8_linear_silu_out<F, kPairs>(x, w, act);
  return act;
}

template <typename F, bool kPairs>
at::Tensor x8_linear(const at::Tensor& x, const at::Tensor& w) {
  at::Tensor y = at::empty({x.size(0), w.size(0) * kX8Rows}, x.options());
  x8_linear_out<F, kPairs>(x, w, y, nullptr);
  return y;
}

template <typename F, bool kPairs>
at::Tensor x8_dequantize(const at::Tensor& w, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be [N / 8, bytes] uint8");
  TORCH_CHECK(K % kBlock == 0 && w.size(1) == K / kBlock * F::kBytes, "w's group bytes do not match K=", K);
  const int64_t groups = w.size(0), nb = K / kBlock;
  at::Tensor out = at::empty({groups * kX8Rows, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const X8Layout layout{nb, groups, F::kBytes, kPairs};
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t n = 0; n < kX8Rows; ++n)
          F::dequantize(wp + layout.offset(g, b), n, op + (g * kX8Rows + n) * K + b * kBlock);
  });
  return out;
}

// Rows `ids` of an interleaved weight, dequantized: an embedding lookup (the tied head's table). One call, where
// dequantizing the ids' groups and picking their rows out took ~10 torch ops (~60 us of a 3 ms step).
template <typename F, bool kPairs>
at::Tensor x8_rows(const at::Tensor& w, const at::Tensor& ids, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be [N / 8, bytes] uint8");
  TORCH_CHECK(K % kBlock == 0 && w.size(1) == K / kBlock * F::kBytes, "w's group bytes do not match K=", K);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be a 1-d int64 tensor");
  const int64_t T = ids.size(0), nb = K / kBlock, N = w.size(0) * kX8Rows;
  const at::Tensor idc = ids.contiguous();
  const int64_t* idp = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(idp[t] >= 0 && idp[t] < N, "id ", idp[t], " is outside [0, ", N, ")");
  at::Tensor out = at::empty({T, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const X8Layout layout{nb, w.size(0), F::kBytes, kPairs};
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = idp[t] / kX8Rows, n = idp[t] % kX8Rows;
      for (int64_t b = 0; b < nb; ++b) F::dequantize(wp + layout.offset(g, b), n, op + t * K + b * kBlock);
    }
  });
  return out;
}

}  // namespace

namespace tandem_cpu {

void q4_1x8_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, const ColumnsDone* after) {
  x8_linear_out<Q4_1x8, false>(x, w, y, after);
}
void q8_0x8_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, const ColumnsDone* after) {
  x8_linear_out<Q8_0x8, false>(x, w, y, after);
}
void q4_1x8p_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, const ColumnsDone* after) {
  x8_linear_out<Q4_1x8, true>(x, w, y, after);
}
void q8_0x8p_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, const ColumnsDone* after) {
  x8_linear_out<Q8_0x8, true>(x, w, y, after);
}

void q4_1x8_linear_silu_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& act) {
  x8_linear_silu_out<Q4_1x8, false>(x, w, act);
}
void q8_0x8_linear_silu_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& act) {
  x8_linear_silu_out<Q8_0x8, false>(x, w, act);
}
void q4_1x8p_linear_silu_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& act) {
  x8_linear_silu_out<Q4_1x8, true>(x, w, act);
}
void q8_0x8p_linear_silu_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& act) {
  x8_linear_silu_out<Q8_0x8, true>(x, w, act);
}

PrefetchTarget x8_prefetch_target(const at::Tensor& w) {
  return {w.data_ptr<uint8_t>(), w.size(1), w.size(0), kGroupGrain};
}

}  // namespace tandem_cpu

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("q4_1_to_x8(Tensor w, int k) -> Tensor");
  m.def("q4_1x8_linear(Tensor x, Tensor w) -> Tensor");
  m.def("q4_1x8_linear_silu(Tensor x, Tensor w) -> Tensor");
  m.def("q4_1x8_dequantize(Tensor w, int k) -> Tensor");
  m.def("q4_1x8_rows(Tensor w, Tensor ids, int k) -> Tensor");
  m.def("q8_0_to_x8(Tensor w, int k) -> Tensor");
  m.def("q8_0x8_linear(Tensor x, Tensor w) -> Tensor");
  m.def("q8_0x8_linear_silu(Tensor x, Tensor w) -> Tensor");
  m.def("q8_0x8_dequantize(Tensor w, int k) -> Tensor");
  m.def("q8_0x8_rows(Tensor w, Tensor ids, int k) -> Tensor");
  m.def("q4_1_to_x8p(Tensor w, int k) -> Tensor");
  m.def("q4_1x8p_linear(Tensor x, Tensor w) -> Tensor");
  m.def("q4_1x8p_linear_silu(Tensor x, Tensor w) -> Tensor");
  m.def("q4_1x8p_dequantize(Tensor w, int k) -> Tensor");
  m.def("q4_1x8p_rows(Tensor w, Tensor ids, int k) -> Tensor");
  m.def("q8_0_to_x8p(Tensor w, int k) -> Tensor");
  m.def("q8_0x8p_linear(Tensor x, Tensor w) -> Tensor");
  m.def("q8_0x8p_linear_silu(Tensor x, Tensor w) -> Tensor");
  m.def("q8_0x8p_dequantize(Tensor w, int k) -> Tensor");
  m.def("q8_0x8p_rows(Tensor w, Tensor ids, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("q4_1_to_x8", &to_x8<Q4_1x8, false>);
  m.impl("q4_1x8_linear", &x8_linear<Q4_1x8, false>);
  m.impl("q4_1x8_linear_silu", &x8_linear_silu<Q4_1x8, false>);
  m.impl("q4_1x8_dequantize", &x8_dequantize<Q4_1x8, false>);
  m.impl("q4_1x8_rows", &x8_rows<Q4_1x8, false>);
  m.impl("q8_0_to_x8", &to_x8<Q8_0x8, false>);
  m.impl("q8_0x8_linear", &x8_linear<Q8_0x8, false>);
  m.impl("q8_0x8_linear_silu", &x8_linear_silu<Q8_0x8, false>);
  m.impl("q8_0x8_dequantize", &x8_dequantize<Q8_0x8, false>);
  m.impl("q8_0x8_rows", &x8_rows<Q8_0x8, false>);
  m.impl("q4_1_to_x8p", &to_x8<Q4_1x8, true>);
  m.impl("q4_1x8p_linear", &x8_linear<Q4_1x8, true>);
  m.impl("q4_1x8p_linear_silu", &x8_linear_silu<Q4_1x8, true>);
  m.impl("q4_1x8p_dequantize", &x8_dequantize<Q4_1x8, true>);
  m.impl("q4_1x8p_rows", &x8_rows<Q4_1x8, true>);
  m.impl("q8_0_to_x8p", &to_x8<Q8_0x8, true>);
  m.impl("q8_0x8p_linear", &x8_linear<Q8_0x8, true>);
  m.impl("q8_0x8p_linear_silu", &x8_linear_silu<Q8_0x8, true>);
  m.impl("q8_0x8p_dequantize", &x8_dequantize<Q8_0x8, true>);
  m.impl("q8_0x8p_rows", &x8_rows<Q8_0x8, true>);
}
