// kvpage native CPU kernels: paged decode attention, KV row stores and the logits' row
// argmax (AVX-512).
//
// Built on first use by native_cpu.py (g++ -O3 -march=native -fopenmp) and loaded with
// ctypes; the contract of every entry point is documented there and in
// kvpage/attention/__init__.py (the numpy reference is the oracle).
//
// Why native code next to the numba kernels: numba's parallel loops run on a second copy
// of GNU OpenMP (numba links the system libgomp by file name, torch bundles its own), so
// every attention layer switched pools and the idle pool's spinning worker competed with
// the busy one for the same cores. This library asks for libgomp.so.1 by soname, which
// the dynamic linker resolves to the copy torch already loaded: one pool for the forward.
// A ctypes call also costs a few microseconds where a numba dispatch of ~20 arguments
// plus its Python wrapper cost tens.
//
// Decode layout (same as the numba kernel, numba_decode.py): one work item per
// (sequence, context split) covering every KV head, so a token's K/V rows of all heads
// (contiguous in the pool) are read once; streaming softmax one partition of
// kPartition tokens at a time; the `group` query heads of a KV head share each row read.

#include <immintrin.h>

#include <optional>

namespace {
using Vec = __m512;  // the register the shared vector code (native_cpu_common.h) is written over
}
#include "native_cpu_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define KVPAGE_AMX 1
#endif

#if !defined(__AVX512F__)
#error "kvpage native kernels need AVX-512F (the loader falls back to numba without it)"
#endif

namespace {

// Sixteen horizontal sums at once: lane i of the result is the sum of v[i]'s lanes
// (a transpose-and-add tree: 45 instructions where sixteen separate reductions take ~130).
inline __m512 reduce16(const __m512* v) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane sums of four vectors
    __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Sum across the four 128-bit lanes; lane j of the result holds y[j]'s four vectors.
  __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

#if defined(__AVX512BF16__)
constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif

// q.k of query row `qrow` and the n <= 16 K rows at key_cache + offs[j] into out16[0:n].
// bf16 with AVX512-BF16: raw bf16 q and K pairs through vdpbf16ps (products exact in
// fp32), `qrow` holds the unscaled bf16 query and the sums are scaled here; otherwise
// `qrow` is the scaled fp32 query and K is widened to fp32.
//
// Always sixteen rows (a short tail repeats row 0, whose sums are dropped), chunk-outer:
// with a constant row count the compiler keeps the sixteen accumulators in registers, and
// each chunk's sixteen multiply-adds are independent. Row-outer with a run-time count, it
// kept them on the stack and each row's adds were one chain through a store and reload.
template <int T, int D16, bool kDot>
inline void dot16(const void* key_cache, int64_t head_dim, float scale, const void* qrow, const int64_t* offs,
                  int64_t n, float* out16) {
  const int64_t d16 = D16 ? D16 : head_dim / 16;
  int64_t rows[16];
  for (int j = 0; j < 16; ++j) rows[j] = offs[j < n ? j : 0];
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  __m512 sums;
  if constexpr (kDot) {
    static_assert(T == kBF16, "the bf16 dot path reads bf16 K");
#if defined(__AVX512BF16__)
    const int64_t d32 = d16 / 2;  // head_dim % 32 == 0 on this path
    const uint16_t* qb = static_cast<const uint16_t*>(qrow);
    const uint16_t* kc = static_cast<const uint16_t*>(key_cache);
    for (int64_t c = 0; c < d32; ++c) {  // chunk-outer: sixteen independent chains per chunk
      const __m512i qc = _mm512_loadu_si512(qb + c * 32);
      for (int j = 0; j < 16; ++j)
        acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)qc, (__m512bh)_mm512_loadu_si512(kc + rows[j] + c * 32));
    }
    sums = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));
#else
    sums = _mm512_setzero_ps();
#endif
  } else {
    const float* qf = static_cast<const float*>(qrow);
    for (int64_t c = 0; c < d16; ++c) {  // chunk-outer: sixteen independent chains per chunk
      const __m512 qc = _mm512_loadu_ps(qf + c * 16);
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qc, load_vec<T>(key_cache, rows[j] + c * 16), acc[j]);
    }
    sums = reduce16(acc);
  }
  _mm512_mask_storeu_ps(out16, static_cast<__mmask16>((1u << n) - 1), sums);  // n <= 16
}

// dot16 on the bf16-dot path when `raw` (the caller's query rows are raw bf16), else widened.
template <int T, int D16>
inline void scores16(const void* key_cache, int64_t head_dim, float scale, bool raw, const void* qrow,
                     const int64_t* offs, int64_t n, float* out16) {
  if constexpr (T == kBF16 && kHaveBf16Dot) {
    if (raw) return dot16<T, D16, true>(key_cache, head_dim, scale, qrow, offs, n, out16);
  }
  dot16<T, D16, false>(key_cache, head_dim, scale, qrow, offs, n, out16);
}

template <int T>
constexpr bool uses_bf16_dot(int64_t head_dim) { return T == kBF16 && kHaveBf16Dot && head_dim % 32 == 0; }

// Scores of the partition's n tokens (`offs`: each token's row offset in the cache, all
// heads) for every query head into scores[hq * kPartition + j]; `qrows` are the query rows
// as dot16 takes them (raw bf16 or scaled fp32, head-major).
template <int T, int D16>
void partition_scores(const DecodeArgs& a, const int64_t* offs, int64_t n, const void* qrows, float* scores,
                      LineQueue& pq, int64_t per_call) {
  const int64_t group = a.num_heads / a.num_kv_heads, D = a.head_dim;
  const bool raw = uses_bf16_dot<T>(D);
  int64_t head_offs[16];
  // Sixteen tokens at a time, every head: their K rows (all heads) stay in L1 while each
  // head reads its slice; head-outer over the whole partition (48 KB of fp32 K at SmolLM2's
  // shape) walked it once per KV head from L2. dot16's masked store goes straight into
  // `scores`: copying it out of a scratch vector read a masked store back at once, which
  // store forwarding cannot serve.
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    for (int64_t h = 0; h < a.num_kv_heads; ++h) {
      for (int64_t j = 0; j < m; ++j) head_offs[j] = offs[j0 + j] + h * D;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t hq = h * group + g;
        const void* qrow = raw ? static_cast<const void*>(static_cast<const uint16_t*>(qrows) + hq * D)
                               : static_cast<const void*>(static_cast<const float*>(qrows) + hq * D);
        scores16<T, D16>(a.key_cache, D, a.scale, raw, qrow, head_offs, m, scores + hq * kPartition + j0);
        pq.issue(per_call);
      }
    }
  }
}

// Softmax step of one query head over n scores: turns them into weights under the new
// running max and rescales that head's accumulator and denominator.
void partition_softmax(float* s, int64_t n, float softcap, float* max_, float* den, float* acc, int64_t head_dim) {
  if (softcap > 0)
    for (int64_t j = 0; j < n; ++j) s[j] = softcapped(s[j], softcap);
  __m512 mx = _mm512_set1_ps(*max_);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 live = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    mx = _mm512_mask_max_ps(mx, live, mx, _mm512_maskz_loadu_ps(live, s + j));
  }
  const float m_new = _mm512_reduce_max_ps(mx);
  const __m512 m = _mm512_set1_ps(m_new);
  __m512 total = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
    _mm512_storeu_ps(s + j, e);
    total = _mm512_add_ps(total, e);
  }
  if (j < n) {
    __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1);
    __m512 e = _mm512_maskz_mov_ps(tail, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), m)));
    _mm512_mask_storeu_ps(s + j, tail, e);
    total = _mm512_add_ps(total, e);
  }
  const float alpha = exp_nonpositive_scalar(*max_ - m_new);  // 0 on the first partition (max -inf)
  *max_ = m_new;
  *den = *den * alpha + _mm512_reduce_add_ps(total);
  if (alpha != 1.0f) {
    const __m512 al = _mm512_set1_ps(alpha);
    for (int64_t d = 0; d < head_dim; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), al));
  }
}

// Query heads whose accumulators partition_values keeps in registers at once: with the
// D16 chunks of a V row they must fit the 32 vector registers.
constexpr int64_t rows_in_registers(int D16) { return D16 <= 4 ? 3 : D16 <= 8 ? 2 : 1; }

// The 32 bf16 values of x and of y as (x[i], y[i]) words: i < 16 into lo, the rest into hi
// (the layout vdpbf16ps multiplies pairwise: two tokens of one dim).
inline void interleave_bf16_pairs(__m512i x, __m512i y, __m512i& lo, __m512i& hi) {
  const __m512i low_index = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                             6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  lo = _mm512_permutex2var_epi16(x, low_index, y);
  hi = _mm512_permutex2var_epi16(x, _mm512_add_epi16(low_index, _mm512_set1_epi16(16)), y);
}

#if defined(__AVX512BF16__)
// acc[hq0 .. hq0 + kRows) += the partition's weighted V rows of KV head h, on bf16 with
// AVX512-BF16: two tokens per vdpbf16ps. Each pair of V rows is interleaved into
// (V[j][d], V[j+1][d]) words and the weights rounded to bf16 pairs (as torch's CPU flash
// attention rounds P for bf16), halving the multiply-adds and skipping the widening of V.
// kRows is a template argument so the kRows x D16 accumulators stay in registers: with a
// run-time row count the compiler kept them on the stack, a store and reload per update.
template <int D16, int kRows>
void head_values_bf16(const DecodeArgs& a, const int64_t* offs, int64_t n, const float* scores, float* acc,
                      int64_t h, int64_t hq0, LineQueue& pq, int64_t per_pair) {
  const int64_t D = a.head_dim;
  const uint16_t* vc = static_cast<const uint16_t*>(a.value_cache);
  const int64_t pairs = (n + 1) / 2;
  uint32_t pw[kRows][kPartition / 2];
  __m512 r[kRows][D16];
  for (int g = 0; g < kRows; ++g) {
    const float* w = scores + (hq0 + g) * kPartition;
    for (int64_t j = 0; j < kPartition; j += 32) {  // weights past n are zero, never stale
      const __mmask16 m0 = n - j >= 16 ? 0xFFFF : n - j > 0 ? static_cast<__mmask16>((1u << (n - j)) - 1) : 0;
      const __mmask16 m1 = n - j >= 32 ? 0xFFFF : n - j > 16 ? static_cast<__mmask16>((1u << (n - j - 16)) - 1) : 0;
      const __m512 lo = _mm512_maskz_loadu_ps(m0, w + j), hi = _mm512_maskz_loadu_ps(m1, w + j + 16);
      _mm512_storeu_si512(pw[g] + j / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    for (int c = 0; c < D16; ++c) r[g][c] = _mm512_loadu_ps(acc + (hq0 + g) * D + c * 16);
  }
  for (int64_t jp = 0; jp < pairs; ++jp) {
    const int64_t j = 2 * jp;
    pq.issue(per_pair);
    __m512i vv[D16];
    for (int c = 0; c < D16 / 2; ++c) {
      const __m512i x = _mm512_loadu_si512(vc + offs[j] + h * D + 32 * c);
      const __m512i y = j + 1 < n ? _mm512_loadu_si512(vc + offs[j + 1] + h * D + 32 * c) : _mm512_setzero_si512();
      interleave_bf16_pairs(x, y, vv[2 * c], vv[2 * c + 1]);
    }
    for (int g = 0; g < kRows; ++g) {
      const __m512bh wb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[g][jp]));
      for (int c = 0; c < D16; ++c) r[g][c] = _mm512_dpbf16_ps(r[g][c], wb, (__m512bh)vv[c]);
    }
  }
  for (int g = 0; g < kRows; ++g)
    for (int c = 0; c < D16; ++c) _mm512_storeu_ps(acc + (hq0 + g) * D + c * 16, r[g][c]);
}
#endif

// The same on fp32 words: each V row widened once per KV head, one broadcast FMA per
// query head, token and 16 dims.
template <int T, int D16, int kRows>
void head_values(const DecodeArgs& a, const int64_t* offs, int64_t n, const float* scores, float* acc, int64_t h,
                 int64_t hq0, LineQueue& pq, int64_t per_pair) {
#if defined(__AVX512BF16__)
  if constexpr (T == kBF16 && D16 % 2 == 0) return head_values_bf16<D16, kRows>(a, offs, n, scores, acc, h, hq0, pq, per_pair);
#endif
  const int64_t D = a.head_dim;
  __m512 r[kRows][D16];
  for (int g = 0; g < kRows; ++g)
    for (int c = 0; c < D16; ++c) r[g][c] = _mm512_loadu_ps(acc + (hq0 + g) * D + c * 16);
  for (int64_t j = 0; j < n; ++j) {
    if (j % 2 == 0) pq.issue(per_pair);
    __m512 vv[D16];
    for (int c = 0; c < D16; ++c) vv[c] = load_vec<T>(a.value_cache, offs[j] + h * D + c * 16);
    for (int g = 0; g < kRows; ++g) {
      const __m512 w = _mm512_set1_ps(scores[(hq0 + g) * kPartition + j]);
      for (int c = 0; c < D16; ++c) r[g][c] = _mm512_fmadd_ps(w, vv[c], r[g][c]);
    }
  }
  for (int g = 0; g < kRows; ++g)
    for (int c = 0; c < D16; ++c) _mm512_storeu_ps(acc + (hq0 + g) * D + c * 16, r[g][c]);
}

// acc[hq] += sum over the partition's n tokens of weight * V row, for every query head.
// The accumulators of up to rows_in_registers(D16) query heads of one KV head stay in
// registers across the tokens, so each V row is read once per KV head and block of heads.
template <int T, int D16>
void partition_values(const DecodeArgs& a, const int64_t* offs, int64_t n, const float* scores, float* acc,
                      LineQueue& pq) {
  const int64_t group = a.num_heads / a.num_kv_heads, D = a.head_dim;
  if constexpr (D16 > 0) {
    constexpr int64_t kBlock = rows_in_registers(D16);
    const int64_t calls = a.num_kv_heads * ((group + kBlock - 1) / kBlock) * ((n + 1) / 2);
    const int64_t per_pair = (pq.lines() + calls - 1) / std::max<int64_t>(calls, 1);
    for (int64_t h = 0; h < a.num_kv_heads; ++h) {
      for (int64_t g0 = 0; g0 < group; g0 += kBlock) {
        const int64_t hq0 = h * group + g0;
        switch (std::min(kBlock, group - g0)) {
          case 3: head_values<T, D16, 3>(a, offs, n, scores, acc, h, hq0, pq, per_pair); break;
          case 2: head_values<T, D16, 2>(a, offs, n, scores, acc, h, hq0, pq, per_pair); break;
          default: head_values<T, D16, 1>(a, offs, n, scores, acc, h, hq0, pq, per_pair); break;
        }
      }
    }
  } else {
    const int64_t d16 = D / 16;
    __m512 vv[kMaxChunks];
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = 0; h < a.num_kv_heads; ++h) {
        for (int64_t c = 0; c < d16; ++c) vv[c] = load_vec<T>(a.value_cache, offs[j] + h * D + c * 16);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t hq = h * group + g;
          const __m512 w = _mm512_set1_ps(scores[hq * kPartition + j]);
          float* arow = acc + hq * D;
          for (int64_t c = 0; c < d16; ++c)
            _mm512_storeu_ps(arow + c * 16, _mm512_fmadd_ps(w, vv[c], _mm512_loadu_ps(arow + c * 16)));
        }
      }
    }
  }
}

struct DecodeScratch {
  std::vector<float> qf, acc, scores, stats;
  LineQueue queue;
  std::vector<uint16_t> qraw;  // the bf16 query rows, for the bf16 dot path
};

template <int T, int kD>
void decode_item(const DecodeArgs& a, int64_t item, DecodeScratch& w) {
  constexpr int D16 = kD / 16;  // 0: a run-time head size
  const DecodeSpan span = decode_span(a, item);
  const int64_t i = span.seq, D = a.head_dim, H = a.num_heads, tok_lo = span.tok_lo, tok_hi = span.tok_hi;
  w.qf.resize(H * D);
  w.acc.assign(H * D, 0.0f);
  w.scores.resize(H * kPartition);
  w.stats.resize(2 * H);
  reset_stats(w.stats.data(), H, 2);
  const void* qrows = w.qf.data();
  if (uses_bf16_dot<T>(D)) {
    w.qraw.resize(H * D);
    for (int64_t hq = 0; hq < H; ++hq)
      std::memcpy(w.qraw.data() + hq * D,
                  static_cast<const uint16_t*>(a.q) + i * a.q_stride_token + hq * a.q_stride_head, D * 2);
    qrows = w.qraw.data();
  } else {
    load_queries<T>(a, i, D, w.qf.data());
  }
  const int32_t* table = a.block_tables + i * a.table_stride;
  const int64_t row = a.num_kv_heads * D;
  int64_t offs[kPartition], next_offs[kPartition];
  const int64_t elem_bytes = elem_size(T), row_bytes = row * elem_bytes;
  int64_t n = row_offsets(a, table, row, tok_lo, tok_hi, offs);
  w.queue.reset(row_bytes);  // the first partition's K: nothing to compute meanwhile, so at once
  w.queue.add(a.key_cache, offs, n, elem_bytes);
  w.queue.drain();
  for (int64_t pb = tok_lo; pb < tok_hi; pb += kPartition) {
    // Blocks sit anywhere in the pool, so the hardware prefetcher sees short runs: V rows
    // are requested while the scores are computed, the next partition's K rows while
    // this partition's V rows are summed, a few lines per inner iteration (LineQueue).
    // Requested as one burst per partition, the first ~48 lines filled the core's
    // outstanding L2 misses and the burst then waited for nearly all of its 384: one bf16
    // layer of 64 sequences of 240 tokens (30 layers' caches in rotation) took 820-878 us
    // that way and 690-759 us spread out. Two partitions ahead was slower still.
    LineQueue& pq = w.queue;
    pq.reset(row_bytes);
    pq.add(a.value_cache, offs, n, elem_bytes);
    const int64_t score_calls = (n + 15) / 16 * H;
    partition_scores<T, D16>(a, offs, n, qrows, w.scores.data(), pq, (pq.lines() + score_calls - 1) / score_calls);
    pq.drain();  // V must be on its way before the values
    for (int64_t hq = 0; hq < H; ++hq)
      partition_softmax(w.scores.data() + hq * kPartition, n, a.softcap, &w.stats[2 * hq], &w.stats[2 * hq + 1],
                        w.acc.data() + hq * D, D);
    const int64_t next_n = row_offsets(a, table, row, pb + kPartition, tok_hi, next_offs);
    pq.reset(row_bytes);
    pq.add(a.key_cache, next_offs, next_n, elem_bytes);
    partition_values<T, D16>(a, offs, n, w.scores.data(), w.acc.data(), pq);
    pq.drain();
    std::memcpy(offs, next_offs, next_n * sizeof(int64_t));
    n = next_n;
  }
  finish_decode_item<T>(a, span, D, w.acc.data(), w.stats.data());
}



// ---- Prefill and chunked prefill: queries at the end of their sequence's context -------
//
// Work item = (sequence, KV head, tile of kQueryTile query rows, kAmxQueryTile on the AMX
// path); its rows are the tile's
// tokens times the KV head's `group` query heads, all attending the same K/V rows. The
// item walks its visible KV blocks once (causal: none past the tile's last token; sliding
// window: none before the first token's window): per block, each row's 16 scores come from
// dot16 in one vector, then a masked streaming-softmax step and the weighted V rows (V
// widened to fp32 once per block, not once per row).

constexpr int64_t kQueryTile = 16;
constexpr int64_t kAmxQueryTile = 64;  // query rows per item on the AMX path
constexpr int64_t kKeyChunk = 64;  // keys per softmax step, any block size

template <int T, int D16>
void prefill_item(const PrefillArgs& a, const PrefillItem& it, std::vector<float>& scratch,
                  std::vector<uint16_t>& qraw) {
  const int64_t D = a.head_dim, d16 = D16 ? D16 : D / 16, group = a.num_heads / a.num_kv_heads;
  const PrefillSpan span = prefill_span(a, it);
  const int64_t tile = it.rows, rows = tile * group;
  const bool raw = uses_bf16_dot<T>(D);
  // scratch: fp32 queries [rows][D] | accumulators [rows][D] | V rows [kKeyChunk][D] | scores [kKeyChunk]
  scratch.resize(rows * D * 2 + kKeyChunk * D + kKeyChunk + 2 * rows);
  float* qf = scratch.data();
  float* acc = qf + rows * D;
  float* vblock = acc + rows * D;
  float* probs = vblock + kKeyChunk * D;
  float* stats = probs + kKeyChunk;  // (max, denominator) per row
  if (raw) qraw.resize(rows * D);
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t src = prefill_query_offset(a, it, span.q0, m);
    if (raw) {
      std::memcpy(qraw.data() + m * D, static_cast<const uint16_t*>(a.q) + src, D * 2);
    } else {
      load_scaled<T>(a.q, src, D, a.scale, qf + m * D);
    }
  }
  std::memset(acc, 0, rows * D * sizeof(float));
  reset_stats(stats, rows, 2);
  const int64_t lo_pos = span.lo_pos;
  int64_t offs[kKeyChunk];
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t base = span.k_lo / kKeyChunk * kKeyChunk; base <= span.hi_pos; base += kKeyChunk) {
    const int64_t n = std::min(kKeyChunk, span.seq_len - base);
    for (int64_t j = 0; j < n; ++j) {
      offs[j] = prefill_key_offset(a, it, span.table, base + j);
      for (int64_t c = 0; c < d16; ++c)
        _mm512_storeu_ps(vblock + j * D + c * 16, load_vec<T>(a.value_cache, offs[j] + c * 16));
    }
    for (int64_t r = 0; r < tile; ++r) {
      const KeyRange seen = visible_keys(a, lo_pos + r, base, n);
      if (seen.empty()) continue;
      const int64_t first = seen.first, last = seen.last;
      const int64_t sub_lo = first / 16, sub_hi = last / 16;  // the 16-key groups holding visible keys
      __mmask16 visible[kKeyChunk / 16];
      for (int64_t k = sub_lo; k <= sub_hi; ++k) {
        const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(16 * k)));
        visible[k] = _mm512_cmp_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(first)), _MM_CMPINT_NLT) &
                     _mm512_cmp_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(last)), _MM_CMPINT_LE);
      }
      for (int64_t g = 0; g < group; ++g) {
        const int64_t m = r * group + g;
        const void* qrow = raw ? static_cast<const void*>(qraw.data() + m * D) : static_cast<const void*>(qf + m * D);
        __m512 sv[kKeyChunk / 16], mx = neg_inf;
        for (int64_t k = sub_lo; k <= sub_hi; ++k) {
          scores16<T, D16>(a.key_cache, D, a.scale, raw, qrow, offs + 16 * k, std::min<int64_t>(16, n - 16 * k),
                           probs + 16 * k);
          sv[k] = _mm512_loadu_ps(probs + 16 * k);
          if (a.softcap > 0) {
            for (int64_t j = 16 * k; j < 16 * k + 16; ++j) probs[j] = softcapped(probs[j], a.softcap);
            sv[k] = _mm512_loadu_ps(probs + 16 * k);
          }
          sv[k] = _mm512_mask_mov_ps(neg_inf, visible[k], sv[k]);
          mx = _mm512_max_ps(mx, sv[k]);
        }
        const float m_old = stats[2 * m], m_new = std::max(m_old, _mm512_reduce_max_ps(mx));
        const __m512 mv = _mm512_set1_ps(m_new);
        __m512 total = _mm512_setzero_ps();
        for (int64_t k = sub_lo; k <= sub_hi; ++k) {
          const __m512 p = _mm512_maskz_mov_ps(visible[k], exp_nonpositive(_mm512_sub_ps(sv[k], mv)));
          _mm512_storeu_ps(probs + 16 * k, p);
          total = _mm512_add_ps(total, p);
        }
        const float alpha = exp_nonpositive_scalar(m_old - m_new);
        stats[2 * m] = m_new;
        stats[2 * m + 1] = stats[2 * m + 1] * alpha + _mm512_reduce_add_ps(total);
        float* arow = acc + m * D;
        const __m512 al = _mm512_set1_ps(alpha);
        __m512 o[kMaxChunks];
        for (int64_t c = 0; c < d16; ++c) o[c] = _mm512_mul_ps(_mm512_loadu_ps(arow + c * 16), al);
        for (int64_t j = first; j <= last; ++j) {
          const __m512 w = _mm512_set1_ps(probs[j]);
          for (int64_t c = 0; c < d16; ++c) o[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vblock + j * D + c * 16), o[c]);
        }
        for (int64_t c = 0; c < d16; ++c) _mm512_storeu_ps(arow + c * 16, o[c]);
      }
    }
  }
  finish_prefill_item<T>(a, it, span.q0, rows, acc, stats, 2);
}


// ---- Prefill as small matmuls: the fast path for the head sizes models use --------------
//
// prefill_item above gets each row's 16 scores from 16 dot products and a transpose-and-add
// tree, and sums V rows with one broadcast FMA per key and 16 values. Here each 64-key
// chunk is first laid out once per item for the vector unit: K transposed into
// (dim, key) words and V into (key, dim) words, so QK^T for 4 rows x 64 keys is 16
// accumulator updates per dim with no horizontal sums, and P.V updates several rows per V
// load. A word is one fp32 value, or on bf16 with AVX512-BF16 a pair of bf16 values for
// vdpbf16ps: two dims of a key in K^T, two keys of a dim in V (P is then rounded to bf16,
// as torch's CPU flash attention does for bf16). fp16 and bf16 without that extension are
// widened to fp32 words as the chunk is laid out.

constexpr int64_t kRowBlock = 4;  // query rows per QK^T register block (16 accumulators)

// Word-wise multiply-add: acc += x * y over one word per lane (a bf16 pair: both products).
template <bool kPaired>
inline __m512 word_fma(__m512 acc, __m512i x, __m512i y) {
#if defined(__AVX512BF16__)
  if constexpr (kPaired) return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)y);
#endif
  return _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(y), acc);
}

// ---- AMX tiles for the bf16 matmul-shaped prefill ----------------------------------
//
// On CPUs with AMX-BF16 (Sapphire Rapids and later) QK^T and P.V of a 16-row block run on
// the tile unit: one tdpbf16ps is a 16x16x32 bf16 multiply-add into fp32, 16 times the work
// of a vdpbf16ps. The chunk layouts above are already what it reads: the query rows and P
// rows are its A operand (16 rows of 32 bf16), K^T and the paired V its B operand (16
// pair-rows of 16 words). Products and sums are fp32 with bf16 inputs flushed like
// vdpbf16ps; only the order of the additions differs from the vector path.

#if defined(KVPAGE_AMX)
constexpr bool kHaveAmx = true;

// Linux grants a process AMX tile state on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); a tile instruction without it faults. KVPAGE_AMX=0 turns it off.
bool amx_usable() {
  static const bool usable = [] {
    const char* env = std::getenv("KVPAGE_AMX");
    if (env != nullptr && env[0] == '0') return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

// Tiles 0-7 as 16 rows of 64 bytes for this thread, for the scope of the object; the
// thread's previous configuration (another library's, or none) is put back after.
class TileScope {
 public:
  TileScope() {
    _tile_storeconfig(&saved_);
    TileConfig mine{};
    mine.palette = 1;
    for (int t = 0; t < 8; ++t) {
      mine.bytes_per_row[t] = 64;
      mine.rows[t] = 16;
    }
    _tile_loadconfig(&mine);
  }
  ~TileScope() {
    if (saved_.palette != 0) {
      _tile_loadconfig(&saved_);
    } else {
      _tile_release();
    }
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;

 private:
  TileConfig saved_;
};

// s[16][kKeyChunk] = the 16 query rows at qw (kQWords words each) times K^T (kt, laid out
// [kQWords][kKeyChunk] words).
template <int64_t kQWords>
inline void amx_scores(const uint32_t* qw, const uint32_t* kt, float* s) {
  static_assert(kKeyChunk == 64 && kQWords % 16 == 0, "four 16-key tiles, 32-dim A tiles");
  constexpr int64_t kt_stride = kKeyChunk * 4;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < kQWords; c += 16) {
    const uint32_t* k = kt + c * kKeyChunk;
    _tile_loadd(4, qw + c, kQWords * 4);
    _tile_loadd(5, k, kt_stride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, k + 16, kt_stride);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, k + 32, kt_stride);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, k + 48, kt_stride);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, s, kKeyChunk * 4);
  _tile_stored(1, s + 16, kKeyChunk * 4);
  _tile_stored(2, s + 32, kKeyChunk * 4);
  _tile_stored(3, s + 48, kKeyChunk * 4);
}

// acc[16][kD] += the 16 P rows at pw (kKeySteps words each: bf16 pairs of keys) times the
// paired V rows (vw, [kKeySteps][kD] words), over the first `halves` 32-key halves.
template <int64_t kD, int64_t kKeySteps>
inline void amx_values(const uint32_t* pw, const uint32_t* vw, float* acc, int64_t halves) {
  static_assert(kD % 64 == 0, "four 16-dim accumulator tiles per pass");
  for (int64_t d0 = 0; d0 < kD; d0 += 64) {
    float* o = acc + d0;
    _tile_loadd(0, o, kD * 4);
    _tile_loadd(1, o + 16, kD * 4);
    _tile_loadd(2, o + 32, kD * 4);
    _tile_loadd(3, o + 48, kD * 4);
    for (int64_t h = 0; h < halves; ++h) {
      const uint32_t* v = vw + 16 * h * kD + d0;
      _tile_loadd(4, pw + 16 * h, kKeySteps * 4);
      _tile_loadd(5, v, kD * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, v + 16, kD * 4);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, v + 32, kD * 4);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, v + 48, kD * 4);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, o, kD * 4);
    _tile_stored(1, o + 16, kD * 4);
    _tile_stored(2, o + 32, kD * 4);
    _tile_stored(3, o + 48, kD * 4);
  }
}
#else
constexpr bool kHaveAmx = false;
inline bool amx_usable() { return false; }
#endif

// Whether prefill_item_mm<T, D16> takes the AMX path on this CPU.
template <int T, int D16>
bool prefill_uses_amx() {
  return T == kBF16 && kHaveAmx && kHaveBf16Dot && D16 > 0 && D16 % 4 == 0 && amx_usable();
}

// The same, from the call's element type and head size.
inline bool prefill_on_amx(int elem_type, int64_t head_dim) {
  switch (head_dim) {
    case 64: return elem_type == kBF16 && prefill_uses_amx<kBF16, 4>();
    case 128: return elem_type == kBF16 && prefill_uses_amx<kBF16, 8>();
    case 256: return elem_type == kBF16 && prefill_uses_amx<kBF16, 16>();
    default: return false;
  }
}

// The tile unit makes scores cheap, so its items take more rows each: fewer passes over
// each K/V chunk (its layout is the cost) for a little more masked work on the diagonal.
int64_t prefill_query_tile(int elem_type, int64_t head_dim) {
  return prefill_on_amx(elem_type, head_dim) ? kAmxQueryTile : kQueryTile;
}

template <int T, int D16>
void prefill_item_mm(const PrefillArgs& a, const PrefillItem& it, std::vector<uint32_t>& words,
                     std::vector<float>& floats) {
  constexpr bool kPaired = T == kBF16 && kHaveBf16Dot && D16 % 2 == 0;
  constexpr int64_t kD = D16 * 16;
  constexpr int64_t kQWords = kPaired ? kD / 2 : kD;                 // words per query row and K^T rows
  constexpr int64_t kKeySteps = kPaired ? kKeyChunk / 2 : kKeyChunk;  // V rows of words, P words per row
  constexpr int64_t kPvRows = D16 >= 16 ? 1 : 16 / D16;               // rows per P.V register block
  const int64_t group = a.num_heads / a.num_kv_heads;
  const PrefillSpan span = prefill_span(a, it);
  const int64_t rows = it.rows * group;
  constexpr bool kAmxShaped = kPaired && kD % 64 == 0;
  const bool amx = kAmxShaped && prefill_uses_amx<T, D16>();
  const int64_t row_block = amx ? 16 : kRowBlock;  // AMX tiles take 16 rows
  const int64_t padded = (rows + row_block - 1) / row_block * row_block;
  // words: queries [padded][kQWords] | K^T [kQWords][kKeyChunk] | V [kKeySteps][kD] | P [padded][kKeySteps]
  words.assign(padded * kQWords + kQWords * kKeyChunk + kKeySteps * kD + padded * kKeySteps, 0u);
  uint32_t* qw = words.data();
  uint32_t* kt = qw + padded * kQWords;
  uint32_t* vw = kt + kQWords * kKeyChunk;
  uint32_t* pw = vw + kKeySteps * kD;
  // floats: accumulators [padded][kD] | (max, denominator, alpha) per row
  floats.assign(padded * kD + 3 * padded, 0.0f);
  float* acc = floats.data();
  float* stats = acc + padded * kD;
  reset_stats(stats, padded, 3);
  for (int64_t m = 0; m < rows; ++m) {  // padding rows: zero queries, never written out
    const int64_t src = prefill_query_offset(a, it, span.q0, m);
    if constexpr (kPaired) {
      std::memcpy(qw + m * kQWords, static_cast<const uint16_t*>(a.q) + src, kD * 2);
    } else {
      for (int64_t c = 0; c < D16; ++c) _mm512_storeu_ps(reinterpret_cast<float*>(qw + m * kQWords) + 16 * c,
                                                         load_vec<T>(a.q, src + 16 * c));
    }
  }
  const int64_t lo_pos = span.lo_pos;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale = _mm512_set1_ps(a.scale);
  int64_t offs[kKeyChunk];
  for (int64_t base = span.k_lo / kKeyChunk * kKeyChunk; base <= span.hi_pos; base += kKeyChunk) {
    const int64_t n = std::min(kKeyChunk, span.seq_len - base);
    for (int64_t j = 0; j < n; ++j) offs[j] = prefill_key_offset(a, it, span.table, base + j);
    // K^T: kt[c][j] is word c of key j (dims 2c, 2c+1 when paired); V: vw[s][d] is dim d
    // of key s (keys 2s, 2s+1 when paired). Keys past n are zero, so P.V adds nothing for them.
    if constexpr (kPaired) {
      const uint16_t* kc = static_cast<const uint16_t*>(a.key_cache);
      const uint16_t* vc = static_cast<const uint16_t*>(a.value_cache);
      for (int64_t j = 0; j < kKeyChunk; ++j) {
        const uint32_t* krow = reinterpret_cast<const uint32_t*>(kc + offs[std::min(j, n - 1)]);
        for (int64_t c = 0; c < kQWords; ++c) kt[c * kKeyChunk + j] = j < n ? krow[c] : 0u;
      }
      const __m512i zero = _mm512_setzero_si512();
      for (int64_t sp = 0; sp < kKeySteps; ++sp) {
        const int64_t j = 2 * sp;
        for (int64_t c = 0; c < kD / 32; ++c) {
          const __m512i x = j < n ? _mm512_loadu_si512(vc + offs[j] + 32 * c) : zero;
          const __m512i y = j + 1 < n ? _mm512_loadu_si512(vc + offs[j + 1] + 32 * c) : zero;
          __m512i lo, hi;
          interleave_bf16_pairs(x, y, lo, hi);
          _mm512_storeu_si512(vw + sp * kD + 32 * c, lo);
          _mm512_storeu_si512(vw + sp * kD + 32 * c + 16, hi);
        }
      }
    } else {
      alignas(64) float krow[kD];
      for (int64_t j = 0; j < kKeyChunk; ++j) {
        float* vrow = reinterpret_cast<float*>(vw + j * kD);
        for (int64_t c = 0; c < D16; ++c) {
          const bool live = j < n;
          _mm512_store_ps(krow + 16 * c, live ? load_vec<T>(a.key_cache, offs[j] + 16 * c) : _mm512_setzero_ps());
          _mm512_storeu_ps(vrow + 16 * c, live ? load_vec<T>(a.value_cache, offs[j] + 16 * c) : _mm512_setzero_ps());
        }
        float* ktf = reinterpret_cast<float*>(kt);
        for (int64_t d = 0; d < kD; ++d) ktf[d * kKeyChunk + j] = krow[d];
      }
    }
    // The softmax step of row m over this chunk's scores sc (kKeyChunk / 16 vectors, not yet
    // scaled): running max and denominator, the rescale alpha, and the row's P words.
    auto softmax_step = [&](int64_t m, __m512* sc) {
      float* st = stats + 3 * m;
      st[2] = 1.0f;  // alpha: no rescale unless the max moves
      uint32_t* prow = pw + m * kKeySteps;
      const KeyRange seen = visible_keys(a, lo_pos + std::min(m, rows - 1) / group, base, n);
      const int64_t first = seen.first, last = seen.last;
      if (m >= rows || seen.empty()) {
        std::memset(prow, 0, kKeySteps * sizeof(uint32_t));
        return;
      }
      __m512 mx = neg_inf;
      __mmask16 visible[kKeyChunk / 16];
      for (int64_t v = 0; v < kKeyChunk / 16; ++v) {
        __m512 x = _mm512_mul_ps(sc[v], scale);
        if (a.softcap > 0) {
          alignas(64) float tmp[16];
          _mm512_store_ps(tmp, x);
          for (int j = 0; j < 16; ++j) tmp[j] = softcapped(tmp[j], a.softcap);
          x = _mm512_load_ps(tmp);
        }
        const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(16 * v)));
        visible[v] = _mm512_cmp_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(first)), _MM_CMPINT_NLT) &
                     _mm512_cmp_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(last)), _MM_CMPINT_LE);
        sc[v] = _mm512_mask_mov_ps(neg_inf, visible[v], x);
        mx = _mm512_max_ps(mx, sc[v]);
      }
      const float m_old = st[0], m_new = std::max(m_old, _mm512_reduce_max_ps(mx));
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 total = _mm512_setzero_ps();
      for (int64_t v = 0; v < kKeyChunk / 16; v += 2) {
        const __m512 p0 = _mm512_maskz_mov_ps(visible[v], exp_nonpositive(_mm512_sub_ps(sc[v], mv)));
        const __m512 p1 = _mm512_maskz_mov_ps(visible[v + 1], exp_nonpositive(_mm512_sub_ps(sc[v + 1], mv)));
        total = _mm512_add_ps(total, _mm512_add_ps(p0, p1));
#if defined(__AVX512BF16__)
        if constexpr (kPaired) {
          _mm512_storeu_si512(prow + 8 * v, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));  // keys 16v .. 16v+31
          continue;
        }
#endif
        _mm512_storeu_ps(reinterpret_cast<float*>(prow) + 16 * v, p0);
        _mm512_storeu_ps(reinterpret_cast<float*>(prow) + 16 * v + 16, p1);
      }
      st[2] = m_old == m_new ? 1.0f : exp_nonpositive_scalar(m_old - m_new);
      st[0] = m_new;
      st[1] = st[1] * st[2] + _mm512_reduce_add_ps(total);
    };
#if defined(KVPAGE_AMX)
    if constexpr (kAmxShaped) {
      if (amx) {
        // Scores of 16 rows at a time on the tile unit, then each row's softmax step; then
        // acc = acc * alpha + P.V, 16 rows at a time.
        alignas(64) float block_scores[16 * kKeyChunk];
        for (int64_t m0 = 0; m0 < padded; m0 += 16) {
          amx_scores<kQWords>(qw + m0 * kQWords, kt, block_scores);
          for (int64_t r = 0; r < 16; ++r) {
            __m512 sc[kKeyChunk / 16];
            for (int64_t v = 0; v < kKeyChunk / 16; ++v) sc[v] = _mm512_load_ps(block_scores + r * kKeyChunk + 16 * v);
            softmax_step(m0 + r, sc);
          }
        }
        for (int64_t m0 = 0; m0 < padded; m0 += 16) {
          for (int64_t m = m0; m < m0 + 16; ++m) {
            const float alpha = stats[3 * m + 2];
            if (alpha == 1.0f) continue;
            const __m512 al = _mm512_set1_ps(alpha);
            for (int64_t c = 0; c < D16; ++c)
              _mm512_storeu_ps(acc + m * kD + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + m * kD + 16 * c), al));
          }
          amx_values<kD, kKeySteps>(pw + m0 * kKeySteps, vw, acc + m0 * kD, (n + 31) / 32);
        }
        continue;
      }
    }
#endif
    // Scores, softmax step and probabilities (as P words), four rows at a time.
    for (int64_t m0 = 0; m0 < padded; m0 += kRowBlock) {
      __m512 sc[kRowBlock][kKeyChunk / 16];
      for (int64_t r = 0; r < kRowBlock; ++r)
        for (int64_t v = 0; v < kKeyChunk / 16; ++v) sc[r][v] = _mm512_setzero_ps();
      for (int64_t c = 0; c < kQWords; ++c) {
        __m512i kv[kKeyChunk / 16];
        for (int64_t v = 0; v < kKeyChunk / 16; ++v) kv[v] = _mm512_loadu_si512(kt + c * kKeyChunk + 16 * v);
        for (int64_t r = 0; r < kRowBlock; ++r) {
          const __m512i qb = _mm512_set1_epi32(static_cast<int>(qw[(m0 + r) * kQWords + c]));
          for (int64_t v = 0; v < kKeyChunk / 16; ++v) sc[r][v] = word_fma<kPaired>(sc[r][v], qb, kv[v]);
        }
      }
      for (int64_t r = 0; r < kRowBlock; ++r) softmax_step(m0 + r, sc[r]);
    }
    // acc = acc * alpha + P.V, kPvRows rows per V load.
    const int64_t steps = kPaired ? (n + 1) / 2 : n;
    for (int64_t m0 = 0; m0 < padded; m0 += kPvRows) {
      const int64_t block = std::min(kPvRows, padded - m0);
      __m512 o[kPvRows][D16];
      for (int64_t r = 0; r < block; ++r) {
        const __m512 al = _mm512_set1_ps(stats[3 * (m0 + r) + 2]);
        for (int64_t c = 0; c < D16; ++c) o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (m0 + r) * kD + 16 * c), al);
      }
      for (int64_t sp = 0; sp < steps; ++sp) {
        __m512i vv[D16];
        for (int64_t c = 0; c < D16; ++c) vv[c] = _mm512_loadu_si512(vw + sp * kD + 16 * c);
        for (int64_t r = 0; r < block; ++r) {
          const __m512i pb = _mm512_set1_epi32(static_cast<int>(pw[(m0 + r) * kKeySteps + sp]));
          for (int64_t c = 0; c < D16; ++c) o[r][c] = word_fma<kPaired>(o[r][c], pb, vv[c]);
        }
      }
      for (int64_t r = 0; r < block; ++r)
        for (int64_t c = 0; c < D16; ++c) _mm512_storeu_ps(acc + (m0 + r) * kD + 16 * c, o[r][c]);
    }
  }
  finish_prefill_item<T>(a, it, span.q0, rows, acc, stats, 3);
}

// Per-thread buffers of the two prefill kernels (each uses its own pair).
struct PrefillScratch {
  std::vector<float> floats;
  std::vector<uint16_t> halves;  // prefill_item's raw bf16 queries
  std::vector<uint32_t> words;   // prefill_item_mm's laid-out chunk
#if defined(KVPAGE_AMX)
  std::optional<TileScope> tiles;  // the thread's tile configuration, from its first AMX item on
#endif
};

// Every item on the thread pool, longest first as listed; kMatmul picks the kernel.
template <int T, int D16, bool kMatmul>
void prefill_all(const PrefillArgs& a, const std::vector<PrefillItem>& items, int num_threads) {
  on_pool<PrefillScratch>(items.size(), num_threads, [&](int64_t k, PrefillScratch& w) {
    if constexpr (kMatmul) {
#if defined(KVPAGE_AMX)
      if (!w.tiles && prefill_uses_amx<T, D16>()) w.tiles.emplace();
#endif
      prefill_item_mm<T, D16>(a, items[k], w.words, w.floats);
    } else {
      prefill_item<T, D16>(a, items[k], w.floats, w.halves);
    }
  });
}

template <int T>
void prefill_typed(const PrefillArgs& a, const std::vector<PrefillItem>& items, int num_threads) {
  switch (a.head_dim) {  // the matmul-shaped kernel for the head sizes models use
    case 32: return prefill_all<T, 2, true>(a, items, num_threads);
    case 64: return prefill_all<T, 4, true>(a, items, num_threads);
    case 96: return prefill_all<T, 6, true>(a, items, num_threads);
    case 128: return prefill_all<T, 8, true>(a, items, num_threads);
    case 256: return prefill_all<T, 16, true>(a, items, num_threads);
    default: return prefill_all<T, 0, false>(a, items, num_threads);  // dot products, any multiple of 16
  }
}


// ---- Greedy sampling: each logits row's maximum and first maximal index -----------------
//
// torch's max(dim=-1) with indices ran at about a twentieth of amax's speed on this
// project's machines (2.7 ms for a [64, 49152] float32 batch, longer than a decode step's
// attention for one layer); one pass here keeps per-lane maxima and their first indices.

void row_argmax(const float* x, int64_t cols, float* out_max, int64_t* out_idx) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = neg_inf;
  __m512i best_idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i idx = best_idx;
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t j = 0; j < cols; j += 16) {
    const __mmask16 live = cols - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (cols - j)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(neg_inf, live, x + j);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strict: a lane keeps its first maximum
    best = _mm512_mask_mov_ps(best, greater, v);
    best_idx = _mm512_mask_mov_epi32(best_idx, greater, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  if (nan && first_nan(x, cols, out_max, out_idx)) return;
  const float m = _mm512_reduce_max_ps(best);
  const __mmask16 ties = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
  // Among the lanes holding the maximum, the smallest index is the row's first maximum
  // (an all -inf row has every lane tied at its own lane index, so it gives 0).
  const __m512i big = _mm512_set1_epi32(std::numeric_limits<int32_t>::max());
  *out_max = m;
  *out_idx = _mm512_reduce_min_epi32(_mm512_mask_mov_epi32(big, ties, best_idx));
}

// Lane i: the sum of v[i]'s lanes, for the quantized kernels (native_cpu_quant.h).
inline __m512 reduce_lanes(const __m512* v) { return reduce16(v); }

}  // namespace

#include "native_cpu_quant.h"
#include "native_cpu_api.h"
