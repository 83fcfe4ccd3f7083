// quant_x8_dot512.h's pairs of groups multiplied on AMX tiles, for Xeons with AMX-INT8 (Sapphire Rapids and later)
// whose OS grants the tile state (cpu_isa.cpp asks once), from amx_min_rows() rows of x (32: cpu_isa.cpp says why
// not fewer). There the 512-bit loops are bound by their instructions: each (block, pair, row of x) takes 8 dpbusd
// and 8 broadcasts for its integer sum, and 5 more for its float work. Here one tile multiply does a block's
// integer sums for the pair's 16 weight rows and up to 16 rows of x at once, and only the float work stays on vectors
// (the same instructions as pair_block_rows', in the same order, on the same int32 sums: bit-identical outputs).
// As llama.cpp's AMX path does, a block's sums go through memory (a tile store) to meet their scales: the GGUF's
// scales are per 32 values, so sums cannot accumulate across blocks in the tile. That round trip and the tile loads
// cost ~20 ns a block on this VM's Emerald Rapids, so even alone a matrix gains on tiles only from 9 rows.
//
// Tiles: A = R rows of x's int8 values of block b (32 bytes a row, rows nb * 32 bytes apart); B = the pair's
// unpacked block as unpack_pair_block leaves it (q[k]: values 4k .. 4k+3 of the 16 weight rows, which is the
// layout a tile multiply takes B in: 8 rows of 16 x 4 bytes); C = R x 16 int32. Q4_1's 4-bit values are unsigned
// (dpbsud: x signed, w unsigned); Q8_0's are signed (dpbssd), so no offset is taken back off.
// Included in quant_linear_x8_cpu.cpp's avx512_vnni namespace after quant_x8_dot512.h, under `#pragma GCC target`
// with amx-tile and amx-int8 added.

// Palette 1's configuration of two sets of three tiles, for R rows of x: C (tmm0, tmm3), A (tmm1, tmm4), B (tmm2,
// tmm5).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles(int R) {
  TileConfig config;
  for (int set = 0; set < 2; ++set) {
    const int c = 3 * set;
    config.rows[c] = static_cast<uint8_t>(R), config.colsb[c] = 64;          // C: R rows of 16 int32
    config.rows[c + 1] = static_cast<uint8_t>(R), config.colsb[c + 1] = 32;  // A: R rows of a block's 32 int8
    config.rows[c + 2] = 8, config.colsb[c + 2] = 64;                         // B: 8 rows of 16 weight rows x 4
  }
  _tile_loadconfig(&config);
}

// A block's integer sums on tile set kSet: its unpacked weights (`unpacked`, 8 rows of 64 bytes) into B, x's R rows of
// the block (`xa`, rows `lda` bytes apart) into A, their products into `sums` (16 int32 a row).
template <int kSet, bool kQ4_1>
__attribute__((always_inline)) inline void tile_block_sums(const uint8_t* unpacked, const int8_t* xa, int64_t lda,
                                                           int32_t* sums) {
  // GCC's tile intrinsics are macros that paste the register's number into the assembly: literals only.
#define TANDEM_TILE_SUMS(C, A, B)                   \
  _tile_loadd(B, unpacked, 64);                     \
  _tile_loadd(A, xa, lda);                          \
  _tile_zero(C);                                    \
  if constexpr (kQ4_1) _tile_dpbsud(C, A, B);       \
  else _tile_dpbssd(C, A, B);                       \
  _tile_stored(C, sums, 64);
  if constexpr (kSet == 0) {
    TANDEM_TILE_SUMS(0, 1, 2)
  } else {
    TANDEM_TILE_SUMS(3, 4, 5)
  }
#undef TANDEM_TILE_SUMS
}

// acc[r] += block b's share of y[m0 + r, the pair's 16 rows] from its int32 sums (`sums`, 16 a row):
// pair_block_rows' float work on the same sums.
template <int R, bool kQ4_1>
__attribute__((always_inline)) inline void scale_tile_sums(const int32_t* sums, __m512 d, __m512 m,
                                                           const tandem_quant::QuantizedX& x, int64_t m0, int64_t nb,
                                                           int64_t b, __m512 (&acc)[R]) {
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
    const int64_t i = (m0 + r) * nb + b;
    const __m512i sum32 = _mm512_load_si512(sums + 16 * r);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum32), _mm512_mul_ps(d, _mm512_set1_ps(x.scale[i])), acc[r]);
    if constexpr (kQ4_1) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sum[i]), acc[r]);
  }
}

// Blocks unpacked, multiplied and scaled a run at a time. A tile load of bytes just written by vector stores waits
// for them to reach L1 (no forwarding), and so do vector loads of a tile's stored sums: each block unpacked,
// multiplied and scaled in turn ran no faster than the 512-bit loops at batch 8 (and a pair unpacked whole before
// its tiles, slower still: 1.2x them at 16 rows). So kTileRun blocks are unpacked, then multiplied by each tile of
// rows, then scaled, every phase reading what the one before wrote a run's work earlier (~4 KB of weights and up to
// 8 KB of sums a run, in L1).
constexpr int64_t kTileRun = 8;

// A run's blocks unpacked (8 rows of 64 bytes each, as B takes them) with their scales.
struct UnpackedRun {
  alignas(64) uint8_t q[kTileRun][512];
  __m512 d[kTileRun], m[kTileRun];
};

template <bool kQ4_1>
__attribute__((always_inline)) inline void unpack_run(const uint8_t* pair, int64_t b0, int64_t n, int64_t partner,
                                                      int64_t block_stride, const uint8_t* next, UnpackedRun& out) {
  for (int64_t j = 0; j < n; ++j) {
    if (next != nullptr) prefetch_pair_block<kQ4_1>(next, b0 + j, partner, block_stride);
    PairBlock w;
    unpack_pair_block<kQ4_1>(pair + (b0 + j) * block_stride, partner, w);
    for (int k = 0; k < 8; ++k) _mm512_store_si512(out.q[j] + 64 * k, w.q[k]);
    out.d[j] = w.d, out.m[j] = w.m;
  }
}

// acc (R rows of 16 floats) += the run's blocks b0 .. b0 + n - 1 for rows m0 .. m0 + R - 1, on tiles configured for
// R rows.
template <int R, bool kQ4_1>
inline void tile_run(const tandem_quant::QuantizedX& x, int64_t m0, int64_t nb, int64_t b0, int64_t n,
                     const UnpackedRun& run, float* acc_rows) {
  alignas(64) int32_t sums[kTileRun][16 * R];
  const int8_t* xq = x.q.data() + m0 * nb * 32 + b0 * 32;
  const int64_t lda = nb * 32;
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {  // tile registers are not renamed: two sets, so that one multiply need not wait
    tile_block_sums<0, kQ4_1>(run.q[j], xq + j * 32, lda, sums[j]);
    tile_block_sums<1, kQ4_1>(run.q[j + 1], xq + (j + 1) * 32, lda, sums[j + 1]);
  }
  if (j < n) tile_block_sums<0, kQ4_1>(run.q[j], xq + j * 32, lda, sums[j]);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_load_ps(acc_rows + 16 * r);
  for (j = 0; j < n; ++j) scale_tile_sums<R, kQ4_1>(sums[j], run.d[j], run.m[j], x, m0, nb, b0 + j, acc);
  for (int r = 0; r < R; ++r) _mm512_store_ps(acc_rows + 16 * r, acc[r]);
}

template <bool kQ4_1>
inline void tile_run_of(int R, const tandem_quant::QuantizedX& x, int64_t m0, int64_t nb, int64_t b0, int64_t n,
                        const UnpackedRun& run, float* acc_rows) {
  switch (R) {
#define TANDEM_TILE_ROWS(T) \
  case T: tile_run<T, kQ4_1>(x, m0, nb, b0, n, run, acc_rows); break;
    TANDEM_TILE_ROWS(1) TANDEM_TILE_ROWS(2) TANDEM_TILE_ROWS(3) TANDEM_TILE_ROWS(4)
    TANDEM_TILE_ROWS(5) TANDEM_TILE_ROWS(6) TANDEM_TILE_ROWS(7) TANDEM_TILE_ROWS(8)
    TANDEM_TILE_ROWS(9) TANDEM_TILE_ROWS(10) TANDEM_TILE_ROWS(11) TANDEM_TILE_ROWS(12)
    TANDEM_TILE_ROWS(13) TANDEM_TILE_ROWS(14) TANDEM_TILE_ROWS(15) TANDEM_TILE_ROWS(16)
#undef TANDEM_TILE_ROWS
    default: TORCH_CHECK(false, "a tile holds 1 to 16 rows, not ", R);
  }
}

// x8_pair_groups on tiles: the same groups, the same cuts, the same bits. The rows of x go in tiles of at most 16,
// as even as can be (24 rows: two of 12, not 16 and 8, where the 8 would cost a 16's tile work): `big` tiles of R
// rows, then tiles of R - 1. Reconfiguring the tiles costs ~100 ns, so each size runs over all the pairs at once;
// each run of a pair's blocks is unpacked once for all that size's tiles, whose sums gather in `acc` (16 floats a
// row of x). The tiles are released at the end (a thread holding tile state costs every context switch ~8 KB more).
//
// An output of kStreamedOutputBytes or more (prefill chunks) is written with non-temporal stores: y's rows are y.ld
// floats apart, and each pair writes one 64-byte line of every row, so with y.ld a multiple of 1,024 (gate_up: 3,072)
// all of a tile's lines fall in one L1 set, where plain stores, each reading its line first, evict one another (the
// likely cause: this VM has no counters to show it). gate_up of 352 rows alone, alternated with plain stores: 0.83x
// (0.75-0.87); a 500-token prefill 0.95x (0.91-1.00), 350 tokens 0.98x. Below it (decode batches: 48 rows of gate_up
// are 590 KB) y stays in cache for the op that reads it next. A line that is not whole (x8's pairs may start at an
// odd group) is stored plainly.
template <bool kQ4_1>
inline void x8_pair_groups_amx(const tandem_quant::QuantizedX& x, int64_t M, int64_t nb, const uint8_t* w,
                               int64_t g0, int64_t g1, const GroupOutput& y, int64_t N, bool pairs) {
  constexpr int64_t kBytes = kQ4_1 ? 160 : 272;
  const X8Layout layout{nb, N / 8, kBytes, pairs};
  const int64_t partner = layout.partner(), block_stride = layout.pair_stride();
  const auto [first_pair, end] = layout.whole_pairs(g0, g1);
  if (first_pair > g0) x8_groups<kQ4_1>(x, M, nb, w, g0, first_pair, y, N, pairs);
  if (first_pair < end) {
    thread_local std::vector<float> acc_buffer;  // a thread's own, grown to the most rows seen
    acc_buffer.resize(static_cast<size_t>(M) * 16 + 16);
    float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(acc_buffer.data()) + 63) & ~uintptr_t{63});
    const int64_t tiles = (M + 15) / 16, R = (M + tiles - 1) / tiles, big = M - tiles * (R - 1);
    const std::pair<int64_t, int64_t> sizes[2] = {{R, big}, {R - 1, tiles - big}};  // (rows, tiles of them)
    const bool stream = M * y.ld * static_cast<int64_t>(sizeof(float)) >= kStreamedOutputBytes;
    int64_t m0 = 0;
    UnpackedRun run;
    for (const auto& [rows, count] : sizes) {
      if (count == 0 || rows == 0) continue;
      configure_tiles(static_cast<int>(rows));
      for (int64_t p = first_pair; p < end; p += 2) {
        const uint8_t* pair = w + layout.offset(p, 0);
        const uint8_t* next = m0 == 0 && p + 4 <= g1 ? w + layout.offset(p + 2, 0) : nullptr;
        std::fill(acc, acc + count * rows * 16, 0.f);
        for (int64_t b0 = 0; b0 < nb; b0 += kTileRun) {
          const int64_t n = nb - b0 < kTileRun ? nb - b0 : kTileRun;
          unpack_run<kQ4_1>(pair, b0, n, partner, block_stride, next, run);
          for (int64_t t = 0; t < count; ++t)
            tile_run_of<kQ4_1>(static_cast<int>(rows), x, m0 + t * rows, nb, b0, n, run, acc + t * rows * 16);
        }
        for (int64_t r = 0; r < count * rows; ++r) {
          float* out = y.group(p) + (m0 + r) * y.ld;
          const __m512 row = _mm512_load_ps(acc + 16 * r);
          if (stream && (reinterpret_cast<uintptr_t>(out) & 63) == 0) _mm512_stream_ps(out, row);
          else _mm512_storeu_ps(out, row);
        }
      }
      m0 += count * rows;
    }
    _tile_release();
    if (stream) _mm_sfence();  // non-temporal stores are weakly ordered: visible before the threads join
  }
  if (end < g1) x8_groups<kQ4_1>(x, M, nb, w, end, g1, y, N, pairs);
}
