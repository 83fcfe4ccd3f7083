// A Llama-family decoder's layer stack for one decode step on CPU, in one call.
//
// At batch 1 a step's kernels take ~10 ms on a 2-core AVX2 CPU; the Python between them (~15 calls a
// layer, 30 layers: attribute lookups, isinstance checks, torch.ops argument parsing) took another ~4-5
// ms. Here the same ops run in the same order on the same tensors, called directly, so the result is
// bit-identical to the Python loop in workers/model/llama.py; only the interpreter is gone.
//
// Decode-only steps (one token a sequence, attention through the paged cache), fp32, weights kept as
// GGUF blocks (Q4_1 or Q8_0 per matrix). The weights are packed once into a DecoderWeights object (a TorchScript
// custom class, as torch's own prepacked quantized linear weights are), not a Tensor[] of 210 and an int[] of 120
// to parse and check again every step; the step passes the object's number (its `handle()`), not the object:
// from Python a custom-class argument took ~30 us a call to convert (an int ~1), 2% of a batch-1 step.
// Per layer, 7 tensors in `weights`:
//   attn_norm [H], qkv [N_qkv, bytes], qkv_bias [N_qkv] or empty, o_proj, mlp_norm [H], gate_up, down
// and 4 codes in `formats` (qkv, o_proj, gate_up, down): 0 = Q4_1, 1 = Q8_0, 2 = Q4_1 interleaved by 8 rows,
// 3 = Q8_0 interleaved by 8 rows, 4 and 5: the same with the groups stored two by two (x8p). gate_up's code plus
// kPairedGateUp (an x8 or x8p one): its gate and up rows alternate every 16, and the SiLU runs inside the matrix
// (x8_linear_silu_out: each thread on its own columns, no SiLU pass of the leader's).
//
//   h [B, hidden] fp32, updated in place to the residual stream after the last layer (final norm not applied)
//   kv_cache [layers, 2, num_blocks, block_size, KVH, D] (int8: D + 4); cos/sin [B, D]; slot_mapping [B];
//   block_tables [B, max_blocks] int32; seq_lens [B] int32

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "step_phases.h"
#include "tandem_cpu.h"
#include "thread_team.h"

namespace {

constexpr int64_t kPerLayer = 7;
constexpr int64_t kFormatsPerLayer = 4;
constexpr int64_t kMatrixSlots[kFormatsPerLayer] = {1, 3, 5, 6};  // qkv, o_proj, gate_up, down among a layer's 7
constexpr int64_t kGateUp = 2;        // gate_up's place among a layer's 4 codes
constexpr int64_t kPairedGateUp = 8;  // added to gate_up's code: see the top
constexpr int64_t matrix_format(int64_t code) { return code & ~kPairedGateUp; }

// The step's matrices in the order it multiplies them (those in x8 formats: the others' threads split them by
// rows of 16, and they are not the default), for the team's workers to prefetch (thread_team.h). A target's key
// is its matrix (0-3) and the batch (1-8, or more), so the team learns a split for each.
std::vector<tandem_cpu::PrefetchTarget> prefetch_plan(at::TensorList weights, at::IntArrayRef formats, int64_t B) {
  std::vector<tandem_cpu::PrefetchTarget> plan;
  for (size_t i = 0; i < formats.size(); ++i) {
    const int64_t layer = static_cast<int64_t>(i) / kFormatsPerLayer, matrix = static_cast<int64_t>(i) % kFormatsPerLayer;
    const at::Tensor& w = weights[layer * kPerLayer + kMatrixSlots[matrix]];
    const bool x8 = matrix_format(formats[i]) >= 2 && w.dim() == 2 && w.scalar_type() == at::kByte;  // else refused
    plan.push_back(x8 ? tandem_cpu::x8_prefetch_target(w) : tandem_cpu::PrefetchTarget{nullptr, 0, 0, 1});
    plan.back().key = matrix + kFormatsPerLayer * (std::min<int64_t>(B, 9) - 1);
  }
  return plan;
}

// Each layer's KV job for the team's workers (thread_team.h): the step's sequences' blocks, the same ids in every
// layer's cache, up to kKvPrefetchBytes of K and V: what fits beside a worker's share of the next matrix in a 1 MB
// L2. More would be evicted before attention reads it (batch 16 of ~450 tokens, 3.3 MB a layer: steps of 10.3-10.9
// ms with no cap, with this one, and with none prefetched alike). `blocks` is filled here and must outlive the jobs.
constexpr int64_t kKvPrefetchBytes = 512 * 1024;
std::vector<tandem_cpu::KvPrefetch> kv_jobs(const at::Tensor& kv_cache, const at::Tensor& tables, const at::Tensor& lens,
                                            std::vector<tandem_cpu::KvBlock>& blocks) {
  const int64_t layers = kv_cache.size(0), block_size = kv_cache.size(3);
  const int64_t row_bytes = kv_cache.size(4) * kv_cache.size(5) * kv_cache.element_size();  // a token's heads
  const int64_t block_bytes = block_size * row_bytes, cache_bytes = kv_cache.size(2) * block_bytes;
  const int32_t* table = tables.data_ptr<int32_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  int64_t bytes = 0;
  for (int64_t b = 0; b < tables.size(0); ++b)  // attention checks the lengths later: here only the table's bounds
    for (int64_t j = 0; j * block_size < len[b] && j < tables.size(1) && bytes < kKvPrefetchBytes; ++j) {
      blocks.push_back({table[b * tables.size(1) + j],
                        static_cast<int32_t>(std::min<int64_t>(block_size, len[b] - j * block_size) * row_bytes)});
      bytes += 2 * int64_t{blocks.back().bytes};  // K's and V's
    }
  std::vector<tandem_cpu::KvPrefetch> jobs;
  const char* base = static_cast<const char*>(kv_cache.data_ptr());
  for (int64_t i = 0; i < layers; ++i)  // layer i's K cache, then its V cache
    jobs.push_back({base + 2 * i * cache_bytes, base + (2 * i + 1) * cache_bytes, block_bytes, blocks.data(),
                    static_cast<int64_t>(blocks.size())});
  return jobs;
}

// A stack's weights, checked and packed once: what every step of the model passes to decode_layers_.
struct DecoderWeights : torch::CustomClassHolder {
  std::vector<at::Tensor> weights;
  std::vector<int64_t> formats;

  DecoderWeights(std::vector<at::Tensor> w, std::vector<int64_t> f) : weights(std::move(w)), formats(std::move(f)) {
    const int64_t layers = static_cast<int64_t>(weights.size()) / kPerLayer;
    TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer && layers > 0,
                "weights must hold 7 tensors a layer, got ", weights.size());
    TORCH_CHECK(static_cast<int64_t>(formats.size()) == layers * kFormatsPerLayer, "formats must hold 4 codes a layer");
    for (size_t i = 0; i < formats.size(); ++i) {
      const int64_t code = formats[i];
      TORCH_CHECK(matrix_format(code) >= 0 && matrix_format(code) <= 5, "format code ", code, " is none of Q4_1 (0), "
                  "Q8_0 (1), Q4_1 by 8 rows (2), Q8_0 by 8 rows (3), Q4_1 by 8 rows in pairs (4), Q8_0 by 8 rows in "
                  "pairs (5), each plus ", kPairedGateUp, " for a gate_up whose gate and up rows alternate");
      const bool gate_up_x8 = static_cast<int64_t>(i) % kFormatsPerLayer == kGateUp && matrix_format(code) >= 2;
      TORCH_CHECK(!(code & kPairedGateUp) || gate_up_x8, "format code ", code,
                  ": only gate_up's, in an x8 or x8p format, takes alternating gate and up rows");
    }
  }

  int64_t layers() const { return static_cast<int64_t>(weights.size()) / kPerLayer; }

  // The last strong reference is gone (the registry's is weak): out of the registry, so its number finds nothing.
  void release_resources() override;

  int64_t handle = -1;  // its number in the registry, once asked for
};

// Packed stacks by number. Weak references: a stack lives as long as Python holds its object, and a number whose
// stack is gone is refused by name, never read.
class Registry {
 public:
  int64_t add(const c10::intrusive_ptr<DecoderWeights>& w) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (w->handle < 0) {
      w->handle = next_++;
      stacks_.emplace(w->handle, c10::weak_intrusive_ptr<DecoderWeights>(w));
    }
    return w->handle;
  }
  c10::intrusive_ptr<DecoderWeights> find(int64_t handle) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = stacks_.find(handle);
    c10::intrusive_ptr<DecoderWeights> w = it != stacks_.end() ? it->second.lock() : nullptr;
    TORCH_CHECK(w, "no packed decoder stack numbered ", handle, " (freed, or not from DecoderWeights.handle())");
    return w;
  }
  void remove(int64_t handle) {
    const std::lock_guard<std::mutex> lock(mutex_);
    stacks_.erase(handle);
  }

 private:
  std::mutex mutex_;
  std::unordered_map<int64_t, c10::weak_intrusive_ptr<DecoderWeights>> stacks_;
  int64_t next_ = 0;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: stacks may be released during interpreter exit
  return *r;
}

void DecoderWeights::release_resources() {
  if (handle >= 0) registry().remove(handle);
  weights.clear();
}

// y = x w^T into y's storage, then `after` on its columns: on each thread's own where the format splits them among
// threads (x8 and x8p), else on all of them here.
void linear(const at::Tensor& x, const at::Tensor& w, int64_t format, at::Tensor& y,
            const tandem_cpu::ColumnsDone* after) {
  switch (format) {
    case 0: tandem_cpu::q4_1_linear_out(x, w, y); break;
    case 1: tandem_cpu::q8_0_linear_out(x, w, y); break;
    case 2: tandem_cpu::q4_1x8_linear_out(x, w, y, after); return;
    case 3: tandem_cpu::q8_0x8_linear_out(x, w, y, after); return;
    case 4: tandem_cpu::q4_1x8p_linear_out(x, w, y, after); return;
    default: tandem_cpu::q8_0x8p_linear_out(x, w, y, after); return;
  }
  if (after != nullptr) (*after)(0, y.size(1));
}

// act = silu(gate) * up of x w^T for a gate_up whose gate and up rows alternate (an x8 or x8p format).
void linear_silu(const at::Tensor& x, const at::Tensor& w, int64_t format, at::Tensor& act) {
  switch (format) {
    case 2: tandem_cpu::q4_1x8_linear_silu_out(x, w, act); return;
    case 3: tandem_cpu::q8_0x8_linear_silu_out(x, w, act); return;
    case 4: tandem_cpu::q4_1x8p_linear_silu_out(x, w, act); return;
    default: tandem_cpu::q8_0x8p_linear_silu_out(x, w, act); return;
  }
}

// The rows a matrix gives: x8 and x8p formats hold 8 rows a group.
int64_t out_rows(const at::Tensor& w, int64_t format) { return w.size(0) * (format >= 2 ? 8 : 1); }

// The layer stack over h's rows: the whole batch on the step's thread team (each matrix's rows split among the
// threads), or, inside one thread of a split batch (decode_layers_'s `parts`), that thread's rows alone. `clocked`:
// this call's phases go to the step phase clock (one caller at a time books them).
void decode_rows(at::Tensor& h, const DecoderWeights& packed, const at::Tensor& cos, const at::Tensor& sin,
                 const at::Tensor& kv_cache, const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lens,
                 int64_t num_heads, int64_t num_kv_heads, double scale, double eps, bool clocked) {
  const at::TensorList weights = packed.weights;
  const at::IntArrayRef formats = packed.formats;
  const int64_t layers = packed.layers();
  const int64_t B = h.size(0), D = kv_cache.size(5) - (kv_cache.scalar_type() == at::kChar ? 4 : 0);
  const int64_t q_size = num_heads * D, kv_size = num_kv_heads * D;

  const std::vector<tandem_cpu::PrefetchTarget> plan = prefetch_plan(weights, formats, B);
  std::vector<tandem_cpu::KvBlock> kv_blocks;
  const std::vector<tandem_cpu::KvPrefetch> kv_plan = kv_jobs(kv_cache, tables, lens, kv_blocks);
  // Every layer's activations have one shape: one buffer each for the whole step, not a tensor an op a layer. All
  // in one allocation, and they and the views below made by at::from_blob, past the dispatcher: seven at::empty and
  // eleven narrow, view and select calls took ~25 us a step.
  const int64_t hidden = h.size(1), qkv_width = q_size + 2 * kv_size;
  const int64_t gate_up_width = out_rows(weights[5], matrix_format(formats[kGateUp]));
  const at::Tensor scratch = at::empty({B * (4 * hidden + qkv_width + q_size + gate_up_width + gate_up_width / 2)},
                                       h.options());
  float* free_at = scratch.data_ptr<float>();
  const auto view = [&](float* data, at::IntArrayRef sizes, at::IntArrayRef strides) {
    return at::from_blob(data, sizes, strides, h.options());
  };
  const auto buffer = [&](int64_t cols) {
    float* data = free_at;
    free_at += B * cols;
    return view(data, {B, cols}, {cols, 1});
  };
  at::Tensor x = buffer(hidden), qkv = buffer(qkv_width), o = buffer(q_size);
  at::Tensor o_proj = buffer(hidden), gate_up = buffer(gate_up_width);
  at::Tensor act = buffer(gate_up_width / 2), mlp_out = buffer(hidden);
  float* const qkv_rows = qkv.data_ptr<float>();
  const at::Tensor q_heads = view(qkv_rows, {B, num_heads, D}, {qkv_width, D, 1});  // as paged attention reads them
  at::Tensor o_heads = view(o.data_ptr<float>(), {B, num_heads, D}, {q_size, D, 1});
  const at::Tensor k = view(qkv_rows + q_size, {B, num_kv_heads, D}, {qkv_width, D, 1});
  const at::Tensor v = view(qkv_rows + q_size + kv_size, {B, num_kv_heads, D}, {qkv_width, D, 1});
  // Every layer's caches have layer 0's shape, a fixed stride apart: checked once here, then passed by address.
  const auto first_cache = [&](int64_t which) {  // kv_cache[0, which]
    return at::from_blob(static_cast<char*>(kv_cache.data_ptr()) + which * kv_cache.stride(1) * kv_cache.element_size(),
                         kv_cache.sizes().slice(2), kv_cache.strides().slice(2), kv_cache.options());
  };
  const at::Tensor first_k = first_cache(0), first_v = first_cache(1);
  tandem_cpu::check_store_kv(k, v, first_k, first_v, slots);  // the slots too: every layer's cache has them
  const int64_t* slot = slots.data_ptr<int64_t>();
  tandem_cpu::check_decode_attention(q_heads, first_k, first_v, tables, lens, o_heads);
  const tandem_cpu::CacheLayer first_layer = tandem_cpu::cache_layer(first_k, first_v);
  const float *const cos_rows = cos.data_ptr<float>(), *const sin_rows = sin.data_ptr<float>();
  const int64_t total_heads = num_heads + 2 * num_kv_heads;
  std::vector<uint8_t> head_done(total_heads);  // qkv's heads a thread has finished, a layer
  const int64_t layer_bytes = kv_cache.stride(0) * kv_cache.element_size();
  const auto cache_of = [&](int64_t i) {
    tandem_cpu::CacheLayer layer = first_layer;
    layer.k = static_cast<char*>(first_layer.k) + i * layer_bytes;
    layer.v = static_cast<char*>(first_layer.v) + i * layer_bytes;
    return layer;
  };
  const auto run_layers = [&] {
    tandem_cpu::prefetch_plan(plan.data(), static_cast<int64_t>(plan.size()));
    tandem_cpu::prefetch_kv(&kv_plan[0]);
    // Layer i's matrix j is plan entry 4i + j: the workers prefetch the one after the entry the leader is on. Its
    // weight and format, once checked to give `rows` rows.
    const auto reach_matrix = [&](int64_t i, int64_t j, int64_t rows) {
      tandem_cpu::prefetch_reached(i * kFormatsPerLayer + j);
      const at::Tensor& w = weights[i * kPerLayer + kMatrixSlots[j]];
      const int64_t format = matrix_format(formats[i * kFormatsPerLayer + j]);
      static constexpr const char* kNames[kFormatsPerLayer] = {"qkv", "o_proj", "gate_up", "down"};
      TORCH_CHECK(out_rows(w, format) == rows, "layer ", i, ": ", kNames[j], " has ", out_rows(w, format),
                  " rows, the heads and sizes need ", rows);
      return std::pair<const at::Tensor&, int64_t>(w, format);
    };
    const auto multiply = [&](int64_t i, int64_t j, const at::Tensor& in, at::Tensor& out,
                              const tandem_cpu::ColumnsDone* after = nullptr) {
      const auto [w, format] = reach_matrix(i, j, out.size(1));
      linear(in, w, format, out, after);
    };
    // gate_up in a paired format, and its SiLU: act = silu(gate) * up.
    const auto multiply_silu = [&](int64_t i, const at::Tensor& in, at::Tensor& act) {
      const auto [w, format] = reach_matrix(i, kGateUp, 2 * act.size(1));
      linear_silu(in, w, format, act);
    };
    using tandem_cpu::StepPhase;
    tandem_cpu::StepPhaseClock clock(clocked);
    for (int64_t i = 0; i < layers; ++i) {
      const at::Tensor* w = weights.data() + i * kPerLayer;
      // The previous layer's MLP output joins h in this layer's fused norm.
      if (i == 0) tandem_cpu::rms_norm_out(h, w[0], eps, x);
      else tandem_cpu::add_rms_norm_out_(h, mlp_out, w[0], eps, x);
      clock.mark(StepPhase::kAttnNorm);
      // Each of qkv's heads: its bias, RoPE (Q's and K's heads), into this layer's cache (K's and V's), done by
      // the thread that computed it, while it is in that thread's cache: on the leader alone, reading the other
      // core's half, batch 8's RoPE and KV store took ~9.6 us a layer while this VM's two vCPUs sat far apart (the
      // fast-bus state: see bench_quant_decode) and ~3.1 when near. A head cut between two threads' columns is
      // the leader's, once the matrix is done.
      const tandem_cpu::CacheLayer layer_cache = cache_of(i);
      const float* bias = w[2].numel() ? w[2].data_ptr<float>() : nullptr;
      const auto finish_head = [&](int64_t head) {
        for (int64_t b = 0; b < B; ++b) {
          float* row = qkv_rows + b * qkv_width + head * D;
          if (bias != nullptr)
            for (int64_t d = 0; d < D; ++d) row[d] += bias[head * D + d];
          if (head < num_heads + num_kv_heads) tandem_cpu::rope_head(row, cos_rows + b * D, sin_rows + b * D, D);
          if (head >= num_heads && slot[b] >= 0)
            tandem_cpu::store_head_unchecked(layer_cache, head >= num_heads + num_kv_heads, slot[b],
                                             (head - num_heads) % num_kv_heads, row);
        }
      };
      const auto finish_heads_within = [&](int64_t begin, int64_t end) {
        for (int64_t head = (begin + D - 1) / D; (head + 1) * D <= end; ++head) finish_head(head), head_done[head] = 1;
      };
      const tandem_cpu::ColumnsDone qkv_done(finish_heads_within);
      std::fill(head_done.begin(), head_done.end(), 0);
      multiply(i, 0, x, qkv, &qkv_done);
      for (int64_t head = 0; head < total_heads; ++head)
        if (!head_done[head]) finish_head(head);
      clock.mark(StepPhase::kQkv);
      tandem_cpu::decode_attention_unchecked(q_heads, layer_cache, tables, lens, scale, o_heads);
      clock.mark(StepPhase::kAttention);
      // The next layer's KV blocks: the workers pull them in while this layer's MLP runs (batch 8's attention
      // 34-36 -> 26-27 us a layer; after the leader's attention, so as not to compete with it).
      if (i + 1 < layers) tandem_cpu::prefetch_kv(&kv_plan[i + 1]);
      multiply(i, 1, o, o_proj);
      clock.mark(StepPhase::kOProj);
      tandem_cpu::add_rms_norm_out_(h, o_proj, w[4], eps, x);
      clock.mark(StepPhase::kMlpNorm);
      if (formats[i * kFormatsPerLayer + kGateUp] & kPairedGateUp) {
        multiply_silu(i, x, act);
        clock.mark(StepPhase::kGateUp);
      } else {
        multiply(i, kGateUp, x, gate_up);
        clock.mark(StepPhase::kGateUp);
        tandem_cpu::silu_mul_out(gate_up, act);
      }
      clock.mark(StepPhase::kSilu);
      multiply(i, 3, act, mlp_out);
      clock.mark(StepPhase::kDown);
    }
    // The last layer's MLP output joins h: a loop, not at::add_ (a dispatcher call), the same sums.
    float* const out = h.data_ptr<float>();
    const float* const last = mlp_out.data_ptr<float>();
    for (int64_t e = 0; e < B * hidden; ++e) out[e] += last[e];
  };
  // The step's ~150 parallel loops (5 a layer) share one team of threads: thread_team.h.
  tandem_cpu::with_team(run_layers);
}

// `parts` > 1: the batch's rows cut into that many runs (at most one a thread, at least one row each), each run
// through every layer on its own thread: no hand-off between threads inside the stack, and every thread reads
// every weight. When the two vCPUs of this VM sit far apart (the fast-bus state: more bandwidth, dearer lines
// between the cores), batch 16 at 450 tokens took 6.5 ms this way against 8.1 on the team; when near, batch 4 took
// 2.7 against 1.85 (kernels/batch_split.py learns which while it serves). Same bits either way: a row's
// kernels do not depend on the others'.
void decode_layers_(at::Tensor& h, int64_t stack, const at::Tensor& cos, const at::Tensor& sin,
                    const at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                    const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads, double scale, double eps,
                    int64_t parts) {
  const c10::intrusive_ptr<DecoderWeights> packed = registry().find(stack);
  const int64_t layers = packed->layers();
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kFloat && h.size(0) > 0,
              "h must be [B, hidden] contiguous fp32, B > 0");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == layers && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be [layers, 2, num_blocks, block_size, KVH, D] contiguous, one layer per 7 weights");
  // An int8 cache's head rows end in a 4-byte scale (paged_decode_cpu.cpp).
  const int64_t B = h.size(0), D = kv_cache.size(5) - (kv_cache.scalar_type() == at::kChar ? 4 : 0);
  TORCH_CHECK(kv_cache.size(4) == num_kv_heads && num_heads % num_kv_heads == 0, "head counts disagree with the cache");
  TORCH_CHECK(slot_mapping.numel() == B && seq_lens.numel() == B && block_tables.size(0) == B,
              "one slot, length and block table a row of h");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == B && cos.size(1) == D && cos.is_contiguous() &&
                  cos.scalar_type() == at::kFloat && sin.sizes() == cos.sizes() && sin.is_contiguous() &&
                  sin.scalar_type() == at::kFloat,
              "cos and sin must be [B, head_dim] contiguous fp32");
  // (slot_mapping int64 and every table contiguous, as the engine passes them: no dispatcher call ~2 us each)
  const at::Tensor slots = slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous()
                               ? slot_mapping : slot_mapping.to(at::kLong).contiguous();
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  parts = std::min({parts, B, static_cast<int64_t>(at::get_num_threads())});
  if (parts <= 1 || at::in_parallel_region()) {
    decode_rows(h, *packed, cos, sin, kv_cache, slots, tables, lens, num_heads, num_kv_heads, scale, eps, true);
    return;
  }
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) {
      const int64_t first = B * part / parts, rows = B * (part + 1) / parts - first;
      at::Tensor part_h = h.narrow(0, first, rows);  // whole rows of a contiguous h: contiguous
      decode_rows(part_h, *packed, cos.narrow(0, first, rows), sin.narrow(0, first, rows), kv_cache,
                  slots.narrow(0, first, rows), tables.narrow(0, first, rows), lens.narrow(0, first, rows),
                  num_heads, num_kv_heads, scale, eps, part == 0);
    }
  });
}

bool set_stack_phase_timing(bool on) { return std::exchange(tandem_cpu::step_phase_seconds().on, on); }

// {name: seconds} of each phase summed since the last reset, in a layer's order; `reset` zeroes them after.
c10::Dict<std::string, double> stack_phase_seconds(bool reset) {
  tandem_cpu::StepPhaseSeconds& s = tandem_cpu::step_phase_seconds();
  c10::Dict<std::string, double> out;
  for (size_t p = 0; p < s.seconds.size(); ++p) out.insert(tandem_cpu::kStepPhaseNames[p], s.seconds[p]);
  if (reset) s.seconds.fill(0.0);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  // No tensor arguments, so no dispatch key: registered with their definitions (CatchAll).
  m.def("set_stack_phase_timing(bool on) -> bool", &set_stack_phase_timing);
  m.def("stack_phase_seconds(bool reset=False) -> Dict(str, float)", &stack_phase_seconds);
  m.class_<DecoderWeights>("DecoderWeights")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>>())
      .def("handle", [](const c10::intrusive_ptr<DecoderWeights>& self) { return registry().add(self); });
  m.def("decode_layers_(Tensor(a!) h, int stack, Tensor cos, Tensor sin, Tensor(b!) kv_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int num_heads, int num_kv_heads, float scale, "
        "float eps, int parts=1) -> ()");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("decode_layers_", &decode_layers_); }
