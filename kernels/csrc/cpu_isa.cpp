// The instruction set the compiled kernels use: the best this CPU has, picked once at load, narrowed by
// set_isa(name) for A/B benchmarks and tests. The quantized linear layers follow it (VNNI's dpbusd, 512-bit
// vectors; bit-identical on every set) and so does decode attention (512-bit vectors from "avx512_vnni").
//
//   isa() -> "avx2" | "avx_vnni" | "avx512_vnni";  set_isa(name) -> the set now in use ("best": the CPU's best)
//   min_rows_for_pairs() -> from how many rows of x "avx512_vnni" multiplies on 512-bit vectors (1, or 5 on Zen 4)

#include <c10/util/Exception.h>
#include <cpuid.h>
#include <torch/library.h>

#include <string>

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

Isa g_isa = best_isa();

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

// Sets the instruction set by name ("best" for this CPU's best); returns the one now in use. Refuses one
// the CPU lacks.
std::string set_isa(const std::string& name) {
  const Isa best = best_isa();
  Isa want = best;
  if (name == "avx2") want = Isa::kAvx2;
  else if (name == "avx_vnni") want = Isa::kAvxVnni;
  else if (name == "avx512_vnni") want = Isa::kAvx512Vnni;
  else TORCH_CHECK(name == "best", "unknown instruction set ", name, "; known: best, avx2, avx_vnni, avx512_vnni");
  const bool has = want == Isa::kAvx2 || (want == Isa::kAvxVnni && __builtin_cpu_supports("avxvnni")) ||
                   (want == Isa::kAvx512Vnni && best == Isa::kAvx512Vnni);
  TORCH_CHECK(has, "this CPU lacks ", name, " (its best is ", isa_name(best), ")");
  g_isa = want;
  return isa_name(g_isa);
}

std::string isa_now() { return isa_name(g_isa); }

}  // namespace

namespace tandem_cpu {

Isa isa() { return g_isa; }

int64_t min_rows_for_pairs() { return g_min_rows_for_pairs; }

}  // namespace tandem_cpu

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  // No tensor arguments, so no dispatch key: registered with their definitions (CatchAll).
  m.def("isa() -> str", &isa_now);
  m.def("set_isa(str name) -> str", &set_isa);
  m.def("min_rows_for_pairs() -> int", &tandem_cpu::min_rows_for_pairs);
}
