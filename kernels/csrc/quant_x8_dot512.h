// quant_x8_dot.h's inner loops on 512-bit vectors, for CPUs with AVX-512 VNNI: two neighbouring groups
// of 8 weight rows side by side in one register (group g in the low half, g + 1 in the high), so every
// instruction does the work of two. dpbusd runs as many 512-bit as 256-bit instructions a cycle on the
// Xeons that have it (2 a cycle on an Emerald Rapids core), so from batch ~4, where the 256-bit kernel is
// bound by instructions, a step's matrices take ~half the time. The same integer sums and the same float
// work per row as the 256-bit loops: bit-identical outputs. Included after quant_x8_dot.h, in the same
// namespace (x8_pair_groups leaves a group without its partner to x8_groups), under `#pragma GCC target`
// with avx512f/bw/vl/vnni. A block of group g + 1 lies `partner` bytes after group g's: a group's length in x8,
// one block (160 bytes, Q8_0 272) in x8p, where the pair's blocks alternate (X8Layout).

inline __m512i load_pair(const uint8_t* g0, int64_t partner) {  // 32 bytes of group g and of g + 1
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g0));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g0 + partner));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

inline __m512 load_pair_halves(const uint8_t* g0, int64_t partner) {  // 8 fp16 of each group -> 16 fp32
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g0));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g0 + partner));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

// One (pair, block) unpacked as dpbusd takes it: q[k] holds values 4k .. 4k+3 of each of the 16 rows; d, and m
// (Q4_1) or offset (Q8_0: 128 * the block's sum of weights, a row a lane, taken back off x + 128's sums).
struct PairBlock {
  __m512i q[8];
  __m512 d, m;
  __m512i offset;
};

// Always inlined, as are the two below: out of line, the unpacked block went through the stack and decode's
// matrices ran ~10% slower.
template <bool kQ4_1>
__attribute__((always_inline)) inline void unpack_pair_block(const uint8_t* blk, int64_t partner, PairBlock& w) {
  w.d = load_pair_halves(blk, partner);
  w.m = _mm512_setzero_ps();
  w.offset = _mm512_setzero_si512();
  if constexpr (kQ4_1) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    w.m = load_pair_halves(blk + 16, partner);
    for (int k = 0; k < 4; ++k) {
      const __m512i packed = load_pair(blk + 32 + 32 * k, partner);
      w.q[2 * k] = _mm512_and_si512(packed, low);
      w.q[2 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    }
  } else {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int k = 0; k < 8; ++k) {
      w.q[k] = load_pair(blk + 16 + 32 * k, partner);
      w.offset = _mm512_dpbusd_epi32(w.offset, ones, w.q[k]);
    }
    w.offset = _mm512_slli_epi32(w.offset, 7);
  }
}

// A pair is a few KB, too short a stream (x8: two streams) for the hardware prefetcher to catch before it ends:
// each block fetches its counterpart in the next pair (x8p, measured: 2 threads from DRAM ~46 -> ~50 GB/s, 1
// thread ~35 -> ~40).
template <bool kQ4_1>
__attribute__((always_inline)) inline void prefetch_pair_block(const uint8_t* next, int64_t b, int64_t partner,
                                                               int64_t block_stride) {
  constexpr int64_t kBytes = kQ4_1 ? 160 : 272;
  const uint8_t* blk = next + b * block_stride;
  prefetch_block<kBytes>(blk);  // x8p: the two halves of one run
  prefetch_block<kBytes>(blk + partner);
}

// acc[r] += block b's share of y[m0 + r, the pair's 16 rows]. Q4_1: the weights' 4-bit values are the
// unsigned side of dpbusd, x the signed. Q8_0: both are signed, so x + 128 (xu: x.q with its sign bits
// flipped) is the unsigned side and w.offset is taken back off.
// The rows' integer sums are built side by side, each step k adding values 4k .. 4k+3 to every row's sum: a row's
// 8 dpbusd form one chain (~5 cycles each), and from 4 rows the other rows' steps fill its waits. Row after row,
// each in two chains of 4 joined by an add (the loop before), took a zeroed register and an add more a row and
// block: gate_up at 8 rows alone 1.08-1.28x slower (this VM's Emerald Rapids, one thread, weights in L2). Below 4
// rows a row keeps two chains (one alone waits on each result: 1 row 6% slower). The sums are integers, so the
// order of their additions does not change them: the same bits.
template <int R, bool kQ4_1>
__attribute__((always_inline)) inline void pair_block_rows(const PairBlock& w, const tandem_quant::QuantizedX& x,
                                                           const uint8_t* xu, int64_t m0, int64_t nb, int64_t b,
                                                           __m512 (&acc)[R]) {
  constexpr int kChains = R >= 4 ? 1 : 2;  // integer sums a row
  const uint8_t* x0 = (kQ4_1 ? reinterpret_cast<const uint8_t*>(x.q.data()) : xu) + (m0 * nb + b) * 32;
  const int64_t row_bytes = nb * 32;  // from a row of x's block b to the next row's
  __m512i sums[R][kChains];
  _Pragma("GCC unroll 8") for (int k = 0; k < 8; ++k) {  // q[k] holds values 4k .. 4k+3 of each weight row
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {  // every bound a constant: sums[] stays in registers
      int32_t xk;
      __builtin_memcpy(&xk, x0 + r * row_bytes + 4 * k, 4);
      __m512i& sum = sums[r][k % kChains];
      const __m512i before = k < kChains ? _mm512_setzero_si512() : sum;
      if constexpr (kQ4_1) sum = _mm512_dpbusd_epi32(before, w.q[k], _mm512_set1_epi32(xk));
      else sum = _mm512_dpbusd_epi32(before, _mm512_set1_epi32(xk), w.q[k]);
    }
  }
  const __m512 d = w.d, m = w.m;
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
    const int64_t i = (m0 + r) * nb + b;
    __m512i sum32 = sums[r][0];
    if constexpr (kChains == 2) sum32 = _mm512_add_epi32(sum32, sums[r][1]);
    if constexpr (!kQ4_1) sum32 = _mm512_sub_epi32(sum32, w.offset);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum32), _mm512_mul_ps(d, _mm512_set1_ps(x.scale[i])), acc[r]);
    if constexpr (kQ4_1) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sum[i]), acc[r]);
  }
}

// y[r, the pair's 16 rows] for R rows of quantized x starting at m0, unpacking each block of the pair as it
// goes (one tile of rows: decode). `next` (or null): the pair to come, prefetched alongside.
template <int R, bool kQ4_1>
inline void pair_dot_rows(const tandem_quant::QuantizedX& x, const uint8_t* xu, int64_t m0, int64_t nb,
                          const uint8_t* pair, int64_t partner, int64_t block_stride, float* y, int64_t ldy,
                          const uint8_t* next) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (next != nullptr) prefetch_pair_block<kQ4_1>(next, b, partner, block_stride);
    PairBlock w;
    unpack_pair_block<kQ4_1>(pair + b * block_stride, partner, w);
    pair_block_rows<R, kQ4_1>(w, x, xu, m0, nb, b, acc);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// The same from a pair unpacked once into `blocks` (nb of them): with many tiles of rows (prefill), each
// block's unpacking (loads, shifts, masks: ~1/6 of a tile's vector work) is done once, not once a tile.
template <int R, bool kQ4_1>
inline void unpacked_pair_dot_rows(const tandem_quant::QuantizedX& x, const uint8_t* xu, int64_t m0, int64_t nb,
                                   const PairBlock* blocks, float* y, int64_t ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) pair_block_rows<R, kQ4_1>(blocks[b], x, xu, m0, nb, b, acc);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// Groups [g0, g1): pairs on 512-bit vectors; a group without its partner in the range (x8p: a cut between
// threads inside a pair, or the matrix's odd last group; x8: an odd one left over) on quant_x8_dot.h's 256-bit
// loop. `pairs`: the x8p layout.
template <bool kQ4_1>
inline void x8_pair_groups(const tandem_quant::QuantizedX& x, int64_t M, int64_t nb, const uint8_t* w, int64_t g0,
                           int64_t g1, const GroupOutput& y, int64_t N, bool pairs) {
  constexpr int64_t kBytes = kQ4_1 ? 160 : 272;
  const X8Layout layout{nb, N / 8, kBytes, pairs};
  const int64_t partner = layout.partner(), block_stride = layout.pair_stride();
  std::vector<uint8_t> xu;  // Q8_0: x + 128 as unsigned bytes (the sign bit flipped)
  if constexpr (!kQ4_1) {
    xu.resize(x.q.size());
    for (size_t j = 0; j < xu.size(); ++j) xu[j] = static_cast<uint8_t>(x.q[j]) ^ 0x80;
  }
  // Measured: 6-11% faster from 40 rows (prefill chunks), ~10% slower at 24 and no faster at 16 (decode).
  const bool unpack_once = M > 4 * kRowTile;
  // 64-byte aligned (std::vector does not promise it for PairBlock here): the unpacked blocks are read with
  // aligned loads. sizeof(PairBlock) is a multiple of 64, as aligned_alloc requires.
  const size_t bytes = unpack_once ? static_cast<size_t>(nb) * sizeof(PairBlock) : 0;
  const std::unique_ptr<PairBlock[], decltype(&std::free)> blocks(
      static_cast<PairBlock*>(bytes ? std::aligned_alloc(64, bytes) : nullptr), &std::free);
  TORCH_CHECK(!unpack_once || blocks, "out of memory for ", bytes, " bytes of unpacked weights");
  const std::pair<int64_t, int64_t> span = layout.whole_pairs(g0, g1);
  if (span.first > g0) x8_groups<kQ4_1>(x, M, nb, w, g0, span.first, y, N, pairs);
  for (int64_t g = span.first; g < span.second; g += 2) {
    const uint8_t* pair = w + layout.offset(g, 0);
    const uint8_t* next = g + 4 <= g1 ? w + layout.offset(g + 2, 0) : nullptr;
    float* yg = y.group(g);
    if (unpack_once)
      for (int64_t b = 0; b < nb; ++b) {
        if (next != nullptr) prefetch_pair_block<kQ4_1>(next, b, partner, block_stride);
        unpack_pair_block<kQ4_1>(pair + b * block_stride, partner, blocks[b]);
      }
    int64_t m = 0;
    auto rows = [&](auto tile) {
      constexpr int T = decltype(tile)::value;
      if (unpack_once) {
        unpacked_pair_dot_rows<T, kQ4_1>(x, xu.data(), m, nb, blocks.get(), yg + m * y.ld, y.ld);
      } else {
        pair_dot_rows<T, kQ4_1>(x, xu.data(), m, nb, pair, partner, block_stride, yg + m * y.ld, y.ld, next);
        next = nullptr;  // the first tile fetches the next pair; later tiles find this one in cache
      }
      m += T;
    };
    while (m + kRowTile <= M) rows(std::integral_constant<int, kRowTile>{});
    switch (M - m) {
      case 7: rows(std::integral_constant<int, 7>{}); break;
      case 6: rows(std::integral_constant<int, 6>{}); break;
      case 5: rows(std::integral_constant<int, 5>{}); break;
      case 4: rows(std::integral_constant<int, 4>{}); break;
      case 3: rows(std::integral_constant<int, 3>{}); break;
      case 2: rows(std::integral_constant<int, 2>{}); break;
      case 1: rows(std::integral_constant<int, 1>{}); break;
      default: break;
    }
  }
  if (span.second < g1) x8_groups<kQ4_1>(x, M, nb, w, span.second, g1, y, N, pairs);
}
