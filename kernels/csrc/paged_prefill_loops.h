// paged_prefill_cpu.cpp's loops over one item, written once over a vector type and included in two namespaces:
// avx2 (8 lanes) and avx512 (16 lanes, built under `#pragma GCC target`). A group of rows is kW rows, one a lane,
// so the 512-bit loops do each score and each weighted value of 16 rows in one instruction where the 256-bit ones
// take two. Every lane's arithmetic is the same in either (the same FMAs over d and over keys in the same order,
// the same exp: vec512_exp.h), so both give the same bits.
// The namespace defines, before including: R (the register type), Mask (a compare's result), kW (lanes in R),
// kScoreGroups (groups of rows scored at once), and
// load / store / zero / set1 / bcast (a float at an address into every lane) / fmadd / mul / add / sub / max / min /
// iota (0, 1, ..., kW - 1) / le / gt (compares) / select(mask, if_false, if_true) / keep(a, mask) (a's lanes where
// set, else +0) / any(mask) / exp (at::vec's exp_u20 a lane).

// Scores of G groups of kW rows (their transposed queries one after another, D * kW floats apart) against a
// block's kKeys keys, rows in lanes: s[g][t] = sum_d q[d] k_t[d] (G * kKeys accumulators; each d loads the groups'
// query values and broadcasts each key's once for all G). One group at a time took a broadcast load a multiply
// (8 keys, 8 FMAs, 9 loads a d); three at once, 24 FMAs for 11 loads. Each lane adds over d in the same order
// whatever G: the same bits.
template <int64_t D, int G>
inline void scores(const float* qt, const float* kb, R (&s)[G][kKeys]) {
  for (int g = 0; g < G; ++g)
    for (int64_t t = 0; t < kKeys; ++t) s[g][t] = zero();
  for (int64_t d = 0; d < D; ++d) {
    R q[G];
    for (int g = 0; g < G; ++g) q[g] = load(qt + g * D * kW + d * kW);
    for (int64_t t = 0; t < kKeys; ++t) {
      const R k = bcast(kb + t * D + d);
      for (int g = 0; g < G; ++g) s[g][t] = fmadd(k, q[g], s[g][t]);
    }
  }
}

// o[r] += sum_t p[t][r] v_t for kW rows at once: kW independent FMA chains, each key's kW values loaded once for
// the rows (one chain a row would wait on the FMA latency at every key).
template <int64_t D>
inline void weigh(const float* p, const float* vb, float* o) {
  for (int64_t d = 0; d < D; d += kW) {
    R acc[kW];
    for (int r = 0; r < kW; ++r) acc[r] = load(o + r * D + d);
    for (int64_t t = 0; t < kKeys; ++t) {
      const R v = load(vb + t * D + d);
      for (int r = 0; r < kW; ++r) acc[r] = fmadd(bcast(p + t * kW + r), v, acc[r]);
    }
    for (int r = 0; r < kW; ++r) store(o + r * D + d, acc[r]);
  }
}

// One item: queries [i0, i1) of a sequence (its block table at `table`, `ctx` tokens before its first query) for
// the KV head g's per_kv query heads; q's token rows lie q_row floats apart (a view of QKV's rows: no copy), out's
// are packed. Rows go kW to a group (lanes of the scores and of the softmax state); a group's rows are one head's
// queries i0 + kW h .. i0 + kW h + kW - 1 (rows past i1 compute and are never written).
template <int64_t D, typename T>
void attend_item(const float* q, int64_t q_row, const T* k_cache, const T* v_cache, const int32_t* table,
                 int64_t block_size, int64_t row_stride, int64_t g, int64_t num_heads, int64_t per_kv, int64_t q_start,
                 int64_t ctx, int64_t i0, int64_t i1, float scale, float* out, Scratch& sc) {
  static_assert(kQueries % kW == 0 && D % kW == 0, "whole groups of rows, whole registers of a row");
  constexpr int64_t kGroupsPerHead = kQueries / kW;
  const int64_t rows = per_kv * kQueries, groups = rows / kW, n = i1 - i0;
  const int64_t last_key = ctx + i1 - 1;  // the item's last query sees keys up to here
  sc.qt.assign(rows * D, 0.f);
  sc.o.assign(rows * D, 0.f);
  sc.p.resize(groups * kKeys * kW);
  sc.kb.resize(kKeys * D);
  sc.vb.resize(kKeys * D);
  sc.m.assign(rows, -1e30f);  // finite: exp(m_old - m_new) is then 0, not NaN, at the first block
  sc.l.assign(rows, 0.f);
  for (int64_t j = 0; j < per_kv; ++j)
    for (int64_t i = 0; i < n; ++i) {
      const float* src = q + (q_start + i0 + i) * q_row + (g * per_kv + j) * D;
      const int64_t r = j * kQueries + i;
      float* dst = sc.qt.data() + (r / kW) * D * kW + r % kW;  // [group][d][lane]
      for (int64_t d = 0; d < D; ++d) dst[d * kW] = src[d] * scale;
    }
  const int64_t col = g * head_row<T>(D);
  const R minus_inf = set1(-std::numeric_limits<float>::infinity()), one = set1(1.f);
  for (int64_t k0 = 0; k0 <= last_key; k0 += kKeys) {
    const int64_t nk = std::min<int64_t>(kKeys, last_key + 1 - k0);
    for (int64_t t = 0; t < kKeys; ++t) {
      if (t < nk) {
        const int64_t pos = k0 + t;
        const int64_t slot = static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
        widen_row<D, T>(k_cache + slot * row_stride + col, sc.kb.data() + t * D);
        widen_row<D, T>(v_cache + slot * row_stride + col, sc.vb.data() + t * D);
      } else {
        std::fill_n(sc.kb.data() + t * D, D, 0.f);
        std::fill_n(sc.vb.data() + t * D, D, 0.f);
      }
    }
    // A group's scores (lanes: its rows) into its softmax state and weighted values.
    const auto attend_block = [&](int64_t grp, const R (&s)[kKeys]) {
      // Each lane's query position; a row past the item's queries sees every key of the item (harmless, unused).
      const int64_t first = ctx + i0 + (grp % kGroupsPerHead) * kW;
      const R position = min(add(set1(static_cast<float>(first)), iota()), set1(static_cast<float>(last_key)));
      Mask seen[kKeys];
      R top = minus_inf;
      for (int64_t t = 0; t < kKeys; ++t) {
        const float key = static_cast<float>(t < nk ? k0 + t : last_key + 1);  // padding keys: seen by none
        seen[t] = le(set1(key), position);
        top = max(top, select(seen[t], minus_inf, s[t]));
      }
      float* m = sc.m.data() + grp * kW;
      const R m_old = load(m), m_new = max(m_old, top);
      const Mask rose = gt(m_new, m_old);  // alpha exactly 1 where the max stayed
      const R alpha = select(rose, one, exp(sub(m_old, m_new)));
      R sum = zero();
      float* p = sc.p.data() + grp * kKeys * kW;
      for (int64_t t = 0; t < kKeys; ++t) {  // unseen lanes zeroed after the exp, whatever it made
        const R e = keep(exp(sub(s[t], m_new)), seen[t]);
        store(p + t * kW, e);
        sum = add(sum, e);
      }
      float* l = sc.l.data() + grp * kW;
      store(l, fmadd(load(l), alpha, sum));
      store(m, m_new);
      // Rows whose max rose scale what they hold by alpha before this block adds to it.
      if (any(rose)) {
        alignas(64) float a[kW];
        store(a, alpha);
        for (int r = 0; r < kW; ++r) {
          if (a[r] == 1.f) continue;
          float* o = sc.o.data() + (grp * kW + r) * D;
          const R ar = set1(a[r]);
          for (int64_t d = 0; d < D; d += kW) store(o + d, mul(load(o + d), ar));
        }
      }
      weigh<D>(p, sc.vb.data(), sc.o.data() + grp * kW * D);
    };
    int64_t grp = 0;
    for (; grp + kScoreGroups <= groups; grp += kScoreGroups) {
      R s[kScoreGroups][kKeys];
      scores<D, kScoreGroups>(sc.qt.data() + grp * D * kW, sc.kb.data(), s);
      for (int g = 0; g < kScoreGroups; ++g) attend_block(grp + g, s[g]);
    }
    for (; grp < groups; ++grp) {
      R s[1][kKeys];
      scores<D, 1>(sc.qt.data() + grp * D * kW, sc.kb.data(), s);
      attend_block(grp, s[0]);
    }
  }
  for (int64_t j = 0; j < per_kv; ++j)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = j * kQueries + i;
      const R inv = set1(1.f / sc.l[r]);  // l >= 1: the row's largest score adds exp(0)
      float* dst = out + ((q_start + i0 + i) * num_heads + g * per_kv + j) * D;
      for (int64_t d = 0; d < D; d += kW) store(dst + d, mul(load(sc.o.data() + r * D + d), inv));
    }
}
