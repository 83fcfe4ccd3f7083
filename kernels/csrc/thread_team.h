// One team of threads for a whole decode step, so the step's ~150 parallel loops (5 a layer: 4 matrices and
// attention) do not each start and join an OpenMP team.
//
// at::parallel_for opens an OpenMP parallel region a call: ~1.2 us back to back on a 2-core Zen 5 VM and up to
// ~2.7 us between the step's serial ops (a 64-row matrix: 1.6 us on one thread, 4.4 us on two). Under
// `with_team`, the calling thread (the leader) runs the step's code as before while the other threads spin in one
// region; each parallel_for hands them its range through one shared cache line and meets them at a spin barrier
// (~0.2 us). The default model's stack: batch 1 -8%, batch 8 -3% (bench_step_team.py).
//
//   tandem_cpu::with_team([&] { ... tandem_cpu::parallel_for(0, n, grain, f); ... });
//
// parallel_for splits a range as at::parallel_for does (the same chunks on the same number of threads, so a
// kernel's output does not change), and outside a team it is at::parallel_for. An exception in a worker's
// share is rethrown on the leader after the barrier; one on the leader releases the workers first.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/FunctionRef.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace tandem_cpu {

// Runs `body` on this thread with at::get_num_threads() - 1 workers waiting for its parallel_for calls. Nested
// or on one thread: just runs body.
void with_team(c10::function_ref<void()> body);

// The threads a parallel_for shares its range among now: the team's, one inside a parallel region (where
// at::parallel_for runs on the calling thread), else at::get_num_threads().
int64_t num_threads();

// Weights a team's prefetched_parallel_for will walk later: `units` rows of `unit_bytes` at `base`, split with
// `grain`. Loops of one `key` (a kind of matrix at a batch size) share what the team learns of how to split them.
struct PrefetchTarget {
  const void* base;
  int64_t unit_bytes, units, grain;
  int64_t key = 0;
};

// The matrices the leader will multiply, in order (the array must outlive the team's body; one plan a team). While
// they wait for a loop (the leader runs the serial ops between matrices: norms, RoPE, the KV store, at batch 1 on
// one thread; or it still streams its own share), the workers pull their own shares (prefetched_parallel_for's
// split) of the target after the leader's into their caches, so the memory bus does not idle while only the leader
// computes. With the learned split: stack -7% at batch 1, -3 to -6% at batch 8 (bench_step_team.py; the engine's
// own steps alike). Looking two targets ahead was slower. No-op outside a team or while set_team_prefetch(false).
void prefetch_plan(const PrefetchTarget* targets, int64_t count);
// The leader starts on targets[index]: the workers look beyond it.
void prefetch_reached(int64_t index);

// A coming layer's KV blocks, for the workers to pull into cache once they have prefetched their share of the
// plan's next target: a sequence's blocks lie anywhere in the cache, so no hardware prefetcher finds them before
// attention asks, and a batch-8 step's attention waited on them (~1/3 of its time). Block blocks[i].id's first
// blocks[i].bytes, at k_base and at v_base + id * block_bytes.
struct KvBlock {
  int32_t id, bytes;
};
struct KvPrefetch {
  const char *k_base, *v_base;
  int64_t block_bytes;
  const KvBlock* blocks;
  int64_t count;
};
// The leader posts one job at a time, each replacing the last (it must outlive the team's body); worker t takes
// blocks t - 1, t - 1 + (size - 1), ... No-op outside a team or while set_team_prefetch(false).
void prefetch_kv(const KvPrefetch* job);

// A worker's place in a KV job.
struct KvCursor {
  const KvPrefetch* job = nullptr;
  int64_t block = 0, offset = 0;  // offset: bytes into the block's K lines, then its V lines
};
// Up to `lines` more of the job's lines for the worker whose cursor this is (its blocks `stride` apart), each
// passed to line(v, offset): V's cache (else K's) and the line's byte offset from that cache's base. False when it
// has none left.
template <typename F>
bool next_kv_lines(KvCursor& at, int64_t stride, int lines, const F& line) {
  if (at.job == nullptr || at.block >= at.job->count) return false;
  const KvBlock blk = at.job->blocks[at.block];
  const int64_t span = (static_cast<int64_t>(blk.bytes) + 63) / 64 * 64;  // K's lines, then V's
  for (int i = 0; i < lines; ++i, at.offset += 64) {
    if (at.offset >= 2 * span) {
      at.block += stride, at.offset = 0;
      break;
    }
    const bool k = at.offset < span;
    line(!k, blk.id * at.job->block_bytes + at.offset - (k ? 0 : span));
  }
  return true;
}

namespace detail {
// The team this thread leads, if any: runs f over [begin, end) split into the team's chunks. A function_ref, not
// a std::function: every kernel's parallel_for passes through here, in a team or not, and it allocates nothing.
bool team_parallel_for(int64_t begin, int64_t end, int64_t grain, c10::function_ref<void(int64_t, int64_t)> f,
                       bool prefetched);
}  // namespace detail

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  if (end - begin > grain && detail::team_parallel_for(begin, end, grain, f, false)) return;
  at::parallel_for(begin, end, grain, f);
}

// [begin, end) in chunks of `chunk` that the threads take from a shared counter as each finishes its last: for
// loops whose units cost alike but whose threads do not keep pace (a prefill's matrices: cut in halves, the
// leader waited on the worker for ~6% of its time). For loops whose output does not depend on where the range is cut.
template <typename F>
void shared_parallel_for(int64_t begin, int64_t end, int64_t chunk, const F& f) {
  if (begin >= end) return;
  const int64_t chunks = (end - begin + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  parallel_for(0, std::min(num_threads(), chunks), 1, [&](int64_t, int64_t) {
    for (int64_t c = next++; c < chunks; c = next++) f(begin + c * chunk, std::min(end, begin + (c + 1) * chunk));
  });
}

// Chunks a thread outside a team takes of a prefetched loop (below): enough that a thread slowed by the other
// tenants of its core hands its last chunks to the faster one, few enough that each is a long run of weights.
constexpr int64_t kChunksPerThread = 8;

// The loop over the plan's target the leader is on (prefetch_reached): in a team whose workers prefetch, split as
// they prefetched it, the leader's share weighed against a worker's as the team has learned for the target's key
// (its rows come from memory, theirs from cache). Outside a team (the logits' matrix after the stack), chunks of
// whole grains from a shared counter, not halves: the halves waited on whichever vCPU the host slowed that moment
// (this VM's two ran one loop at 65 and 111 cycles a block in turn). For loops whose output does not depend on
// where the range is cut.
template <typename F>
void prefetched_parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  if (end - begin > grain && detail::team_parallel_for(begin, end, grain, f, true)) return;
  const int64_t threads = num_threads();
  if (threads <= 1) return f(begin, end);  // one thread (or inside a parallel region): the range whole
  grain = std::max<int64_t>(grain, 1);
  const int64_t per_chunk = (end - begin + threads * kChunksPerThread - 1) / (threads * kChunksPerThread);
  shared_parallel_for(begin, end, std::max(grain, (per_chunk + grain - 1) / grain * grain), f);
}

}  // namespace tandem_cpu
