// kvpage native CPU kernels for CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 1-3, Intel
// client cores): paged decode attention, chunked-prefill attention, KV row stores and the
// logits' row argmax, behind the same C interface as native_cpu.cpp.
//
// Why a variant of its own and not numba on these CPUs: the reasons of native_cpu.cpp's
// header hold on any CPU (one OpenMP pool with torch's instead of numba's second copy, a
// ctypes call instead of a numba dispatch), and the AVX-512 source cannot be compiled for
// a CPU without it. The layouts are those of native_cpu.cpp with 8-lane vectors:
//
// - decode: one work item per (sequence, context split) covering every KV head; a
//   partition of kPartition tokens at a time, token by token in address order: each K row
//   against the GQA group's query heads (8 tokens per transpose-and-add reduction), a
//   streaming-softmax step per query head, then each V row into the group's accumulators;
// - prefill: one work item per (sequence, KV head, tile of query rows); each 64-key chunk
//   is laid out once as fp32 K^T and V, so QK^T of two rows x 32 keys and P.V of two rows
//   x 32 dims are register-blocked broadcast FMAs with no horizontal sums.
//
// bf16 and fp16 are widened to fp32 as they are loaded (no bf16 dot instruction on these
// CPUs; fp16 through F16C); all arithmetic is fp32.

#include <immintrin.h>

namespace {
using Vec = __m256;  // the register the shared vector code (native_cpu_common.h) is written over
}
#include "native_cpu_common.h"

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "kvpage's AVX2 kernels need AVX2, FMA and F16C (the loader falls back to numba without them)"
#endif

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Eight horizontal sums at once: lane i of the result is the sum of v[i]'s lanes.
inline __m256 reduce8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: v0..v3, v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Lanes j of {0..7} + base with first <= j <= last, as an all-ones float mask.
inline __m256 visible_mask(int64_t base, int64_t first, int64_t last) {
  const __m256i key = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                       _mm256_set1_epi32(static_cast<int>(base)));
  const __m256i ge_first = _mm256_cmpgt_epi32(key, _mm256_set1_epi32(static_cast<int>(first - 1)));
  const __m256i le_last = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(last + 1)), key);
  return _mm256_castsi256_ps(_mm256_and_si256(ge_first, le_last));
}

// The streaming-softmax step of one row over n <= 64 scores s (already scaled and
// softcapped; entries outside [first, last] are ignored): the row's new (max, denominator)
// in st, the weights into s (0 outside the visible range, up to a multiple of 8), and the
// rescale factor of the row's accumulator as the result.
inline float softmax_step(float* s, int64_t n, int64_t first, int64_t last, float* st) {
  const int64_t vecs = (n + 7) / 8;
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 mx = neg_inf;
  for (int64_t v = 0; v < vecs; ++v) {
    const __m256 x = _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(s + 8 * v), visible_mask(8 * v, first, last));
    _mm256_storeu_ps(s + 8 * v, x);
    mx = _mm256_max_ps(mx, x);
  }
  const float m_old = st[0], m_new = std::max(m_old, hmax(mx));
  const __m256 m = _mm256_set1_ps(m_new);
  __m256 total = _mm256_setzero_ps();
  for (int64_t v = 0; v < vecs; ++v) {
    const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * v), m));  // -inf -> 0
    _mm256_storeu_ps(s + 8 * v, p);
    total = _mm256_add_ps(total, p);
  }
  const float alpha = m_old == m_new ? 1.0f : exp_nonpositive_scalar(m_old - m_new);  // 0 when m_old is -inf
  st[0] = m_new;
  st[1] = st[1] * alpha + hsum(total);
  return alpha;
}

// The two-row register block of weighted_sum and scores_two_rows: for t < count,
// o0[c] += x0[t] * y(t)[8c : 8c + 8] and o1[c] += x1[t] * the same vector, for c < kVecs
// (0: `vecs`, known at run time), each vector of y(t) loaded once for both rows.
template <int kVecs, class Y>
inline void fma_two_rows(const float* x0, const float* x1, int64_t count, Y y, int64_t vecs, __m256* o0, __m256* o1) {
  const int64_t nv = kVecs ? kVecs : vecs;
  for (int64_t t = 0; t < count; ++t) {
    const float* yt = y(t);
    const __m256 b0 = _mm256_set1_ps(x0[t]), b1 = _mm256_set1_ps(x1[t]);
    for (int64_t c = 0; c < nv; ++c) {
      const __m256 yc = _mm256_loadu_ps(yt + 8 * c);
      o0[c] = _mm256_fmadd_ps(b0, yc, o0[c]);
      o1[c] = _mm256_fmadd_ps(b1, yc, o1[c]);
    }
  }
}

// acc[r][0:D] = acc[r] * alpha[r] + sum_j p[r][j] * V[j] for `rows` rows (p rows and acc rows
// `p_stride` / `acc_stride` floats apart) over keys j < n, V row j at vrow(j) (fp32).
// Blocks of two rows x 32 dims stay in registers across the keys.
template <class VRow>
inline void weighted_sum(float* acc, int64_t acc_stride, const float* p, int64_t p_stride, const float* alpha,
                         int64_t rows, int64_t n, int64_t D, VRow vrow) {
  for (int64_t r0 = 0; r0 < rows; r0 += 2) {
    const bool two = r0 + 1 < rows;
    float* a0 = acc + r0 * acc_stride;
    float* a1 = two ? a0 + acc_stride : a0;
    const float* p0 = p + r0 * p_stride;
    const float* p1 = two ? p0 + p_stride : p0;
    const __m256 al0 = _mm256_set1_ps(alpha[r0]), al1 = _mm256_set1_ps(two ? alpha[r0 + 1] : 0.0f);
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      const int64_t chunks = std::min<int64_t>(4, (D - d0) / 8);  // D % 16 == 0: 4 or 2
      __m256 o0[4], o1[4];
      for (int64_t c = 0; c < 4; ++c) {
        o0[c] = c < chunks ? _mm256_mul_ps(_mm256_loadu_ps(a0 + d0 + 8 * c), al0) : _mm256_setzero_ps();
        o1[c] = c < chunks && two ? _mm256_mul_ps(_mm256_loadu_ps(a1 + d0 + 8 * c), al1) : _mm256_setzero_ps();
      }
      const auto v = [&](int64_t j) { return vrow(j) + d0; };
      if (chunks == 4) {
        fma_two_rows<4>(p0, p1, n, v, 4, o0, o1);
      } else {
        fma_two_rows<2>(p0, p1, n, v, 2, o0, o1);
      }
      for (int64_t c = 0; c < chunks; ++c) {
        _mm256_storeu_ps(a0 + d0 + 8 * c, o0[c]);
        if (two) _mm256_storeu_ps(a1 + d0 + 8 * c, o1[c]);
      }
    }
  }
}

// ---- Decode -----------------------------------------------------------------------------

struct DecodeScratch {
  std::vector<float> qf, acc, scores, stats, part;
};

// Decode reads every K and V row of the context once, so it is bound by memory; the loops
// below walk each token's row (all heads, contiguous in its block) in address order, which
// the hardware prefetchers follow, and keep the loads among the arithmetic so the core has
// misses in flight while it computes. Measured on a 2-core AMD EPYC with AVX2 (32 sequences
// x 512 tokens, 8 query / 4 KV heads of 64, fp32, one thread): head-major walks (one head's
// slice of every row, then the next head's) took 9.3 ms, staging each 8 rows into L1 before
// computing 7.4-7.8, this order with a run-time head size 8.0-8.3, with a compile-time one
// 6.4-6.7, and with each K row held in registers for its query heads 5.5-6.4, against
// 5.0-6.0 ms for the numba kernel; L2 software prefetches (native_cpu.cpp's) changed
// nothing here.

// Scores of the n <= 8 tokens at offs for every query head into scores[hq * kPartition + j],
// softcapped; kD is the head size when it is a compile-time one (0: a.head_dim). part:
// scratch of H * 64 floats (each (head, token) partial vector, reduced 8 tokens at a time).
template <int T, int kD>
void partition_scores8(const DecodeArgs& a, const int64_t* offs, int64_t n, const float* qf, float* part,
                       float* scores) {
  const int64_t D = kD ? kD : a.head_dim, group = a.num_heads / a.num_kv_heads;
  for (int64_t j = 0; j < 8; ++j) {
    for (int64_t h = 0; h < a.num_kv_heads; ++h) {
      const int64_t o = j < n ? offs[j] + h * D : -1;
      if constexpr (kD == 64) {  // the row's 8 vectors stay in registers for the group's heads
        __m256 k[8];
        for (int c = 0; c < 8; ++c) k[c] = o >= 0 ? load_vec<T>(a.key_cache, o + 8 * c) : _mm256_setzero_ps();
        for (int64_t g = 0; g < group; ++g) {
          const int64_t hq = h * group + g;
          const float* q = qf + hq * D;
          __m256 x0 = _mm256_mul_ps(_mm256_loadu_ps(q), k[0]), x1 = _mm256_mul_ps(_mm256_loadu_ps(q + 8), k[1]);
          for (int c = 2; c < 8; c += 2) {
            x0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), k[c], x0);
            x1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c + 8), k[c + 1], x1);
          }
          _mm256_storeu_ps(part + (hq * 8 + j) * 8, _mm256_add_ps(x0, x1));
        }
        continue;
      }
      for (int64_t g = 0; g < group; ++g) {
        const int64_t hq = h * group + g;
        __m256 x0 = _mm256_setzero_ps(), x1 = _mm256_setzero_ps();
        if (o >= 0) {
          const float* q = qf + hq * D;
          for (int64_t c = 0; c < D; c += 16) {
            x0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), load_vec<T>(a.key_cache, o + c), x0);
            x1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 8), load_vec<T>(a.key_cache, o + c + 8), x1);
          }
        }
        _mm256_storeu_ps(part + (hq * 8 + j) * 8, _mm256_add_ps(x0, x1));
      }
    }
  }
  alignas(32) float out[8];
  for (int64_t hq = 0; hq < a.num_heads; ++hq) {
    __m256 v[8];
    for (int j = 0; j < 8; ++j) v[j] = _mm256_loadu_ps(part + (hq * 8 + j) * 8);
    _mm256_store_ps(out, reduce8(v));
    for (int64_t j = 0; j < n; ++j) scores[hq * kPartition + j] = softcapped(out[j], a.softcap);
  }
}

// acc[hq] += sum over the partition's n tokens of weight * V row, token by token; each
// 32-dim piece of a V row is loaded once for the KV head's `group` query heads.
template <int T, int kD>
void partition_values(const DecodeArgs& a, const int64_t* offs, int64_t n, const float* scores, float* acc) {
  const int64_t D = kD ? kD : a.head_dim, group = a.num_heads / a.num_kv_heads;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t h = 0; h < a.num_kv_heads; ++h) {
      const int64_t o = offs[j] + h * D;
      for (int64_t d0 = 0; d0 < D; d0 += 32) {
        const int64_t chunks = std::min<int64_t>(4, (D - d0) / 8);  // D % 16 == 0: 4 or 2
        __m256 v[4];
        for (int64_t c = 0; c < chunks; ++c) v[c] = load_vec<T>(a.value_cache, o + d0 + 8 * c);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t hq = h * group + g;
          const __m256 w = _mm256_set1_ps(scores[hq * kPartition + j]);
          float* arow = acc + hq * D + d0;
          for (int64_t c = 0; c < chunks; ++c)
            _mm256_storeu_ps(arow + 8 * c, _mm256_fmadd_ps(w, v[c], _mm256_loadu_ps(arow + 8 * c)));
        }
      }
    }
  }
}

template <int T, int kD>
void decode_item(const DecodeArgs& a, int64_t item, DecodeScratch& w) {
  const DecodeSpan span = decode_span(a, item);
  const int64_t D = kD ? kD : a.head_dim, H = a.num_heads, tok_lo = span.tok_lo, tok_hi = span.tok_hi;
  w.qf.resize(H * D);
  w.acc.assign(H * D, 0.0f);
  w.scores.assign(H * kPartition, 0.0f);
  w.stats.resize(2 * H);
  w.part.resize(64 * H);
  reset_stats(w.stats.data(), H, 2);
  load_queries<T>(a, span.seq, D, w.qf.data());
  const int32_t* table = a.block_tables + span.seq * a.table_stride;
  const int64_t row = a.num_kv_heads * D;
  int64_t offs[kPartition], next_offs[kPartition];
  int64_t n = row_offsets(a, table, row, tok_lo, tok_hi, offs);
  for (int64_t pb = tok_lo; pb < tok_hi; pb += kPartition) {
    for (int64_t j0 = 0; j0 < n; j0 += 8)
      partition_scores8<T, kD>(a, offs + j0, std::min<int64_t>(8, n - j0), w.qf.data(), w.part.data(),
                               w.scores.data() + j0);
    for (int64_t hq = 0; hq < H; ++hq) {
      const float alpha = softmax_step(w.scores.data() + hq * kPartition, n, 0, n - 1, &w.stats[2 * hq]);
      if (alpha == 1.0f) continue;
      const __m256 al = _mm256_set1_ps(alpha);
      float* arow = w.acc.data() + hq * D;
      for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(arow + c, _mm256_mul_ps(_mm256_loadu_ps(arow + c), al));
    }
    const int64_t next_n = row_offsets(a, table, row, pb + kPartition, tok_hi, next_offs);
    partition_values<T, kD>(a, offs, n, w.scores.data(), w.acc.data());
    std::memcpy(offs, next_offs, next_n * sizeof(int64_t));
    n = next_n;
  }
  finish_decode_item<T>(a, span, D, w.acc.data(), w.stats.data());
}


// ---- Prefill and chunked prefill --------------------------------------------------------
//
// Work item = (sequence, KV head, tile of kQueryTile query rows): the tile's tokens times
// the KV head's `group` query heads, all attending the same keys. Per 64-key chunk of the
// visible context, K^T and V are laid out once as fp32, then for two rows at a time the
// scores of 32 keys (8 accumulators, one K^T load per dim and key vector shared by both
// rows), each row's softmax step, and P.V.

constexpr int64_t kQueryTile = 16;
constexpr int64_t kKeyChunk = 64;

int64_t prefill_query_tile(int, int64_t) { return kQueryTile; }
bool prefill_on_amx(int, int64_t) { return false; }

struct PrefillScratch {
  std::vector<float> qf, acc, stats, alpha, kt, v, p;
};

// s[r][0:keys) = q[r] . K^T[:, 0:keys) for the two rows q0, q1 (D floats each) and the chunk's
// K^T (kt[d][j], kKeyChunk floats per dim); keys a multiple of 8.
inline void scores_two_rows(const float* q0, const float* q1, const float* kt, int64_t D, int64_t keys, float* s0,
                            float* s1) {
  for (int64_t j0 = 0; j0 < keys; j0 += 32) {
    const int64_t vecs = std::min<int64_t>(4, (keys - j0) / 8);
    __m256 a0[4], a1[4];
    for (int v = 0; v < 4; ++v) a0[v] = a1[v] = _mm256_setzero_ps();
    const auto k = [&](int64_t d) { return kt + d * kKeyChunk + j0; };  // K^T's row d, from key j0
    if (vecs == 4) {
      fma_two_rows<4>(q0, q1, D, k, 4, a0, a1);
    } else {
      fma_two_rows<0>(q0, q1, D, k, vecs, a0, a1);
    }
    for (int64_t v = 0; v < vecs; ++v) {
      _mm256_storeu_ps(s0 + j0 + 8 * v, a0[v]);
      _mm256_storeu_ps(s1 + j0 + 8 * v, a1[v]);
    }
  }
}

template <int T>
void prefill_item(const PrefillArgs& a, const PrefillItem& it, PrefillScratch& w) {
  const int64_t D = a.head_dim, group = a.num_heads / a.num_kv_heads;
  const PrefillSpan span = prefill_span(a, it);
  const int64_t lo_pos = span.lo_pos, hi_pos = span.hi_pos;
  const int64_t rows = it.rows * group;
  const int64_t padded = rows + (rows & 1);  // scores_two_rows writes an even number of rows
  w.qf.assign(padded * D, 0.0f);
  w.acc.assign(rows * D, 0.0f);
  w.stats.resize(2 * rows);
  w.alpha.resize(rows);
  w.kt.resize(D * kKeyChunk);
  w.v.resize(kKeyChunk * D);
  w.p.resize(padded * kKeyChunk);
  for (int64_t m = 0; m < rows; ++m)
    load_scaled<T>(a.q, prefill_query_offset(a, it, span.q0, m), D, a.scale, w.qf.data() + m * D);
  reset_stats(w.stats.data(), rows, 2);
  for (int64_t base = span.k_lo / kKeyChunk * kKeyChunk; base <= hi_pos; base += kKeyChunk) {
    const int64_t n = std::min({kKeyChunk, span.seq_len - base, hi_pos - base + 1});  // keys some row may see
    const int64_t keys = (n + 7) / 8 * 8;
    alignas(32) float krow[8];
    for (int64_t j = 0; j < keys; ++j) {
      if (j >= n) {
        for (int64_t d = 0; d < D; ++d) w.kt[d * kKeyChunk + j] = 0.0f;
        std::memset(w.v.data() + j * D, 0, D * sizeof(float));
        continue;
      }
      const int64_t off = prefill_key_offset(a, it, span.table, base + j);
      for (int64_t c = 0; c < D; c += 8) {
        _mm256_store_ps(krow, load_vec<T>(a.key_cache, off + c));
        for (int64_t e = 0; e < 8; ++e) w.kt[(c + e) * kKeyChunk + j] = krow[e];
        _mm256_storeu_ps(w.v.data() + j * D + c, load_vec<T>(a.value_cache, off + c));
      }
    }
    for (int64_t m = 0; m < padded; m += 2)
      scores_two_rows(w.qf.data() + m * D, w.qf.data() + (m + 1) * D, w.kt.data(), D, keys,
                      w.p.data() + m * kKeyChunk, w.p.data() + (m + 1) * kKeyChunk);
    for (int64_t m = 0; m < rows; ++m) {
      float* s = w.p.data() + m * kKeyChunk;
      const KeyRange seen = visible_keys(a, lo_pos + m / group, base, n);
      if (seen.empty()) {  // nothing visible in this chunk: the row is unchanged
        std::memset(s, 0, keys * sizeof(float));
        w.alpha[m] = 1.0f;
        continue;
      }
      if (a.softcap > 0)
        for (int64_t j = seen.first; j <= seen.last; ++j) s[j] = softcapped(s[j], a.softcap);
      w.alpha[m] = softmax_step(s, n, seen.first, seen.last, &w.stats[2 * m]);
    }
    const float* vb = w.v.data();
    weighted_sum(w.acc.data(), D, w.p.data(), kKeyChunk, w.alpha.data(), rows, n, D,
                 [&](int64_t j) { return vb + j * D; });
  }
  finish_prefill_item<T>(a, it, span.q0, rows, w.acc.data(), w.stats.data(), 2);
}

template <int T>
void prefill_typed(const PrefillArgs& a, const std::vector<PrefillItem>& items, int num_threads) {
  on_pool<PrefillScratch>(items.size(), num_threads,
                          [&](int64_t k, PrefillScratch& w) { prefill_item<T>(a, items[k], w); });
}

// ---- Greedy sampling: each logits row's maximum and first maximal index -----------------

void row_argmax(const float* x, int64_t cols, float* out_max, int64_t* out_idx) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 best = neg_inf, nan = _mm256_setzero_ps();
  __m256i best_idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), idx = best_idx;
  const __m256i step = _mm256_set1_epi32(8);
  int64_t j = 0;
  for (; j + 8 <= cols; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ);  // strict: a lane keeps its first maximum
    best = _mm256_blendv_ps(best, v, greater);
    best_idx = _mm256_blendv_epi8(best_idx, idx, _mm256_castps_si256(greater));
    idx = _mm256_add_epi32(idx, step);
  }
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t t = j; t < cols; ++t) has_nan |= std::isnan(x[t]);
  if (has_nan && first_nan(x, cols, out_max, out_idx)) return;
  alignas(32) float lane_max[8];
  alignas(32) int32_t lane_idx[8];
  _mm256_store_ps(lane_max, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_idx), best_idx);
  // Each lane holds its first maximum; the tail's indices come after every lane's.
  float m = lane_max[0];
  int64_t at = lane_idx[0];
  for (int l = 1; l < 8; ++l)
    if (lane_max[l] > m || (lane_max[l] == m && lane_idx[l] < at)) {
      m = lane_max[l];
      at = lane_idx[l];
    }
  for (int64_t t = j; t < cols; ++t)
    if (x[t] > m) {
      m = x[t];
      at = t;
    }
  *out_max = m;
  *out_idx = at;
}

// Lane i: the sum of v[i]'s lanes, for the quantized kernels (native_cpu_quant.h).
inline __m256 reduce_lanes(const __m256* v) { return reduce8(v); }

}  // namespace

#include "native_cpu_quant.h"
#include "native_cpu_api.h"
