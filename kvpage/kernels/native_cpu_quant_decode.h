// kvpage native CPU kernels: decode attention over quantized KV caches (native_cpu_quant.h
// has the formats, the code loaders and the overview). One work item per (sequence, context
// split), as the unquantized decode (native_cpu_common.h); K and V rows read as codes.

#pragma once

namespace {

struct QuantDecodeScratch {
  std::vector<float> qf, acc, scores, stats, part, kscale, vscale;
  std::vector<float> qt, qsum, kparams;  // the transposed scores' queries (column order) and int4 terms
  LineQueue queue;
};

// Byte offsets of the codes and scales rows of context tokens pb .. min(pb + kPartition,
// end); returns how many. Block by block: one division per block, not two per token.
inline int64_t quant_offsets(const QuantLayout& L, const int32_t* table, int64_t pb, int64_t end, int64_t* codes,
                             int64_t* scales) {
  const int64_t n = std::max<int64_t>(0, std::min(pb + kPartition, end) - pb);
  const int64_t code_step = L.heads * L.code_bytes, scale_step = L.heads * L.scale_bytes;
  for (int64_t j = 0; j < n;) {
    const int64_t t = pb + j, index = t / L.block_size, off = t - index * L.block_size;
    const int64_t run = std::min(L.block_size - off, n - j);
    const int64_t block = static_cast<int64_t>(table[index]) * L.block_bytes;
    for (int64_t k = 0; k < run; ++k, ++j) {
      codes[j] = block + (off + k) * code_step;
      scales[j] = block + L.scales_at + (off + k) * scale_step;
    }
  }
  return n;
}

// The cache lines of n tokens' scales rows (`bytes` each) into L2, and the first line of
// each run of their code rows (codes at `codes`): a block's consecutive tokens have
// consecutive rows, so each run is one span of scales. Issued together, so that the page
// walks of a partition's blocks (4 KB pages, blocks anywhere in the pool) overlap; the
// LineQueue's code lines, spread over the compute loops, then find their pages translated.
// The prefetches are asm statements: GCC deleted this loop of _mm_prefetch calls (a loop with
// no other effect), and the scales' loads then waited on memory in every partition.
inline void prefetch_runs(const uint8_t* base, const int64_t* codes, const int64_t* scales, int64_t n,
                          int64_t bytes) {
  for (int64_t j = 0; j < n;) {
    int64_t k = j + 1;
    while (k < n && scales[k] == scales[k - 1] + bytes) ++k;
    asm volatile("prefetcht1 %0" : : "m"(base[codes[j]]));
    const uintptr_t first = reinterpret_cast<uintptr_t>(base + scales[j]) >> 6;
    const uintptr_t last = (reinterpret_cast<uintptr_t>(base + scales[k - 1]) + bytes - 1) >> 6;
    for (uintptr_t line = first; line <= last; ++line)
      asm volatile("prefetcht1 %0" : : "m"(*reinterpret_cast<const char*>(line << 6)));
    j = k;
  }
}

// The row scales of n tokens, every head, into out[h * kPartition + j].
template <int F>
inline void token_scales(const QuantLayout& L, const uint8_t* base, const int64_t* scales, int64_t n, float* out) {
  for (int64_t h = 0; h < L.heads; ++h)
    for (int64_t j = 0; j < n; ++j) out[h * kPartition + j] = row_scale<F>(base + scales[j] + h * L.scale_bytes);
}

}  // namespace

#include "native_cpu_quant_transposed.h"

namespace {

// ---- Decode scores row by row, and the V sums --------------------------------------------

// `rows` query rows of D floats in int4_value_chunks' order (each 2W-element block: its even
// elements, then its odd ones), so int4 K rows widened in that order give the same dot products.
inline void pair_queries(const float* qf, int64_t rows, int64_t D, float* qt) {
  constexpr int W = kVecLanes;
  for (int64_t b = 0; b < rows * D; b += 2 * W)
    for (int i = 0; i < W; ++i) {
      qt[b + i] = qf[b + 2 * i];
      qt[b + W + i] = qf[b + 2 * i + 1];
    }
}

// Partial dot products of KV head h's rows of m <= W tokens (codes/scales offsets coffs,
// soffs) with the group's query rows: part[(hq * W + j) * W] holds W lanes summing to
// q[hq] . K[j] (in the codes' unit, without the row scale). kC chunks of the row at a time
// stay in registers for every query head of the group.
template <int F, int kC>
void quant_partials(const DecodeArgs& a, const QuantLayout& L, const int64_t* coffs, const int64_t* soffs, int64_t m,
                    int64_t h, const float* qf, float* part, LineQueue& pq, int64_t per_row) {
  constexpr int W = kVecLanes;
  const int64_t D = a.head_dim, group = a.num_heads / a.num_kv_heads;
  const uint8_t* kb = static_cast<const uint8_t*>(a.key_cache);
  for (int64_t j = 0; j < m; ++j) {
    pq.issue(per_row);
    const uint8_t* codes = kb + coffs[j] + h * L.code_bytes;
    const uint8_t* scales = kb + soffs[j] + h * L.scale_bytes;
    for (int64_t d0 = 0; d0 < D; d0 += kC * W) {
      Vec k[kC];
      if constexpr (F == kInt4 && kC % 2 == 0) {
        int4_value_chunks<W, kC>(codes, scales, d0, L.group, k);  // qf is in the same order (pair_queries)
      } else {
        row_chunks<W, F, kC>(codes, scales, d0, L.group, k);
      }
      for (int64_t g = 0; g < group; ++g) {
        const int64_t hq = h * group + g;
        const float* q = qf + hq * D + d0;
        Vec x0 = vmul(vload<W>(q), k[0]), x1 = vzero<W>();
        for (int c = 1; c < kC; ++c) {
          if (c % 2) x1 = fmadd(vload<W>(q + c * W), k[c], x1);
          else x0 = fmadd(vload<W>(q + c * W), k[c], x0);
        }
        float* p = part + (hq * W + j) * W;
        const Vec s = vadd(x0, x1);
        vstore(p, d0 == 0 ? s : vadd(vload<W>(p), s));
      }
    }
  }
}

template <int F>
void quant_partials_any(const DecodeArgs& a, const QuantLayout& L, const int64_t* coffs, const int64_t* soffs,
                        int64_t m, int64_t h, const float* qf, float* part, LineQueue& pq, int64_t per_row) {
  const int64_t D = a.head_dim;
  if constexpr (kVecLanes == 16) {
    if (D % 128 == 0) return quant_partials<F, 8>(a, L, coffs, soffs, m, h, qf, part, pq, per_row);
    if (D % 64 == 0) return quant_partials<F, 4>(a, L, coffs, soffs, m, h, qf, part, pq, per_row);
    if (D % 32 == 0) return quant_partials<F, 2>(a, L, coffs, soffs, m, h, qf, part, pq, per_row);
    return quant_partials<F, 1>(a, L, coffs, soffs, m, h, qf, part, pq, per_row);
  } else {
    if (D % 32 == 0) return quant_partials<F, 4>(a, L, coffs, soffs, m, h, qf, part, pq, per_row);
    return quant_partials<F, 2>(a, L, coffs, soffs, m, h, qf, part, pq, per_row);
  }
}

// Query heads whose accumulators stay in registers across a partition's V rows, with kC
// chunks of the row: (kRows + 1) * kC + 1 registers of the 32 (AVX-512) or 16 (AVX2).
template <int kC>
constexpr int kValueRows = kVecLanes == 16 ? 4 : (kC <= 2 ? 4 : 2);

// acc rows g < kRows (acc + g * D, dims d0 .. d0 + kC * W) += the sum over the partition's n
// tokens of weights[g * kPartition + j] * V row j of KV head h; each chunk of a V row is
// converted once for the rows.
template <int F, int kC, int kRows>
void quant_values(const DecodeArgs& a, const QuantLayout& L, const int64_t* coffs, const int64_t* soffs, int64_t n,
                  const float* weights, float* acc, int64_t h, int64_t d0, LineQueue& pq, int64_t per_pair) {
  constexpr int W = kVecLanes;
  const int64_t D = a.head_dim, code_at = h * L.code_bytes, scale_at = h * L.scale_bytes, group = L.group;
  const uint8_t* vb = static_cast<const uint8_t*>(a.value_cache);
  Vec r[kRows][kC];
  for (int g = 0; g < kRows; ++g)
    for (int c = 0; c < kC; ++c) r[g][c] = vload<W>(acc + g * D + d0 + c * W);
  for (int64_t j = 0; j < n; ++j) {
    if (j % 2 == 0) pq.issue(per_pair);
    Vec v[kC];
    if constexpr (F == kInt4 && kC % 2 == 0) {
      int4_value_chunks<W, kC>(vb + coffs[j] + code_at, vb + soffs[j] + scale_at, d0, group, v);
    } else {
      row_chunks<W, F, kC>(vb + coffs[j] + code_at, vb + soffs[j] + scale_at, d0, group, v);
    }
    for (int g = 0; g < kRows; ++g) {
      const Vec w = splat<W>(weights[g * kPartition + j]);
      for (int c = 0; c < kC; ++c) r[g][c] = fmadd(w, v[c], r[g][c]);
    }
  }
  for (int g = 0; g < kRows; ++g)
    for (int c = 0; c < kC; ++c) vstore(acc + g * D + d0 + c * W, r[g][c]);
}

template <int F, int kC>
void quant_values_heads(const DecodeArgs& a, const QuantLayout& L, const int64_t* coffs, const int64_t* soffs,
                        int64_t n, const float* scores, float* acc, LineQueue& pq) {
  constexpr int W = kVecLanes, kRows = kValueRows<kC>;
  const int64_t D = a.head_dim, group = a.num_heads / a.num_kv_heads;
  const int64_t calls = a.num_kv_heads * ((group + kRows - 1) / kRows) * (D / (kC * W)) * ((n + 1) / 2);
  const int64_t per_pair = (pq.lines() + calls - 1) / std::max<int64_t>(calls, 1);
  for (int64_t h = 0; h < a.num_kv_heads; ++h)
    for (int64_t g0 = 0; g0 < group; g0 += kRows) {
      const int64_t hq0 = h * group + g0;
      const float* wts = scores + hq0 * kPartition;
      float* rows = acc + hq0 * D;
      for (int64_t d0 = 0; d0 < D; d0 += kC * W) {
        switch (std::min<int64_t>(kRows, group - g0)) {  // rows exactly: no guards in the token loop
          case 1: quant_values<F, kC, 1>(a, L, coffs, soffs, n, wts, rows, h, d0, pq, per_pair); break;
          case 2: quant_values<F, kC, 2>(a, L, coffs, soffs, n, wts, rows, h, d0, pq, per_pair); break;
          case 3:
            if constexpr (kRows >= 3) quant_values<F, kC, 3>(a, L, coffs, soffs, n, wts, rows, h, d0, pq, per_pair);
            break;
          default:
            if constexpr (kRows >= 4) quant_values<F, kC, 4>(a, L, coffs, soffs, n, wts, rows, h, d0, pq, per_pair);
            break;
        }
      }
    }
}

template <int F>
void quant_values_any(const DecodeArgs& a, const QuantLayout& L, const int64_t* coffs, const int64_t* soffs,
                      int64_t n, const float* scores, float* acc, LineQueue& pq) {
  const int64_t D = a.head_dim;
  if constexpr (kVecLanes == 16) {
    if (D % 64 == 0) return quant_values_heads<F, 4>(a, L, coffs, soffs, n, scores, acc, pq);
    if (D % 32 == 0) return quant_values_heads<F, 2>(a, L, coffs, soffs, n, scores, acc, pq);
    return quant_values_heads<F, 1>(a, L, coffs, soffs, n, scores, acc, pq);
  } else {
    if (D % 32 == 0) return quant_values_heads<F, 4>(a, L, coffs, soffs, n, scores, acc, pq);
    return quant_values_heads<F, 2>(a, L, coffs, soffs, n, scores, acc, pq);
  }
}

// Scores of the partition's n tokens for every query head into scores[hq * kPartition + j]:
// W tokens at a time, each KV head's rows against its group's queries, the W partial
// vectors of a head reduced together and multiplied by the W rows' scales.
template <int F>
void quant_scores(const DecodeArgs& a, const QuantLayout& L, const int64_t* coffs, const int64_t* soffs, int64_t n,
                  const float* qf, QuantDecodeScratch& w, LineQueue& pq) {
  constexpr int W = kVecLanes;
  const int64_t group = a.num_heads / a.num_kv_heads;
#if defined(__AVX512BW__)
  if constexpr (kTransposedScores) {
    if (transposed_scores<F>(a.head_dim)) {
      const int64_t calls = (n + 15) / 16 * a.num_kv_heads;
      const int64_t per_call = (pq.lines() + calls - 1) / std::max<int64_t>(calls, 1);
      for (int64_t j0 = 0; j0 < n; j0 += 16)
        for (int64_t h = 0; h < a.num_kv_heads; ++h) {
          pq.issue(per_call);
          quant_scores_transposed<F>(a, L, coffs + j0, std::min<int64_t>(16, n - j0), j0, h, w);
        }
      return;
    }
  }
#endif
  const int64_t per_row = (pq.lines() + n * a.num_kv_heads - 1) / std::max<int64_t>(n * a.num_kv_heads, 1);
  for (int64_t j0 = 0; j0 < n; j0 += W) {
    const int64_t m = std::min<int64_t>(W, n - j0);
    for (int64_t h = 0; h < a.num_kv_heads; ++h) {
      quant_partials_any<F>(a, L, coffs + j0, soffs + j0, m, h, qf, w.part.data(), pq, per_row);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t hq = h * group + g;
        Vec v[W];
        for (int j = 0; j < W; ++j) v[j] = vload<W>(w.part.data() + (hq * W + j) * W);
        Vec s = reduce_lanes(v);
        if constexpr (kRowScaled<F>) s = vmul(s, vload<W>(w.kscale.data() + h * kPartition + j0));
        vstore(w.scores.data() + hq * kPartition + j0, s);  // lanes past n: never read
      }
    }
  }
}

// One (sequence, split) item of decode over a quantized cache (see the header comment).
template <int F>
void quant_decode_partitions(const DecodeArgs& a, const QuantLayout& L, const DecodeSpan& span,
                             QuantDecodeScratch& w) {
  const int64_t D = a.head_dim, H = a.num_heads, group = H / a.num_kv_heads;
  const int32_t* table = a.block_tables + span.seq * a.table_stride;
  const uint8_t* kb = static_cast<const uint8_t*>(a.key_cache);
  const uint8_t* vb = static_cast<const uint8_t*>(a.value_cache);
  const int64_t code_row = L.heads * L.code_bytes, scales_row = L.heads * L.scale_bytes;
  int64_t coffs[kPartition], soffs[kPartition], next_c[kPartition], next_s[kPartition];
  int64_t n = quant_offsets(L, table, span.tok_lo, span.tok_hi, coffs, soffs);
  LineQueue& pq = w.queue;
  pq.reset(code_row);  // the first partition's K: nothing to compute meanwhile, so at once
  pq.add(kb, coffs, n, 1);
  pq.drain();
  prefetch_runs(kb, coffs, soffs, n, scales_row);
  for (int64_t pb = span.tok_lo; pb < span.tok_hi; pb += kPartition) {
    // As the unquantized decode: V rows are requested while the scores are computed, the
    // next partition's K rows while this partition's V rows are summed.
    pq.reset(code_row);
    pq.add(vb, coffs, n, 1);
    prefetch_runs(vb, coffs, soffs, n, scales_row);
    if constexpr (kRowScaled<F>) token_scales<F>(L, kb, soffs, n, w.kscale.data());
#if defined(__AVX512BW__)
    if constexpr (F == kInt4 && kTransposedScores)
      if (transposed_scores<F>(D)) int4_token_params(L, kb, soffs, n, w.kparams.data());
#endif
    quant_scores<F>(a, L, coffs, soffs, n, (paired_values<F>(D) ? w.qt : w.qf).data(), w, pq);
    pq.drain();
    if constexpr (kRowScaled<F>) token_scales<F>(L, vb, soffs, n, w.vscale.data());
    const int64_t padded = (n + kVecLanes - 1) / kVecLanes * kVecLanes;
    for (int64_t hq = 0; hq < H; ++hq) {
      float* s = w.scores.data() + hq * kPartition;
      if (a.softcap > 0)
        for (int64_t j = 0; j < n; ++j) s[j] = softcapped(s[j], a.softcap);
      const float alpha = quant_softmax_row(s, n, 0, n - 1, &w.stats[2 * hq]);
      if (alpha != 1.0f) scale_row(w.acc.data() + hq * D, alpha, D);
      if constexpr (kRowScaled<F>) multiply_rows(s, w.vscale.data() + hq / group * kPartition, padded);
    }
    const int64_t next_n = quant_offsets(L, table, pb + kPartition, span.tok_hi, next_c, next_s);
    pq.reset(code_row);
    pq.add(kb, next_c, next_n, 1);
    prefetch_runs(kb, next_c, next_s, next_n, scales_row);
    quant_values_any<F>(a, L, coffs, soffs, n, w.scores.data(), w.acc.data(), pq);
    pq.drain();
    std::memcpy(coffs, next_c, next_n * sizeof(int64_t));
    std::memcpy(soffs, next_s, next_n * sizeof(int64_t));
    n = next_n;
  }
  if (kUnitInv<F> != 1.0f) scale_row(w.acc.data(), kUnitInv<F>, H * D);
  if (paired_values<F>(D)) unpair_int4_rows(w.acc.data(), H, D);
}

template <int T, int F>
void quant_decode_item(const DecodeArgs& a, const QuantLayout& L, int64_t item, QuantDecodeScratch& w) {
  constexpr int W = kVecLanes;
  const DecodeSpan span = decode_span(a, item);
  const int64_t D = a.head_dim, H = a.num_heads;
  const bool transposed = transposed_scores<F>(D);
  const int64_t pad = transposed ? 8 : 0;  // zero query rows a pass of the transposed scores may read
  w.qf.assign((H + pad) * D, 0.0f);
  w.acc.assign(H * D, 0.0f);
  w.scores.assign(H * kPartition, 0.0f);
  w.stats.resize(2 * H);
  w.part.resize(H * W * W);  // the vectors of rows past a partition's end are stale: their lanes are never read
  w.kscale.assign(L.heads * kPartition, 0.0f);
  w.vscale.assign(L.heads * kPartition, 0.0f);
  reset_stats(w.stats.data(), H, 2);
  for (int64_t hq = 0; hq < H; ++hq)
    load_scaled<T>(a.q, span.seq * a.q_stride_token + hq * a.q_stride_head, D, a.scale * kUnitInv<F>,
                   w.qf.data() + hq * D);
#if defined(__AVX512BW__)
  if (transposed) {
    w.qt.assign((H + pad) * D, 0.0f);
    transposed_queries<F>(w.qf.data(), H, D, w.qt.data());
  }
#endif
  if (!transposed && paired_values<F>(D)) {  // int4 rows scored in int4_value_chunks' order
    w.qt.resize(H * D);
    pair_queries(w.qf.data(), H, D, w.qt.data());
  }
  if (F == kInt4 && transposed) {  // each query head's sum over each channel group, for the mins
    const int64_t groups = D / L.group;
    w.qsum.assign((H + pad) * groups, 0.0f);
    w.kparams.resize(L.heads * groups * 2 * kPartition);
    for (int64_t hq = 0; hq < H; ++hq)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t d = g * L.group; d < (g + 1) * L.group; ++d) w.qsum[hq * groups + g] += w.qf[hq * D + d];
  }
  quant_decode_partitions<F>(a, L, span, w);
  finish_decode_item<T>(a, span, D, w.acc.data(), w.stats.data());
}

template <int T, int F>
void quant_decode_typed(const DecodeArgs& a, const QuantLayout& L, int num_threads) {
  on_pool<QuantDecodeScratch>(a.num_seqs * a.num_splits, num_threads,
                              [&](int64_t k, QuantDecodeScratch& w) { quant_decode_item<T, F>(a, L, k, w); });
  if (a.num_splits > 1) {
#pragma omp parallel num_threads(num_threads)
    {
      std::vector<float> acc;
#pragma omp for schedule(static)
      for (int64_t row = 0; row < a.num_seqs * a.num_heads; ++row) combine_row<T>(a, row, acc);
    }
  }
}

template <int T>
void quant_decode(const DecodeArgs& a, const QuantLayout& L, int num_threads) {
  switch (L.format) {
    case kFp8E4M3: return quant_decode_typed<T, kFp8E4M3>(a, L, num_threads);
    case kFp8E5M2: return quant_decode_typed<T, kFp8E5M2>(a, L, num_threads);
    case kInt8: return quant_decode_typed<T, kInt8>(a, L, num_threads);
    default: return quant_decode_typed<T, kInt4>(a, L, num_threads);
  }
}

}  // namespace
