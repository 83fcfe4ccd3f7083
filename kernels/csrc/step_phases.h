// Where a compiled decode step's time goes, phase by phase: the leader's wall time in each part of a layer, summed
// over layers and calls while timing is on (set_stack_phase_timing; off by default, when a mark is one branch).
// tests/bench/bench_step_phases.py prints it a layer; what the numbers showed is in its docstring.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>

namespace tandem_cpu {

// In a layer's order. A matrix's phase holds its x's quantization, the hand-off to the team and the wait for it;
// qkv's also its heads' bias, RoPE and KV store.
enum class StepPhase : int { kAttnNorm, kQkv, kAttention, kOProj, kMlpNorm, kGateUp, kSilu, kDown, kCount };
inline constexpr std::array<const char*, static_cast<int>(StepPhase::kCount)> kStepPhaseNames = {
    "attn_norm", "qkv", "attention", "o_proj", "mlp_norm", "gate_up", "silu", "down"};

struct StepPhaseSeconds {
  bool on = false;
  std::array<double, static_cast<int>(StepPhase::kCount)> seconds{};
};

inline StepPhaseSeconds& step_phase_seconds() {
  static StepPhaseSeconds s;  // one stack steps at a time (the engine's thread): no lock
  return s;
}

// One step's clock: mark(p) books the time since the last mark to phase p; `booked` false: books nothing (a thread
// of a split batch other than the first).
class StepPhaseClock {
 public:
  explicit StepPhaseClock(bool booked = true) : on_(booked && step_phase_seconds().on) {
    if (on_) last_ = std::chrono::steady_clock::now();
  }
  void mark(StepPhase phase) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    step_phase_seconds().seconds[static_cast<int>(phase)] += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  bool on_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace tandem_cpu
