// What the attention kernels share at their entry: the checks of q against the paged caches, and the one switch
// from runtime shapes to compiled ones (the head size D becomes a constant, so a row's vectors live in registers;
// the cache's dtype becomes the element type T its rows are read as).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

namespace tandem_cpu {

constexpr int64_t kInt8RowScaleBytes = 4;  // an int8 cache's head row: D values, then their fp32 scale

// Elements of a cache's head row of D values: D, or D values and their scale for int8.
template <typename T>
constexpr int64_t head_row(int64_t d) {
  return std::is_same_v<T, int8_t> ? d + kInt8RowScaleBytes : d;
}

// q [T, H, D] fp32 against caches [num_blocks, block_size, KVH, D] (int8: D + 4) of one dtype, contiguous; q's
// rows may lie apart (a view of a fused QKV) where `strided_rows`, each row's heads still one run of H * D.
inline void check_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   bool strided_rows = false) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be fp32");
  const at::ScalarType cache_type = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == cache_type &&
                  (cache_type == at::kFloat || cache_type == at::kHalf || cache_type == at::kChar),
              "the caches must both be fp32, both fp16 or both int8");
  const bool q_rows_ok = strided_rows ? q.stride(2) == 1 && q.stride(1) == q.size(2) : q.is_contiguous();
  TORCH_CHECK(q_rows_ok && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous tensors only");
  const bool int8 = cache_type == at::kChar;
  TORCH_CHECK(k_cache.size(3) == q.size(2) + (int8 ? kInt8RowScaleBytes : 0) && q.size(1) % k_cache.size(2) == 0,
              "head shapes disagree: rows of ", k_cache.size(3), " for queries of ", q.size(2),
              int8 ? " (int8: D + 4)" : "");
}

// f(std::integral_constant<int64_t, D>{}, T{}) for head_dim D in 16, 32, 64, 128, 256 and T float, at::Half or
// int8_t as the cache is fp32, fp16 or int8 (callers check the dtype is one of those).
template <typename F>
void with_head_and_cache(int64_t head_dim, at::ScalarType cache_type, F&& f) {
  const auto run = [&](auto d) {
    if (cache_type == at::kHalf) f(d, at::Half{});
    else if (cache_type == at::kChar) f(d, int8_t{});
    else f(d, float{});
  };
  switch (head_dim) {
    case 16: return run(std::integral_constant<int64_t, 16>{});
    case 32: return run(std::integral_constant<int64_t, 32>{});
    case 64: return run(std::integral_constant<int64_t, 64>{});
    case 128: return run(std::integral_constant<int64_t, 128>{});
    case 256: return run(std::integral_constant<int64_t, 256>{});
    default: TORCH_CHECK(false, "head_dim ", head_dim, " not supported (16, 32, 64, 128, 256)");
  }
}

}  // namespace tandem_cpu
