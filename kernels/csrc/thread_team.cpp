// thread_team.h's team: an OpenMP region held open for the leader's body, its workers spinning on a shared
// epoch for the next range and, while they wait, pulling their shares of the prefetch plan's next matrix into cache.

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
bool g_prefetch = true;  // set_team_prefetch: off ignores prefetch plans (A/B benchmarks)

// A loop's leader takes kLeaderWeight of a worker's share where the workers prefetched theirs: its rows come from
// memory, theirs from cache. Measured at 2 threads (bench_step_team.py's stack, the leader's share 0.35-0.5 of a
// matrix in turn): 0.43-0.47 were 5-7% faster than halves at batch 1, within 1-2% either way at batch 8; 0.40
// and below slowed batch 8 by 5% and more.
constexpr double kLeaderWeight = 0.8;

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
// team and out of one); for a prefetched loop, the leader's share smaller (kLeaderWeight), in whole grains.
Split split_range(int64_t range, int64_t grain, int64_t threads, bool prefetched) {
  grain = std::max<int64_t>(grain, 1);
  Split s;
  s.tasks = std::max<int64_t>(1, std::min<int64_t>(threads, (range + grain - 1) / grain));
  if (!prefetched || s.tasks < 2) {
    s.chunk = s.first = (range + s.tasks - 1) / s.tasks;
    return s;
  }
  const double workers = static_cast<double>(s.tasks - 1);
  const auto leader = static_cast<int64_t>(static_cast<double>(range) * kLeaderWeight / (kLeaderWeight + workers));
  s.first = std::max(grain, leader / grain * grain);
  const int64_t per_worker = (range - s.first + s.tasks - 2) / (s.tasks - 1);
  s.chunk = (per_worker + grain - 1) / grain * grain;
  return s;
}

// Thread tid's rows of a target, as its prefetched loop splits them, in bytes from its base.
std::pair<int64_t, int64_t> share_bytes(const PrefetchTarget& t, int64_t tid, int64_t threads) {
  const auto [first, last] = split_range(t.units, t.grain, threads, true).of(tid, t.units);
  return {first * t.unit_bytes, last * t.unit_bytes};
}

struct Team {
  int64_t size = 1;
  // The leader publishes a task by writing it, then bumping epoch; a worker that sees a new epoch reads it.
  alignas(64) std::atomic<uint64_t> epoch{0};
  c10::function_ref<void(int64_t, int64_t)> fn;
  int64_t begin = 0, end = 0;
  Split split;
  bool exit = false;
  alignas(64) std::atomic<int64_t> done{0};  // workers finished with the current epoch's share
  // The prefetch plan: set once by the leader (release), read by the workers as they spin.
  alignas(64) std::atomic<const PrefetchTarget*> plan{nullptr};
  int64_t plan_count = 0;
  std::atomic<int64_t> reached{-1};
  std::mutex error_mutex;
  std::exception_ptr error;

  void run_share(int64_t tid) noexcept {
    const auto [b, e] = split.of(tid, end - begin);
    if (b >= e) return;
    try {
      fn(begin + b, begin + e);
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

  // A worker's place in the plan: the target it prefetches, and what is left of its share there.
  struct Lookahead {
    int64_t index = -1;
    const char *next = nullptr, *stop = nullptr;

    void move_to(const PrefetchTarget* targets, int64_t count, int64_t i, int64_t tid, int64_t threads) {
      index = i;
      next = stop = nullptr;
      if (i >= count) return;
      const auto [first, last] = share_bytes(targets[i], tid, threads);
      next = static_cast<const char*>(targets[i].base) + first;
      stop = static_cast<const char*>(targets[i].base) + last;
    }
  };

  // One turn of a waiting worker: 8 lines of its share of the target after the leader's (a task never waits on
  // more than that), or a pause. Only the next target: looking two ahead was slower at batch 1 and 8 (the workers'
  // extra reads compete with the leader's, which are the step's critical path).
  void prefetch_turn(int64_t tid, Lookahead& at) {
    const PrefetchTarget* targets = plan.load(std::memory_order_acquire);
    if (targets != nullptr) {
      const int64_t next_target = reached.load(std::memory_order_relaxed) + 1;
      if (at.index != next_target) at.move_to(targets, plan_count, next_target, tid, size);
      if (at.next < at.stop) {
        for (int i = 0; i < 8 && at.next < at.stop; ++i, at.next += 64) _mm_prefetch(at.next, _MM_HINT_T0);
        return;
      }
    }
    _mm_pause();
  }

  void work(int64_t tid) {
    uint64_t seen = 0;
    Lookahead at;
    for (;;) {
      uint64_t now;
      while ((now = epoch.load(std::memory_order_acquire)) == seen) prefetch_turn(tid, at);
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

void prefetch_plan(const PrefetchTarget* targets, int64_t count) {
  Team* team = t_team;
  if (team == nullptr || !g_prefetch || count <= 0) return;
  TORCH_CHECK(team->plan.load(std::memory_order_relaxed) == nullptr, "a team takes one prefetch plan");
  team->plan_count = count;
  team->plan.store(targets, std::memory_order_release);  // publishes plan_count with it
}

void prefetch_reached(int64_t index) {
  if (Team* team = t_team) team->reached.store(index, std::memory_order_relaxed);
}

int64_t num_threads() { return t_team != nullptr ? t_team->size : at::get_num_threads(); }

namespace detail {

bool team_parallel_for(int64_t begin, int64_t end, int64_t grain, c10::function_ref<void(int64_t, int64_t)> f,
                       bool prefetched) {
  Team* team = t_team;
  if (team == nullptr) return false;
  team->split = split_range(end - begin, grain, team->size, prefetched && g_prefetch);
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
bool set_team_prefetch(bool on) { return std::exchange(tandem_cpu::g_prefetch, on); }

// For the tests: the [first, last) bytes each of `threads` threads prefetches of a target of n one-byte units,
// to set against team_chunks(n, grain, -1, prefetched=True).
std::vector<int64_t> team_prefetch_shares(int64_t n, int64_t grain, int64_t threads) {
  std::vector<int64_t> bounds;
  for (int64_t tid = 0; tid < threads; ++tid) {
    const auto [first, last] = tandem_cpu::share_bytes({nullptr, 1, n, grain}, tid, threads);
    if (first < last) bounds.insert(bounds.end(), {first, last});
  }
  return bounds;
}

// For the tests: the chunks a team's parallel_for (or prefetched_parallel_for) gives [0, n) with this grain, as
// [begin, end) pairs in order; a chunk starting at throw_at throws (on whichever thread runs it).
std::vector<int64_t> team_chunks(int64_t n, int64_t grain, int64_t throw_at, bool prefetched) {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  std::mutex mutex;
  const auto body = [&](int64_t begin, int64_t end) {
    TORCH_CHECK(begin != throw_at, "chunk at ", begin, " threw");
    const std::lock_guard<std::mutex> lock(mutex);
    chunks.emplace_back(begin, end);
  };
  tandem_cpu::with_team([&] {
    if (prefetched) tandem_cpu::prefetched_parallel_for(0, n, grain, body);
    else tandem_cpu::parallel_for(0, n, grain, body);
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
  m.def("set_team_prefetch(bool on) -> bool", &set_team_prefetch);
  m.def("team_chunks(int n, int grain, int throw_at, bool prefetched=False) -> int[]", &team_chunks);
  m.def("team_prefetch_shares(int n, int grain, int threads) -> int[]", &team_prefetch_shares);
}
