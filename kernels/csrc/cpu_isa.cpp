// The instruction set the compiled kernels use: the best this CPU has, picked once at load, narrowed by
// set_isa(name) for A/B benchmarks and tests. The quantized linear layers follow it (VNNI's dpbusd, 512-bit
// vectors, AMX tiles; bit-identical on every set) and so does decode attention (512-bit vectors from "avx512_vnni").
// "amx" is "avx512_vnni" with the quantized matrices on AMX-INT8 tiles from amx_min_rows() rows of x.
//
//   isa() -> "avx2" | "avx_vnni" | "avx512_vnni" | "amx";  set_isa(name) -> the set now in use ("best": the CPU's best)
//   min_rows_for_pairs() -> from how many rows of x "avx512_vnni" multiplies on 512-bit vectors (1, or 5 on Zen 4)
//   amx_min_rows() -> from how many rows of x the matrices run on tiles (0: not now, the set in use is not "amx");
//     set_amx_min_rows(n) -> the last value (tests, A/B benches)

#include <c10/util/Exception.h>
#include <cpuid.h>
#include <torch/library.h>

#include <string>
#include <utility>

#include <sys/syscall.h>
#include <unistd.h>

#include "tandem_cpu.h"

namespace {

using tandem_cpu::Isa;

Isa best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw"))
    return Isa::kAvx512Vnni;
  if (__builtin_cpu_supports("avxvnni")) return Isa::kAvxVnni;
  return Isa::kAvx2;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni: return "avx512_vnni";
    case Isa::kAvxVnni: return "avx_vnni";
    default: return "avx2";
  }
}

// AMD's Zen 4 (family 0x19 with AVX-512) runs a 512-bit instruction as two 256-bit halves, so there the
// 512-bit pairs of quant_x8_dot512.h save instructions, not work. In the bundled model's decode step on a
// Zen 4 EPYC (2 threads, 256-bit VNNI loops / 512-bit pairs) they lost up to 4 rows of x: batch 1 4.0 / 5.2
// ms, 2: 4.8 / 5.8, 3: 4.8 / 6.0, 4: 5.5 / 6.4, and won from 6: 7.8 / 7.1, 8: 12.0 / 10.6. On an Emerald
// Rapids Xeon, which runs them at full width, the pairs were faster at every batch (the matrices at M=1
// 1.11x, M=4 1.21x the 256-bit VNNI loops).
int64_t detect_min_rows_for_pairs() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__builtin_cpu_is("amd") || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 1;
  const unsigned base = (eax >> 8) & 0xF, family = base == 0xF ? base + ((eax >> 20) & 0xFF) : base;
  return family == 0x19 ? 5 : 1;
}

const int64_t g_min_rows_for_pairs = detect_min_rows_for_pairs();

// AMX-TILE and AMX-INT8 (CPUID leaf 7: EDX bits 24 and 25), and the OS's leave to use the tiles' 8 KB of state:
// Linux grants it per process on request (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); a tile instruction
// without it faults. A hypervisor may list AMX and refuse the state, so the request decides.
bool amx_granted() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!((edx >> 24) & 1) || !((edx >> 25) & 1)) return false;
#ifdef SYS_arch_prctl
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
#else
  return false;
#endif
}

// Tiles from 32 rows of x: prefill chunks and big decode batches. Each matrix alone (tests/bench/
// bench_quant_matrices.py, Emerald Rapids VM, 2 threads) is faster on tiles from 9 rows (a step's matrices at 16 rows
// 7.3 against 9.2 ms, 32: 12.9 / 17.4), but inside a decode step it was not below ~24: the core slows down while it
// runs tile instructions (AMX's frequency licence), and the step's attention, norms and 512-bit loops between the
// matrices ran ~10% slower with it (the stack's phase clock as bench_step_phases reads it, batch 16 on one thread:
// attention 213 against 197 us a layer). Engine steps, the two sets alternating step by step
// (tests/bench/bench_amx_decode.py): batch 16 1.00, 24 0.97, 32 0.93, 48 0.88; a 400-token prefill 0.82-0.87.
constexpr int64_t kAmxMinRows = 32;
const bool g_amx = best_isa() == Isa::kAvx512Vnni && amx_granted();

Isa g_isa = best_isa();
bool g_tiles = g_amx;  // "amx": g_isa is kAvx512Vnni
int64_t g_amx_min_rows = kAmxMinRows;

// For tests and A/B benches: tiles from `rows` rows of x while the set is "amx" (1: every matrix). Returns the
// last value.
int64_t set_amx_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1, "amx_min_rows must be >= 1, got ", rows);
  return std::exchange(g_amx_min_rows, rows);
}

// Sets the instruction set by name ("best" for this CPU's best); returns the one now in use. Refuses one
// the CPU lacks.
std::string set_isa(const std::string& name) {
  const Isa best = best_isa();
  Isa want = best;
  bool tiles = g_amx;
  if (name == "avx2") want = Isa::kAvx2, tiles = false;
  else if (name == "avx_vnni") want = Isa::kAvxVnni, tiles = false;
  else if (name == "avx512_vnni") want = Isa::kAvx512Vnni, tiles = false;
  else if (name == "amx") want = Isa::kAvx512Vnni, tiles = true;
  else TORCH_CHECK(name == "best", "unknown instruction set ", name, "; known: best, avx2, avx_vnni, avx512_vnni, amx");
  const bool has = want == Isa::kAvx2 || (want == Isa::kAvxVnni && __builtin_cpu_supports("avxvnni")) ||
                   (want == Isa::kAvx512Vnni && best == Isa::kAvx512Vnni && (!tiles || g_amx));
  TORCH_CHECK(has, "this CPU (or its OS, for amx's tiles) lacks ", name, " (its best is ",
              g_amx ? "amx" : isa_name(best), ")");
  g_isa = want;
  g_tiles = tiles;
  return g_tiles ? "amx" : isa_name(g_isa);
}

std::string isa_now() { return g_tiles ? "amx" : isa_name(g_isa); }

}  // namespace

namespace tandem_cpu {

Isa isa() { return g_isa; }

int64_t min_rows_for_pairs() { return g_min_rows_for_pairs; }

int64_t amx_min_rows() { return g_tiles ? g_amx_min_rows : 0; }

}  // namespace tandem_cpu

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  // No tensor arguments, so no dispatch key: registered with their definitions (CatchAll).
  m.def("isa() -> str", &isa_now);
  m.def("set_isa(str name) -> str", &set_isa);
  m.def("min_rows_for_pairs() -> int", &tandem_cpu::min_rows_for_pairs);
  m.def("amx_min_rows() -> int", &tandem_cpu::amx_min_rows);
  m.def("set_amx_min_rows(int rows) -> int", &set_amx_min_rows);
}
