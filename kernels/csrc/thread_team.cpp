// thread_team.h's team: an OpenMP region held open for the leader's body, its workers spinning on a shared
// epoch for the next range and, while they wait, pulling their shares of the prefetch plan's next matrix into cache.

#include "thread_team.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <omp.h>
#include <torch/library.h>
#include <x86intrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "team_split.h"

namespace tandem_cpu {
namespace {

bool g_enabled = true;  // set_step_team: off runs each parallel_for on its own OpenMP team (A/B benchmarks)
bool g_prefetch = true;  // set_team_prefetch: off ignores prefetch plans (A/B benchmarks)

// Thread tid's rows of a target, as its loop splits them now, in bytes from its base.
std::pair<int64_t, int64_t> share_bytes(const PrefetchTarget& t, int64_t tid, int64_t threads) {
  const double weight = g_weights.of(t.key).load(std::memory_order_relaxed);
  const auto [first, last] = split_range(t.units, t.grain, threads, weight).of(tid, t.units);
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
  // Worker t's line: the last epoch whose share it has finished. A line a worker, written by it alone, so a hand-off
  // costs two trips between the cores (the epoch there, this back), not the four a shared counter took (the
  // leader's reset and its locked increment waited on the line, then each worker's locked increment).
  struct alignas(64) Finished {
    std::atomic<uint64_t> epoch{0};
  };
  std::unique_ptr<Finished[]> finished;
  // The prefetch plan: set once by the leader (release), read by the workers as they spin.
  alignas(64) std::atomic<const PrefetchTarget*> plan{nullptr};
  int64_t plan_count = 0;
  std::atomic<int64_t> reached{-1};
  std::atomic<const KvPrefetch*> kv_job{nullptr};  // prefetch_kv's
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

  // Publishes the current task (or exit) to the workers: a plain store, the leader being epoch's only writer.
  void publish() { epoch.store(epoch.load(std::memory_order_relaxed) + 1, std::memory_order_release); }

  bool all_finished(uint64_t now) const {
    for (int64_t t = 1; t < size; ++t)
      if (finished[t].epoch.load(std::memory_order_acquire) != now) return false;
    return true;
  }

  // Cycles spent waiting; 0 where the workers had all finished first.
  uint64_t wait_workers() const {
    const uint64_t now = epoch.load(std::memory_order_relaxed);
    if (all_finished(now)) return 0;
    const uint64_t start = __rdtsc();
    while (!all_finished(now)) _mm_pause();
    return std::max<uint64_t>(1, __rdtsc() - start);
  }

  // The plan's target the leader is on, if a prefetched loop now runs over it.
  const PrefetchTarget* current_target() const {
    const PrefetchTarget* targets = plan.load(std::memory_order_relaxed);
    const int64_t i = reached.load(std::memory_order_relaxed);
    return targets != nullptr && i >= 0 && i < plan_count ? targets + i : nullptr;
  }

  // A worker's place in the plan: the target it prefetches, and what is left of its share there.
  struct Lookahead {
    int64_t index = -1;
    const char *next = nullptr, *stop = nullptr;
    KvCursor kv;

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
  // more than that), else 8 of its KV job's, or a pause. Only the next target: looking two ahead was slower at
  // batch 1 and 8 (the workers' extra reads compete with the leader's, which are the step's critical path).
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
    const KvPrefetch* job = kv_job.load(std::memory_order_acquire);
    if (job != at.kv.job) at.kv = KvCursor{job, tid - 1, 0};
    const auto line = [job](bool v, int64_t offset) {
      _mm_prefetch((v ? job->v_base : job->k_base) + offset, _MM_HINT_T0);
    };
    if (next_kv_lines(at.kv, size - 1, 8, line)) return;
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
      finished[tid].epoch.store(now, std::memory_order_release);
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
  team.finished = std::make_unique<Team::Finished[]>(threads);
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

void prefetch_kv(const KvPrefetch* job) {
  if (Team* team = t_team; team != nullptr && g_prefetch) team->kv_job.store(job, std::memory_order_release);
}

int64_t num_threads() {
  if (t_team != nullptr) return t_team->size;
  return at::in_parallel_region() ? 1 : at::get_num_threads();  // a parallel region's loops run on its thread alone
}

namespace detail {

bool team_parallel_for(int64_t begin, int64_t end, int64_t grain, c10::function_ref<void(int64_t, int64_t)> f,
                       bool prefetched) {
  Team* team = t_team;
  if (team == nullptr) return false;
  const PrefetchTarget* target = prefetched && g_prefetch ? team->current_target() : nullptr;
  std::atomic<double>* weight = target != nullptr ? &g_weights.of(target->key) : nullptr;
  team->split = split_range(end - begin, grain, team->size, weight ? weight->load(std::memory_order_relaxed) : 0.0);
  team->fn = f;
  team->begin = begin;
  team->end = end;
  team->publish();
  team->run_share(0);
  const uint64_t waited = team->wait_workers();
  if (weight != nullptr && team->split.tasks > 1) {  // the next loop of this kind moves work toward the faster side
    const double w = weight->load(std::memory_order_relaxed);
    if (waited == 0) weight->store(std::max(kMinWeight, w - kWeightStep), std::memory_order_relaxed);
    else if (waited > kWaitCycles) weight->store(std::min(kMaxWeight, w + kWeightStep), std::memory_order_relaxed);
  }
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

// For the tests: each of `threads` threads' non-empty [first, last) from share(tid), in order, as bounds.
template <typename Share>
std::vector<int64_t> bounds_of(int64_t threads, const Share& share) {
  std::vector<int64_t> bounds;
  for (int64_t tid = 0; tid < threads; ++tid) {
    const auto [first, last] = share(tid);
    if (first < last) bounds.insert(bounds.end(), {first, last});
  }
  return bounds;
}

// For the tests: the [first, last) bytes each of `threads` threads would prefetch now of a target of n one-byte
// units of this key, to set against team_chunks(n, grain, -1, key).
std::vector<int64_t> team_prefetch_shares(int64_t n, int64_t grain, int64_t threads, int64_t key) {
  const tandem_cpu::PrefetchTarget target{nullptr, 1, n, grain, key};
  return bounds_of(threads, [&](int64_t tid) { return tandem_cpu::share_bytes(target, tid, threads); });
}

// For the tests: the chunks a team's parallel_for gives [0, n) with this grain (or, key >= 0, a prefetched loop over
// a one-target plan of that key), as [begin, end) pairs in order; a chunk starting at throw_at throws (on whichever
// thread runs it). `unit_ns`: each unit of a chunk busy-waits that long, `slow_tid`'s thrice as long; `loops`: runs
// it that many times (returning the last run's chunks), so a test can watch the leader's weight move.
std::vector<int64_t> team_chunks(int64_t n, int64_t grain, int64_t throw_at, int64_t key, int64_t loops,
                                 int64_t unit_ns, int64_t slow_tid) {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  std::mutex mutex;
  const auto body = [&](int64_t begin, int64_t end) {
    TORCH_CHECK(begin != throw_at, "chunk at ", begin, " threw");
    const int64_t ns = (end - begin) * unit_ns * (omp_get_thread_num() == slow_tid ? 3 : 1);
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
    while (std::chrono::steady_clock::now() < until) _mm_pause();
    const std::lock_guard<std::mutex> lock(mutex);
    chunks.emplace_back(begin, end);
  };
  const tandem_cpu::PrefetchTarget target{nullptr, 1, n, grain, key};
  tandem_cpu::with_team([&] {
    if (key >= 0) {
      tandem_cpu::prefetch_plan(&target, 1);
      tandem_cpu::prefetch_reached(0);
    }
    for (int64_t i = 0; i < loops; ++i) {
      chunks.clear();
      if (key >= 0) tandem_cpu::prefetched_parallel_for(0, n, grain, body);
      else tandem_cpu::parallel_for(0, n, grain, body);
    }
  });
  std::sort(chunks.begin(), chunks.end());
  std::vector<int64_t> bounds;
  for (const auto& [begin, end] : chunks) bounds.insert(bounds.end(), {begin, end});
  return bounds;
}

// For the tests: the split of [0, n) with this grain and leader's weight (0: at::parallel_for's), as bounds.
std::vector<int64_t> team_split(int64_t n, int64_t grain, int64_t threads, double weight) {
  const tandem_cpu::Split split = tandem_cpu::split_range(n, grain, threads, weight);
  return bounds_of(threads, [&](int64_t tid) { return split.of(tid, n); });
}

// For the tests: the lines each worker of a `threads` team pulls in for a KV job of these blocks, as (worker, 0 for
// K or 1 for V, byte offset from that cache's base) triples in the order it issues them.
std::vector<int64_t> team_kv_lines(std::vector<int64_t> ids, std::vector<int64_t> bytes, int64_t block_bytes,
                                   int64_t threads) {
  TORCH_CHECK(ids.size() == bytes.size(), "one byte count a block");
  std::vector<tandem_cpu::KvBlock> blocks;
  for (size_t i = 0; i < ids.size(); ++i)
    blocks.push_back({static_cast<int32_t>(ids[i]), static_cast<int32_t>(bytes[i])});
  const tandem_cpu::KvPrefetch job{nullptr, nullptr, block_bytes, blocks.data(), static_cast<int64_t>(blocks.size())};
  std::vector<int64_t> lines;
  for (int64_t tid = 1; tid < threads; ++tid) {
    tandem_cpu::KvCursor at{&job, tid - 1, 0};
    const auto line = [&](bool v, int64_t offset) { lines.insert(lines.end(), {tid, v ? 1 : 0, offset}); };
    while (tandem_cpu::next_kv_lines(at, threads - 1, 8, line)) {
    }
  }
  return lines;
}

double team_weight(int64_t key) { return tandem_cpu::g_weights.of(key).load(std::memory_order_relaxed); }
void reset_team_weights() { tandem_cpu::g_weights.reset(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  // No tensor arguments, so no dispatch key: registered with their definitions (CatchAll).
  m.def("set_step_team(bool on) -> bool", &set_step_team);
  m.def("set_team_prefetch(bool on) -> bool", &set_team_prefetch);
  m.def("team_chunks(int n, int grain, int throw_at, int key=-1, int loops=1, int unit_ns=0, int slow_tid=-1) -> int[]",
        &team_chunks);
  m.def("team_prefetch_shares(int n, int grain, int threads, int key) -> int[]", &team_prefetch_shares);
  m.def("team_split(int n, int grain, int threads, float weight) -> int[]", &team_split);
  m.def("team_kv_lines(int[] ids, int[] bytes, int block_bytes, int threads) -> int[]", &team_kv_lines);
  m.def("team_weight(int key) -> float", &team_weight);
  m.def("reset_team_weights() -> ()", &reset_team_weights);
}
