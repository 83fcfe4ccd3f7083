// paged_decode_cpu.cpp's inner loops, written once over a vector type and included in two namespaces: avx2
// (8 floats a register, 16 registers) and avx512 (16 floats, 32 registers, built under `#pragma GCC target`).
// The namespace defines, before including: R (the register type), kW (floats in R), kHeadsAtOnce (query heads
// whose accumulators fit in registers at once), and load / load(Half) / zero / mul / add / fmadd / broadcast /
// store / fold (R -> 8 partial sums in a __m256).
// T is the cache's element: float, at::Half, or int8_t (each head row D values and its fp32 scale, row_scale).

// The K rows of one KV head g for tokens t0 .. t0 + n - 1, in order: row(i, k), k at token t0 + i's row. Every
// score loop walks a sequence's blocks this way, and tells the fetcher of each block it enters.
template <typename T, typename F>
__attribute__((always_inline)) inline void each_key_row(const T* k_cache, const int32_t* table, int64_t t0, int64_t n,
                                                        const Shape& s, int64_t g, const BlockFetcher<T>& fetch,
                                                        const F& row) {
  int64_t block = t0 / s.block_size, offset = t0 % s.block_size;
  for (int64_t i = 0; i < n; ++i) {
    if (offset == 0) fetch.reached(false, block);
    row(i, k_cache + (table[block] * s.block_size + offset) * s.row_stride + g * s.head_stride);
    if (++offset == s.block_size) offset = 0, ++block;
  }
}

// Scores of one (sequence, KV head): q_j . k_t * scale for every query head j of the group, token t. Tokens
// go 8 at a time: each (token, head) leaves 8 partial sums, and 8 tokens' reduce together (sum8).
template <int64_t D, typename T>
void score(const float* q_scaled, const T* k_cache, const int32_t* table, int64_t len, const Shape& s,
           int64_t g, float* scores, int64_t stride, const BlockFetcher<T>& fetch) {
  constexpr int64_t kChunks = D / kW;
  alignas(32) __m256 partial[kMaxHeadsPerKV][8];
  alignas(32) float k_scale[8] = {};  // int8 rows: the 8 tokens' scales, applied to their 8 sums at once
  for (int64_t t0 = 0; t0 < len; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, len - t0);
    each_key_row(k_cache, table, t0, n, s, g, fetch, [&](int64_t i, const T* k) {
      if constexpr (std::is_same_v<T, int8_t>) k_scale[i] = row_scale<D>(k);
      R kv[kChunks];
      for (int64_t c = 0; c < kChunks; ++c) kv[c] = load(k + c * kW);
      for (int64_t j = 0; j < s.per_kv; ++j) {
        const float* qj = q_scaled + j * D;
        R a0 = mul(load(qj), kv[0]);
        if constexpr (kChunks > 1) {  // two chains: half the FMA latency a token
          R a1 = mul(load(qj + kW), kv[1]);
          for (int64_t c = 2; c < kChunks; c += 2) {
            a0 = fmadd(load(qj + c * kW), kv[c], a0);
            a1 = fmadd(load(qj + (c + 1) * kW), kv[c + 1], a1);
          }
          a0 = add(a0, a1);
        }
        partial[j][i] = fold(a0);
      }
    });
    for (int64_t j = 0; j < s.per_kv; ++j) {
      for (int64_t i = n; i < 8; ++i) partial[j][i] = _mm256_setzero_ps();
      __m256 sums = sum8(partial[j]);
      if constexpr (std::is_same_v<T, int8_t>) sums = _mm256_mul_ps(sums, _mm256_load_ps(k_scale));
      _mm256_storeu_ps(scores + j * stride + t0, sums);  // stride: a multiple of 8
    }
  }
}

// out_j = sum_t p_j[t] v_t for kH heads j0 .. j0 + kH - 1, columns in slices of up to 4 registers: each V row
// is read once a slice for kH heads, and their accumulators (every bound a constant) stay in registers.
template <int64_t D, typename T, int kH>
void weigh_heads(const float* probs, int64_t stride, const T* v_cache, const int32_t* table, int64_t len,
                 const Shape& s, int64_t g, int64_t j0, const float* inv_sum, float* out,
                 const BlockFetcher<T>& fetch) {
  constexpr int64_t kChunks = D / kW;
  constexpr int64_t kSlice = kChunks < 4 ? kChunks : 4;
  for (int64_t c0 = 0; c0 < kChunks; c0 += kSlice) {
    R acc[kH][kSlice];
    _Pragma("GCC unroll 4") for (int j = 0; j < kH; ++j)
      _Pragma("GCC unroll 4") for (int64_t c = 0; c < kSlice; ++c) acc[j][c] = zero();
    for (int64_t start = 0; start < len; start += s.block_size) {
      if (c0 == 0 && j0 == 0) fetch.reached(true, start / s.block_size);
      const T* vb = v_cache + table[start / s.block_size] * s.block_size * s.row_stride + g * s.head_stride + c0 * kW;
      const float* pb = probs + j0 * stride + start;
      const int64_t n = std::min(s.block_size, len - start);
      for (int64_t i = 0; i < n; ++i) {
        const T* v = vb + i * s.row_stride;
        R p[kH];  // kH weights, then one V register at a time: kH * (kSlice + 1) + 1 registers
        if constexpr (std::is_same_v<T, int8_t>) {  // an int8 row's scale joins each head's weight
          const float v_scale = row_scale<D>(v - c0 * kW);
          _Pragma("GCC unroll 4") for (int j = 0; j < kH; ++j) p[j] = broadcast(pb[j * stride + i] * v_scale);
        } else {
          _Pragma("GCC unroll 4") for (int j = 0; j < kH; ++j) p[j] = broadcast(pb[j * stride + i]);
        }
        _Pragma("GCC unroll 4") for (int64_t c = 0; c < kSlice; ++c) {
          const R vc = load(v + c * kW);
          _Pragma("GCC unroll 4") for (int j = 0; j < kH; ++j) acc[j][c] = fmadd(p[j], vc, acc[j][c]);
        }
      }
    }
    _Pragma("GCC unroll 4") for (int j = 0; j < kH; ++j) {
      const R scale = broadcast(inv_sum[j0 + j]);
      _Pragma("GCC unroll 4") for (int64_t c = 0; c < kSlice; ++c)
        store(out + (j0 + j) * D + (c0 + c) * kW, mul(acc[j][c], scale));
    }
  }
}

// All the group's heads, kHeadsAtOnce at a time.
template <int64_t D, typename T>
void weigh_values(const float* probs, int64_t stride, const T* v_cache, const int32_t* table, int64_t len,
                  const Shape& s, int64_t g, const float* inv_sum, float* out, const BlockFetcher<T>& fetch) {
  int64_t j0 = 0;
  for (; j0 + kHeadsAtOnce <= s.per_kv; j0 += kHeadsAtOnce)
    weigh_heads<D, T, kHeadsAtOnce>(probs, stride, v_cache, table, len, s, g, j0, inv_sum, out, fetch);
  switch (s.per_kv - j0) {  // fewer than kHeadsAtOnce left
    case 3: weigh_heads<D, T, 3>(probs, stride, v_cache, table, len, s, g, j0, inv_sum, out, fetch); break;
    case 2: weigh_heads<D, T, 2>(probs, stride, v_cache, table, len, s, g, j0, inv_sum, out, fetch); break;
    case 1: weigh_heads<D, T, 1>(probs, stride, v_cache, table, len, s, g, j0, inv_sum, out, fetch); break;
    default: break;
  }
}
