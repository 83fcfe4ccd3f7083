"""The layer matrices of a batch-8 decode step against the rate this CPU runs their inner instructions at.

    .venv/bin/python tests/bench/bench_matrix_floor.py [--rows 8] [--repeats 15]

At batch 1 a step's Q4_1 matrices are bound by memory (bench_quant_decode.py sets them against the read
bandwidth). From batch ~8 they are bound by instructions. With AVX-512 VNNI each (row of x, block of 32 values,
pair of 8-row weight groups) costs 8 ``vpdpbusd zmm`` (512 int8 products each: the fewest that do the block) and
a convert, a multiply and two FMAs (quant_x8_dot512.h). With AVX2 alone each (row of x, block, group of 8 weight
rows) costs 8 ``vpmaddubsw ymm`` (32 products each) with their int16 adds, a ``vpmaddwd``, a convert, a multiply and
two FMAs (quant_x8_dot.h's k-outer loops): 12 of those run on the two pipes that multiply. Measured side by side
in one run:
1. the rate one core runs that mix at (independent rows, as in the kernel; the weights' loads and unpacking
   left out, so it is a floor, not a model of the kernel), compiled here for the measurement;
2. the floor it sets for the step's layer matrices at M rows (30 layers' qkv, o_proj, gate_up, down of the
   bundled model), on all threads;
3. those matrices timed as bench_quant_matrices.py times them (30 distinct copies, streamed from memory).
Runs where the kernels run AVX-512 VNNI (from min_rows_for_pairs rows) or AVX2; elsewhere it says so and stops.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels import cpu_kernel  # noqa: E402
from kernels.cache_dir import cache_root  # noqa: E402
from tests.bench.bench_quant_matrices import MATRICES, random_blocks, time_matrix  # noqa: E402

BLOCK = 32
GROUP_ROWS = {"avx512_vnni": 16, "avx2": 8}  # weight rows one unit covers: a 512-bit pair of groups, or one group

MIX_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <chrono>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")
// Seconds for `iters` x 8 rows of the batch-8 kernel's work on one block pair: 8 dpbusd, a convert, a multiply
// and two FMAs a row, each row on its own x and with its own scale and sum (broadcast from memory, as the kernel
// takes them). The asm barriers keep every x live and changing and the scales re-read, so no row's work can be
// shared with another's or hoisted out of the loop.
double mix_seconds(int64_t iters) {
  constexpr int kRows = 8;
  __m512i w[8], x[kRows];
  for (int k = 0; k < 8; ++k) w[k] = _mm512_set1_epi8(static_cast<char>(k + 1));
  for (int r = 0; r < kRows; ++r) x[r] = _mm512_set1_epi32(0x01010101 * (r + 1));
  float scale[kRows], sum[kRows];
  for (int r = 0; r < kRows; ++r) scale[r] = 1e-3f * (r + 1), sum[r] = 2e-3f * (r + 1);
  __m512 d = _mm512_set1_ps(1e-3f), m = _mm512_set1_ps(2e-3f), acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    asm volatile("" : "+v"(x[0]), "+v"(x[1]), "+v"(x[2]), "+v"(x[3]), "+v"(x[4]), "+v"(x[5]), "+v"(x[6]),
                 "+v"(x[7]), "+v"(d), "+v"(m) : : "memory");
    for (int r = 0; r < kRows; ++r) {
      __m512i sum32 = _mm512_setzero_si512();
      for (int k = 0; k < 8; ++k) sum32 = _mm512_dpbusd_epi32(sum32, w[k], x[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum32), _mm512_mul_ps(d, _mm512_set1_ps(scale[r])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sum[r]), acc[r]);
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float total = 0.f, lanes[16];
  for (int r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(lanes, acc[r]);
    total += lanes[0];
  }
  TORCH_CHECK(total == total, "unreachable: keeps the sums alive");
  return s;
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
// Seconds for `iters` x 8 rows of AVX2's work on one block of one group: two tiles of 4 rows, each 32 bytes of
// the block (k) met by every row before the next, as in quant_x8_dot.h: per row 8 vpmaddubsw on its own x
// (broadcast from memory, as the kernel takes it), their int16 adds, a vpmaddwd, a convert, a multiply and two
// FMAs. The asm barriers keep x re-read and every sum in a register, so no row's work is shared or hoisted.
double mix_seconds_avx2(int64_t iters) {
  constexpr int kTile = 4;
  __m256i w[4];
  for (int k = 0; k < 4; ++k) w[k] = _mm256_set1_epi8(static_cast<char>(k + 1));
  alignas(32) int8_t x[8][32];
  for (int r = 0; r < 8; ++r)
    for (int j = 0; j < 32; ++j) x[r][j] = static_cast<int8_t>(r + j);
  float scale[8], sum[8];
  for (int r = 0; r < 8; ++r) scale[r] = 1e-3f * (r + 1), sum[r] = 2e-3f * (r + 1);
  __m256 d = _mm256_set1_ps(1e-3f), m = _mm256_set1_ps(2e-3f), acc[8];
  for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    asm volatile("" : "+x"(d), "+x"(m) : : "memory");
    for (int tile = 0; tile < 8; tile += kTile) {
      __m256i sum16[kTile];
      for (int k = 0; k < 4; ++k) {
        for (int r = 0; r < kTile; ++r) {
          int32_t a, c;
          __builtin_memcpy(&a, x[tile + r] + 8 * k, 4);
          __builtin_memcpy(&c, x[tile + r] + 8 * k + 4, 4);
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w[k], _mm256_set1_epi32(a)),
                                             _mm256_maddubs_epi16(w[3 - k], _mm256_set1_epi32(c)));
          sum16[r] = k == 0 ? p : _mm256_add_epi16(sum16[r], p);
          asm("" : "+x"(sum16[r]));
        }
      }
      for (int r = 0; r < kTile; ++r) {
        const __m256 s32 = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16[r], ones));
        acc[tile + r] = _mm256_fmadd_ps(s32, _mm256_mul_ps(d, _mm256_set1_ps(scale[tile + r])), acc[tile + r]);
        acc[tile + r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sum[tile + r]), acc[tile + r]);
      }
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float total = 0.f, lanes[8];
  for (int r = 0; r < 8; ++r) {
    _mm256_storeu_ps(lanes, acc[r]);
    total += lanes[0];
  }
  TORCH_CHECK(total == total, "unreachable: keeps the sums alive");
  return s;
}
#pragma GCC pop_options
"""


def mix_rate(isa: str) -> float:
    """(row, block, weight rows of GROUP_ROWS[isa]) units a second on one core, the best of 7 runs."""
    from torch.utils import cpp_extension

    build = cache_root() / "kernels" / "bench_matrix_floor"
    build.mkdir(parents=True, exist_ok=True)
    ext = cpp_extension.load_inline(name="bench_matrix_floor", cpp_sources=[MIX_SOURCE],
                                    functions=["mix_seconds", "mix_seconds_avx2"], extra_cflags=["-O3"],
                                    build_directory=str(build), verbose=False)
    mix = ext.mix_seconds if isa == "avx512_vnni" else ext.mix_seconds_avx2
    iters = 200_000
    mix(iters)  # warm-up: the clock ramps
    return max(8 * iters / mix(iters) for _ in range(7))


def layer_units(rows: int, group_rows: int) -> int:
    """(row of x, block, group_rows weight rows) units of the step's layer matrices (the Q4_1 ones)."""
    return sum(rows * (n // group_rows) * (k // BLOCK) * copies
               for fmt, n, k, copies in MATRICES.values() if fmt == "q4_1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8, help="rows of x (the batch)")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    if not cpu_kernel.available():
        sys.exit(f"the CPU kernels are unavailable: {cpu_kernel.unavailable_reason()}")
    isa = torch.ops.tandem_cpu.isa()
    if isa == "amx":  # tiles only from amx_min_rows() rows; the floor here models the 512-bit loops
        isa = torch.ops.tandem_cpu.set_isa("avx512_vnni")
    if isa not in GROUP_ROWS:
        sys.exit(f"this CPU's kernels run {isa}; the floors here are for AVX-512 VNNI and AVX2")
    if isa == "avx512_vnni" and args.rows < torch.ops.tandem_cpu.min_rows_for_pairs():
        sys.exit(f"under {torch.ops.tandem_cpu.min_rows_for_pairs()} rows this CPU multiplies on 256-bit loops, "
                 "which the 512-bit mix measured here does not model")
    threads = torch.get_num_threads()
    rate = mix_rate(isa)
    units = layer_units(args.rows, GROUP_ROWS[isa])
    floor = units / (rate * threads)
    gen = torch.Generator().manual_seed(0)
    layer_matrices = {name: spec for name, spec in MATRICES.items() if spec[0] == "q4_1"}
    weights = {name: [random_blocks(fmt, n, k, gen) for _ in range(copies)]
               for name, (fmt, n, k, copies) in layer_matrices.items()}
    measured = []
    for _ in range(3):  # rounds: this machine's pace drifts
        x = torch.randn(args.rows, max(k for _, _, k, _ in layer_matrices.values()), generator=gen)
        measured.append(sum(time_matrix(ws, x[:, : ws[0].in_features].contiguous(), args.repeats)
                            for ws in weights.values()))
    took = statistics.median(measured)
    if isa == "avx512_vnni":
        print(f"one core: {rate / 1e6:.1f} M (row, block pair) units a second, each 8 vpdpbusd zmm + 4 float "
              f"instructions ({8 * rate / 1e9:.2f} G vpdpbusd zmm a second)")
    else:
        print(f"one core: {rate / 1e6:.1f} M (row, block, group) units a second, each 8 vpmaddubsw ymm + 7 int16 "
              f"adds + vpmaddwd + 4 float instructions ({8 * rate / 1e9:.2f} G vpmaddubsw ymm a second)")
    print(f"layer matrices at M={args.rows}: {units / 1e6:.2f} M units; floor on {threads} threads "
          f"{floor * 1e3:.2f} ms; measured {took * 1e3:.2f} ms (rounds "
          f"{', '.join(f'{t * 1e3:.2f}' for t in measured)}); measured / floor {took / floor:.2f}")


if __name__ == "__main__":
    main()
