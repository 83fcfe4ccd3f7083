// thread_team.h's team: an OpenMP region held open for the leader's body, its workers spinning on a shared
// epoch for the next range.

#include "thread_team.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <utility>
#include <vector>

namespace tandem_cpu {
namespace {

bool g_enabled = true;  // set_step_team: off runs each parallel_for on its own OpenMP team (A/B benchmarks)

struct Team {
  int64_t size = 1;
  // The leader publishes a task by writing it, then bumping epoch; a worker that sees a new epoch reads it.
  alignas(64) std::atomic<uint64_t> epoch{0};
  c10::function_ref<void(int64_t, int64_t)> fn;
  int64_t begin = 0, end = 0, chunk = 0, tasks = 0;
  bool exit = false;
  alignas(64) std::atomic<int64_t> done{0};  // workers finished with the current epoch's share
  std::mutex error_mutex;
  std::exception_ptr error;

  void run_share(int64_t tid) noexcept {
    if (tid >= tasks) return;
    const int64_t b = begin + tid * chunk;
    if (b >= end) return;
    try {
      fn(b, std::min(end, b + chunk));
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  }

  // Publishes the current task (or exit) to the workers.
  void publish() {
    done.store(0, std::memory_order_relaxed);
    epoch.fetch_add(1, std::memory_order_release);
  }

  void wait_workers() const {
    while (done.load(std::memory_order_acquire) != size - 1) _mm_pause();
  }

  void work(int64_t tid) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t now;
      while ((now = epoch.load(std::memory_order_acquire)) == seen) _mm_pause();
      seen = now;
      if (exit) return;
      run_share(tid);
      done.fetch_add(1, std::memory_order_acq_rel);
    }
  }
};

thread_local Team* t_team = nullptr;  // the team this thread leads

}  // namespace

void with_team(c10::function_ref<void()> body) {
  const int64_t threads = at::get_num_threads();
  if (!g_enabled || t_team != nullptr || threads <= 1 || at::in_parallel_region()) {
    body();
    return;
  }
  Team team;  // its size is set by the leader: the runtime may give fewer threads than asked
  std::exception_ptr leader_error;
#pragma omp parallel num_threads(threads)
  {
    const int64_t tid = omp_get_thread_num();
    if (tid == 0) {
      team.size = omp_get_num_threads();
      t_team = team.size > 1 ? &team : nullptr;
      try {
        body();
      } catch (...) {
        leader_error = std::current_exception();
      }
      t_team = nullptr;
      team.exit = true;
      team.publish();
    } else {
      team.work(tid);
    }
  }
  if (leader_error) std::rethrow_exception(leader_error);
}

int64_t num_threads() { return t_team != nullptr ? t_team->size : at::get_num_threads(); }

namespace detail {

bool team_parallel_for(int64_t begin, int64_t end, int64_t grain, c10::function_ref<void(int64_t, int64_t)> f) {
  Team* team = t_team;
  if (team == nullptr) return false;
  // at::parallel_for's chunks: at most one a thread, none smaller than the grain.
  const int64_t range = end - begin;
  team->tasks = grain > 0 ? std::min<int64_t>(team->size, (range + grain - 1) / grain) : team->size;
  team->chunk = (range + team->tasks - 1) / team->tasks;
  team->fn = f;
  team->begin = begin;
  team->end = end;
  team->publish();
  team->run_share(0);
  team->wait_workers();
  if (team->error) {
    std::exception_ptr error = std::exchange(team->error, nullptr);
    std::rethrow_exception(error);
  }
  return true;
}

}  // namespace detail
}  // namespace tandem_cpu

namespace {

bool set_step_team(bool on) { return std::exchange(tandem_cpu::g_enabled, on); }

// For the tests: the chunks a team's parallel_for gives [0, n) with this grain, as [begin, end) pairs in order;
// a chunk starting at throw_at throws (on whichever thread runs it).
std::vector<int64_t> team_chunks(int64_t n, int64_t grain, int64_t throw_at) {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  std::mutex mutex;
  tandem_cpu::with_team([&] {
    tandem_cpu::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      TORCH_CHECK(begin != throw_at, "chunk at ", begin, " threw");
      const std::lock_guard<std::mutex> lock(mutex);
      chunks.emplace_back(begin, end);
    });
  });
  std::sort(chunks.begin(), chunks.end());
  std::vector<int64_t> bounds;
  for (const auto& [begin, end] : chunks) bounds.insert(bounds.end(), {begin, end});
  return bounds;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  // No tensor arguments, so no dispatch key: registered with their definitions (CatchAll).
  m.def("set_step_team(bool on) -> bool", &set_step_team);
  m.def("team_chunks(int n, int grain, int throw_at) -> int[]", &team_chunks);
}
