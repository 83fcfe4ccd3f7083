// How thread_team.cpp's loops share a range among the team's threads, and what the team learns of it: a header
// of its own, included by thread_team.cpp alone.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>

namespace tandem_cpu {
namespace {

// The leader's share of a prefetched loop against a worker's (its rows come from memory, theirs from cache), by
// kind of loop (PrefetchTarget::key), learned as steps run: after each such loop the weight rises a step if the
// leader waited for the workers and falls one if they had all finished first. A fixed 0.8 (0.43 of a matrix at 2
// threads) made batch 1 5-7% faster than halves but left the leader waiting 0.2-0.3 ms a batch-8 step.
constexpr double kStartWeight = 0.8, kWeightStep = 0.02, kMinWeight = 0.2, kMaxWeight = 1.5;
constexpr int64_t kWeightKeys = 64;
constexpr uint64_t kWaitCycles = 2000;  // a wait shorter than this (~0.5-1 us) counts as balanced

struct LeaderWeights {
  std::atomic<double> w[kWeightKeys];
  LeaderWeights() { reset(); }
  void reset() {
    for (auto& x : w) x.store(kStartWeight, std::memory_order_relaxed);
  }
  std::atomic<double>& of(int64_t key) { return w[static_cast<uint64_t>(key) % kWeightKeys]; }
};
LeaderWeights g_weights;

// How a team's loop shares [0, range) among its threads: the leader [0, first), then worker t (1, 2, ...)
// [first + (t - 1) * chunk, + chunk), all clipped to the range.
struct Split {
  int64_t tasks = 0, first = 0, chunk = 0;

  std::pair<int64_t, int64_t> of(int64_t tid, int64_t range) const {
    if (tid >= tasks) return {range, range};
    const int64_t b = tid == 0 ? 0 : std::min(range, first + (tid - 1) * chunk);
    return {b, std::min(range, tid == 0 ? first : b + chunk)};
  }
};

// at::parallel_for's split (at most one chunk a thread, none under the grain: a kernel gives the same bits in a
// team and out of one); given a leader's weight (> 0), the leader's share that against each worker's, in grains.
Split split_range(int64_t range, int64_t grain, int64_t threads, double leader_weight) {
  grain = std::max<int64_t>(grain, 1);
  Split s;
  s.tasks = std::max<int64_t>(1, std::min<int64_t>(threads, (range + grain - 1) / grain));
  if (leader_weight <= 0 || s.tasks < 2) {
    s.chunk = s.first = (range + s.tasks - 1) / s.tasks;
    return s;
  }
  const double workers = static_cast<double>(s.tasks - 1);
  const auto leader = static_cast<int64_t>(static_cast<double>(range) * leader_weight / (leader_weight + workers));
  s.first = std::min(range - (s.tasks - 1), std::max(grain, leader / grain * grain));  // each worker keeps some
  const int64_t per_worker = (range - s.first + s.tasks - 2) / (s.tasks - 1);
  s.chunk = (per_worker + grain - 1) / grain * grain;
  return s;
}

}  // namespace
}  // namespace tandem_cpu
