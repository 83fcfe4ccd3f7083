// The instruction set the compiled kernels use: the best this CPU has, picked once at load, narrowed by
// set_isa(name) for A/B benchmarks and tests. The quantized linear layers follow it (VNNI's dpbusd, 512-bit
// vectors; bit-identical on every set) and so does decode attention (512-bit vectors from "avx512_vnni").
//
//   isa() -> "avx2" | "avx_vnni" | "avx512_vnni";  set_isa(name) -> the set now in use ("best": the CPU's best)

#include <c10/util/Exception.h>
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

}  // namespace tandem_cpu

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  // No tensor arguments, so no dispatch key: registered with their definitions (CatchAll).
  m.def("isa() -> str", &isa_now);
  m.def("set_isa(str name) -> str", &set_isa);
}
