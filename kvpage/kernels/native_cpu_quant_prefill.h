// kvpage native CPU kernels: prefill attention over quantized KV caches (native_cpu_quant.h
// has the formats, the code loaders and the overview). One work item per (sequence, KV head,
// tile of query rows), each 64-key chunk laid out once as fp32 K^T and V.

#pragma once

namespace {

// ---- Prefill --------------------------------------------------------------------------------

constexpr int64_t kQuantQueryTile = 16;  // query rows (tokens) per prefill item
constexpr int64_t kQuantKeys = 64;       // keys per chunk laid out and per softmax step

struct QuantPrefillScratch {
  std::vector<float> qf, acc, stats, alpha, kt, v, p, ks, vs;
};

// Query rows per register block of QK^T and P.V: kRows x 4 accumulators, kRows broadcasts
// and one loaded vector in the 32 (AVX-512) or 16 (AVX2) registers.
constexpr int kPrefillRows = kVecLanes == 16 ? 4 : 2;

// For t < count and each row r: o[r][c] += x[r][t] * y_t[c] (c < kVecs vectors of
// y_t = y + t * stride), each vector of y_t loaded once for the kPrefillRows rows.
template <int kVecs>
inline void quant_fma_rows(const float* const* x, int64_t count, const float* y, int64_t stride, Vec (*o)[4]) {
  constexpr int W = kVecLanes;
  for (int64_t t = 0; t < count; ++t) {
    const float* yt = y + t * stride;
    Vec b[kPrefillRows];
    for (int r = 0; r < kPrefillRows; ++r) b[r] = splat<W>(x[r][t]);
    for (int c = 0; c < kVecs; ++c) {
      const Vec yc = vload<W>(yt + c * W);
      for (int r = 0; r < kPrefillRows; ++r) o[r][c] = fmadd(b[r], yc, o[r][c]);
    }
  }
}

inline void quant_fma_rows_any(int64_t vecs, const float* const* x, int64_t count, const float* y, int64_t stride,
                               Vec (*o)[4]) {
  switch (vecs) {
    case 4: return quant_fma_rows<4>(x, count, y, stride, o);
    case 3: return quant_fma_rows<3>(x, count, y, stride, o);
    case 2: return quant_fma_rows<2>(x, count, y, stride, o);
    default: return quant_fma_rows<1>(x, count, y, stride, o);
  }
}

// s[r][0:keys) = query row q + r * D times K^T (kt[d][j], kQuantKeys floats per dim) for the
// kPrefillRows rows from q, into s + r * kQuantKeys; keys a multiple of W.
inline void quant_scores_rows(const float* q, const float* kt, int64_t D, int64_t keys, float* s) {
  constexpr int W = kVecLanes;
  const float* rows[kPrefillRows];
  for (int r = 0; r < kPrefillRows; ++r) rows[r] = q + r * D;
  for (int64_t j0 = 0; j0 < keys; j0 += 4 * W) {
    const int64_t vecs = std::min<int64_t>(4, (keys - j0) / W);
    Vec acc[kPrefillRows][4];
    for (int r = 0; r < kPrefillRows; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = vzero<W>();
    quant_fma_rows_any(vecs, rows, D, kt + j0, kQuantKeys, acc);
    for (int r = 0; r < kPrefillRows; ++r)
      for (int64_t c = 0; c < vecs; ++c) vstore(s + r * kQuantKeys + j0 + c * W, acc[r][c]);
  }
}

// acc[r] = acc[r] * alpha[r] + sum_{j < n} p[r][j] * V[j] for `rows` rows (acc rows D floats,
// p rows kQuantKeys, V rows D); kPrefillRows rows by up to 4 vectors of dims in registers
// (a last, short block repeats its last row, whose sums are not stored).
inline void quant_weighted_sum(float* acc, int64_t D, const float* p, const float* alpha, int64_t rows, int64_t n,
                               const float* v) {
  constexpr int W = kVecLanes;
  for (int64_t r0 = 0; r0 < rows; r0 += kPrefillRows) {
    const int64_t live = std::min<int64_t>(kPrefillRows, rows - r0);
    const float* prow[kPrefillRows];
    float* arow[kPrefillRows];
    Vec al[kPrefillRows];
    for (int r = 0; r < kPrefillRows; ++r) {
      const int64_t m = r0 + std::min<int64_t>(r, live - 1);
      prow[r] = p + m * kQuantKeys;
      arow[r] = acc + m * D;
      al[r] = splat<W>(alpha[m]);
    }
    for (int64_t d0 = 0; d0 < D; d0 += 4 * W) {
      const int64_t vecs = std::min<int64_t>(4, (D - d0) / W);
      Vec o[kPrefillRows][4];
      for (int r = 0; r < kPrefillRows; ++r)
        for (int64_t c = 0; c < 4; ++c) o[r][c] = c < vecs ? vmul(vload<W>(arow[r] + d0 + c * W), al[r]) : vzero<W>();
      quant_fma_rows_any(vecs, prow, n, v + d0, D, o);
      for (int r = 0; r < live; ++r)
        for (int64_t c = 0; c < vecs; ++c) vstore(arow[r] + d0 + c * W, o[r][c]);
    }
  }
}

// The chunk's keys j < keys (positions base + j; those past n zero) of the item's KV head: K^T
// into w.kt, V rows into w.v (codes in their unit, int4 dequantized), row scales into ks/vs.
template <int F>
void quant_lay_out_chunk(const PrefillArgs& a, const QuantLayout& L, const PrefillItem& it, const int32_t* table,
                         int64_t base, int64_t n, int64_t keys, QuantPrefillScratch& w) {
  constexpr int W = kVecLanes;
  const int64_t D = a.head_dim;
  const uint8_t* kb = static_cast<const uint8_t*>(a.key_cache);
  const uint8_t* vb = static_cast<const uint8_t*>(a.value_cache);
  alignas(64) float krow[W];
  for (int64_t j = 0; j < keys; ++j) {
    if (j >= n) {
      for (int64_t d = 0; d < D; ++d) w.kt[d * kQuantKeys + j] = 0.0f;
      std::memset(w.v.data() + j * D, 0, D * sizeof(float));
      w.ks[j] = w.vs[j] = 0.0f;
      continue;
    }
    const int64_t slot = token_slot(a, table, base + j);
    const int64_t co = L.codes_of(slot) + it.head * L.code_bytes, so = L.scales_of(slot) + it.head * L.scale_bytes;
    for (int64_t d0 = 0; d0 < D; d0 += W) {
      Vec x;
      row_chunks<W, F, 1>(kb + co, kb + so, d0, L.group, &x);
      vstore(krow, x);
      for (int e = 0; e < W; ++e) w.kt[(d0 + e) * kQuantKeys + j] = krow[e];
      row_chunks<W, F, 1>(vb + co, vb + so, d0, L.group, &x);
      vstore(w.v.data() + j * D + d0, x);
    }
    if constexpr (kRowScaled<F>) {
      w.ks[j] = row_scale<F>(kb + so);
      w.vs[j] = row_scale<F>(vb + so);
    }
  }
}

template <int T, int F>
void quant_prefill_item(const PrefillArgs& a, const QuantLayout& L, const PrefillItem& it, QuantPrefillScratch& w) {
  constexpr int W = kVecLanes;
  const int64_t D = a.head_dim, group = a.num_heads / a.num_kv_heads;
  const PrefillSpan span = prefill_span(a, it);
  const int64_t rows = it.rows * group;
  const int64_t padded = (rows + kPrefillRows - 1) / kPrefillRows * kPrefillRows;  // scores come in row blocks
  w.qf.assign(padded * D, 0.0f);
  w.acc.assign(rows * D, 0.0f);
  w.stats.resize(2 * rows);
  w.alpha.resize(rows);
  w.kt.resize(D * kQuantKeys);
  w.v.resize(kQuantKeys * D);
  w.p.resize(padded * kQuantKeys);
  w.ks.assign(kQuantKeys, 1.0f);
  w.vs.assign(kQuantKeys, 1.0f);
  for (int64_t m = 0; m < rows; ++m)
    load_scaled<T>(a.q, prefill_query_offset(a, it, span.q0, m), D, a.scale * kUnitInv<F>, w.qf.data() + m * D);
  reset_stats(w.stats.data(), rows, 2);
  for (int64_t base = span.k_lo / kQuantKeys * kQuantKeys; base <= span.hi_pos; base += kQuantKeys) {
    const int64_t n = std::min({kQuantKeys, span.seq_len - base, span.hi_pos - base + 1});  // keys a row may see
    const int64_t keys = (n + W - 1) / W * W;
    quant_lay_out_chunk<F>(a, L, it, span.table, base, n, keys, w);
    for (int64_t m = 0; m < padded; m += kPrefillRows)
      quant_scores_rows(w.qf.data() + m * D, w.kt.data(), D, keys, w.p.data() + m * kQuantKeys);
    for (int64_t m = 0; m < rows; ++m) {
      float* s = w.p.data() + m * kQuantKeys;
      const KeyRange seen = visible_keys(a, span.lo_pos + m / group, base, n);
      if (seen.empty()) {  // nothing visible in this chunk: the row is unchanged
        std::memset(s, 0, keys * sizeof(float));
        w.alpha[m] = 1.0f;
        continue;
      }
      if constexpr (kRowScaled<F>) multiply_rows(s, w.ks.data(), keys);
      if (a.softcap > 0)
        for (int64_t j = seen.first; j <= seen.last; ++j) s[j] = softcapped(s[j], a.softcap);
      w.alpha[m] = quant_softmax_row(s, n, seen.first, seen.last, &w.stats[2 * m]);
      if constexpr (kRowScaled<F>) multiply_rows(s, w.vs.data(), keys);
    }
    quant_weighted_sum(w.acc.data(), D, w.p.data(), w.alpha.data(), rows, n, w.v.data());
  }
  if (kUnitInv<F> != 1.0f) scale_row(w.acc.data(), kUnitInv<F>, rows * D);
  finish_prefill_item<T>(a, it, span.q0, rows, w.acc.data(), w.stats.data(), 2);
}

template <int T>
void quant_prefill(const PrefillArgs& a, const QuantLayout& L, const std::vector<PrefillItem>& items,
                   int num_threads) {
  const auto run = [&](auto format) {
    constexpr int F = decltype(format)::value;
    on_pool<QuantPrefillScratch>(items.size(), num_threads, [&](int64_t k, QuantPrefillScratch& w) {
      quant_prefill_item<T, F>(a, L, items[k], w);
    });
  };
  switch (L.format) {
    case kFp8E4M3: return run(std::integral_constant<int, kFp8E4M3>{});
    case kFp8E5M2: return run(std::integral_constant<int, kFp8E5M2>{});
    case kInt8: return run(std::integral_constant<int, kInt8>{});
    default: return run(std::integral_constant<int, kInt4>{});
  }
}

}  // namespace
