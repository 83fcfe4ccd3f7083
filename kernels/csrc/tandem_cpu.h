// The CPU ops of tandem_cpu_kernels callable from C++ (decoder_cpu.cpp runs a whole layer stack with
// them, without a trip through Python between ops). Each is also registered as torch.ops.tandem_cpu.<name>.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "thread_team.h"

namespace tandem_cpu {

// An _out form's y: [M, N] contiguous fp32.
inline void check_out(const at::Tensor& y, int64_t M, int64_t N) {
  TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.is_contiguous() && y.scalar_type() == at::kFloat,
              "out must be [", M, ", ", N, "] contiguous fp32");
}

// cpu_isa.cpp: the instruction set the kernels use now (the CPU's best unless set_isa narrowed it)
enum class Isa { kAvx2, kAvxVnni, kAvx512Vnni };
Isa isa();
// The fewest rows of x the AVX-512 VNNI set multiplies on 512-bit pairs of groups (fewer: 256-bit dpbusd)
int64_t min_rows_for_pairs();
// From how many rows of x the quantized matrices run on AMX tiles (0: not now, the set is not "amx"; quant_x8_amx.h)
int64_t amx_min_rows();

// paged_decode_cpu.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale);
void paged_decode_attention_out(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                at::Tensor& out);
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping);
// Decode attention and the KV store split into their checks and their work on one layer's caches by address, for a
// loop over a stack's layers that checks its inputs once: a tensor view of each layer's caches (three selects) ~1 us.
struct CacheLayer {
  void *k, *v;  // [num_blocks, block_size, kv_heads, row] each, of dtype
  at::ScalarType dtype;
  int64_t num_blocks, block_size, kv_heads, row;
};
CacheLayer cache_layer(const at::Tensor& k_cache, const at::Tensor& v_cache);
void check_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& out);
void decode_attention_unchecked(const at::Tensor& q, const CacheLayer& layer, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, double scale, at::Tensor& out);
// (check_store_kv checks every slot against the cache as well, so a bad one writes nothing: the stores after it do
// not look again.)
void check_store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& slot_mapping);
// One token's fp32 head row (K's, or V's where `value`) into slot `slot` of a float, float16 or int8 cache, as
// store_kv writes it: for a matrix's threads to store the heads they have just computed (decoder_cpu.cpp).
void store_head_unchecked(const CacheLayer& layer, bool value, int64_t slot, int64_t head, const float* src);

// quant_linear_cpu.cpp: x [M, K] fp32 against a GGUF-blocked weight [N, K / 32 * block bytes] uint8
at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& w);
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& w);
// The _out forms write into y [M, N] (contiguous fp32) instead of a new tensor: a decode step reuses its buffers.
void q4_1_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y);
void q8_0_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y);
// quant_linear_x8_cpu.cpp: the same blocks interleaved by 8 rows, w [N / 8, K / 32 * 160 (Q4_1) or 272 (Q8_0)],
// group after group (x8) or two by two (x8p)
// `after`, where given, is work each thread does on the columns of y it has just computed, while they sit in its
// cache: after(begin, end) once a thread's columns [begin, end) are done (a decode step's RoPE and KV store after
// qkv: while this VM's two vCPUs sit far apart, the leader read the other core's half at ~30 ns a cache line).
using ColumnsDone = c10::function_ref<void(int64_t, int64_t)>;
void q4_1x8_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, const ColumnsDone* after = nullptr);
void q8_0x8_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, const ColumnsDone* after = nullptr);
void q4_1x8p_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, const ColumnsDone* after = nullptr);
void q8_0x8p_linear_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, const ColumnsDone* after = nullptr);
// act [M, N / 2] = silu(gate) * up of x w^T, for a gate_up w whose gate and up rows alternate every 16 rows
void q4_1x8_linear_silu_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& act);
void q8_0x8_linear_silu_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& act);
void q4_1x8p_linear_silu_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& act);
void q8_0x8p_linear_silu_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& act);
// w (any x8 format) as the rows q4_1x8_linear / q8_0x8_linear split among a thread team (thread_team.h)
PrefetchTarget x8_prefetch_target(const at::Tensor& w);

// fused_ops_cpu.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor add_rms_norm_(at::Tensor& h, const at::Tensor& d, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& gu);
void rms_norm_out(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out);
void add_rms_norm_out_(at::Tensor& h, const at::Tensor& d, const at::Tensor& w, double eps, at::Tensor& out);
void silu_mul_out(const at::Tensor& gu, at::Tensor& out);
// out[u * unit + i] = silu(gu[2u * unit + i]) * gu[(2u + 1) * unit + i] for `units` units: a row whose gate and up
// alternate every `unit` values, as silu_mul_out computes each value (the same bits). `stream`: where it can (out
// 64-byte aligned, unit a multiple of 16) out is written past the cache; the caller fences before others read.
void silu_mul_units(float* out, const float* gu, int64_t units, int64_t unit, bool stream = false);
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// One head row of D values in place, as rope_ turns each: c and s its token's cos and sin rows [D].
void rope_head(float* row, const float* c, const float* s, int64_t D);
at::Tensor argmax_rows(const at::Tensor& x);

}  // namespace tandem_cpu
