// kvpage native CPU kernels: what every instruction-set variant shares.
//
// native_cpu.cpp (AVX-512) and native_cpu_avx2.cpp (AVX2 + FMA) each include this header
// first, define their vector kernels, then include native_cpu_api.h, which holds the one C
// interface both export (native_cpu.py loads whichever the CPU runs). This header holds what
// does not depend on the vector width: the call's records, the paged-table arithmetic, the
// work items and their thread-pool loops, decode's split merge, the output normalisation.
// Vector code common to both widths (element loads and stores, exp) is written once over
// `Vec`, the variant's register type, which the variant declares before including this
// header. Everything here is an inline function or a template, instantiated where the
// variant uses it, so the hot loops compile as if each file had its own copy.
//
// A variant provides, inside the anonymous namespace:
//
//   using Vec = __m512;  // or __m256: declared before this header is included
//   struct DecodeScratch;  // a thread's decode buffers
//   template <int T, int kD> void decode_item(const DecodeArgs&, int64_t item, DecodeScratch&);  // declared below
//   template <int T> void prefill_typed(const PrefillArgs&, const std::vector<PrefillItem>&, int num_threads);
//   int64_t prefill_query_tile(int elem_type, int64_t head_dim);  // query rows per prefill item
//   bool prefill_on_amx(int elem_type, int64_t head_dim);
//   void row_argmax(const float* row, int64_t cols, float* out_max, int64_t* out_idx);

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <immintrin.h>

namespace {

constexpr int kF32 = 0, kF16 = 1, kBF16 = 2;  // cache and q element types (MODE_* in numba_math)
constexpr int64_t kPartition = 64;  // decode: tokens per softmax partition, its K/V rows stay in L1
constexpr int kMaxChunks = 16;      // head_dim <= 256, in 16-float chunks

// Bytes per element of a cache and q element type.
constexpr int64_t elem_size(int elem_type) { return elem_type == kF32 ? 4 : 2; }

// One layer's paged attention call: what the decode and prefill kernels both read.
struct PagedLayer {
  const void* q;
  int64_t q_stride_token, q_stride_head;  // elements; the head_dim stride is 1
  const void* key_cache;
  const void* value_cache;
  int64_t block_size, num_kv_heads, head_dim, num_heads;
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* seq_lens;
  float scale;
  int64_t window;      // 0: none
  float softcap;       // 0: none
  const float* sinks;  // nullptr: none; else [num_heads]
  void* out;           // [rows, num_heads, head_dim], q's element type, contiguous
};

struct DecodeArgs : PagedLayer {
  int64_t num_seqs, num_splits;
  float* part_acc;    // [num_seqs, num_heads, num_splits, head_dim] when num_splits > 1
  float* part_stats;  // [num_seqs, num_heads, num_splits, 2]: (max, denominator)
};

struct PrefillArgs : PagedLayer {
  const int32_t* query_start_loc;
};

struct PrefillItem {
  int64_t seq, head, row0, rows;
};

// ---- Vector primitives of either width -----------------------------------------------------
//
// F is __m512 (W = 16 lanes) or __m256 (W = 8). Each primitive is a template choosing its
// intrinsic with `if constexpr`, so a translation unit instantiates only its own width: the
// AVX2 variant never holds an AVX-512 instruction. (Widths travel as lane counts, not as
// explicit type arguments: GCC drops, with a warning, the attributes of __m512 and __m256
// named as template arguments.)

template <int W>
struct Register;
template <>
struct Register<16> {
  using type = __m512;
};
template <>
struct Register<8> {
  using type = __m256;
};
template <class F>
constexpr bool kWide = sizeof(F) == 64;
constexpr int kVecLanes = sizeof(Vec) / sizeof(float);  // the variant's register

template <int W>
inline auto splat(float x) { if constexpr (W == 16) return _mm512_set1_ps(x); else return _mm256_set1_ps(x); }
template <class F>
inline F vmul(F a, F b) { if constexpr (kWide<F>) return _mm512_mul_ps(a, b); else return _mm256_mul_ps(a, b); }
template <class F>
inline F fmadd(F a, F b, F c) {
  if constexpr (kWide<F>) return _mm512_fmadd_ps(a, b, c); else return _mm256_fmadd_ps(a, b, c);
}
template <class F>
inline F vadd(F a, F b) { if constexpr (kWide<F>) return _mm512_add_ps(a, b); else return _mm256_add_ps(a, b); }
template <class F>
inline F fnmadd(F a, F b, F c) {
  if constexpr (kWide<F>) return _mm512_fnmadd_ps(a, b, c); else return _mm256_fnmadd_ps(a, b, c);
}
template <class F>
inline F vmax(F a, F b) { if constexpr (kWide<F>) return _mm512_max_ps(a, b); else return _mm256_max_ps(a, b); }
template <class F>
inline float first_lane(F x) { if constexpr (kWide<F>) return _mm512_cvtss_f32(x); else return _mm256_cvtss_f32(x); }

// Each lane of x rounded down (to -inf).
template <class F>
inline F vfloor(F x) {
  if constexpr (kWide<F>) return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  else return _mm256_floor_ps(x);
}

// p * 2^k for integral k (added to the exponent bits; no overflow check).
template <class F>
inline F times_pow2(F p, F k) {
  if constexpr (kWide<F>) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(k), 23)));
  } else {
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(k), 23)));
  }
}

// v where x > lo, else 0 (NaN x: 0).
template <class F>
inline F where_greater(F x, F lo, F v) {
  if constexpr (kWide<F>) return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GT_OQ), v);
  else return _mm256_and_ps(_mm256_cmp_ps(x, lo, _CMP_GT_OQ), v);
}

// W lanes from element i of base (T: kF32, kF16 or kBF16), widened to fp32.
template <int W, int T>
inline typename Register<W>::type load_lanes(const void* base, int64_t i) {
  if constexpr (T == kF32) {
    const float* p = static_cast<const float*>(base) + i;
    if constexpr (W == 16) return _mm512_loadu_ps(p);
    else return _mm256_loadu_ps(p);
  } else if constexpr (W == 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (T == kF16) return _mm512_cvtph_ps(h);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (T == kF16) return _mm256_cvtph_ps(h);
    else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// x into the lanes from element i of base, rounded to T as torch rounds: to nearest even,
// NaN stays a quiet NaN.
template <int T, class F>
inline void store_lanes(void* base, int64_t i, F x) {
  if constexpr (T == kF32) {
    if constexpr (kWide<F>) _mm512_storeu_ps(static_cast<float*>(base) + i, x);
    else _mm256_storeu_ps(static_cast<float*>(base) + i, x);
    return;
  }
  uint16_t* h = static_cast<uint16_t*>(base) + i;
  if constexpr (T == kF16 && kWide<F>) {
    const __m256i halves = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h), halves);
  } else if constexpr (T == kF16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else if constexpr (kWide<F>) {  // bf16: the high half of u + 0x7fff + (bit 16 of u)
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h), _mm512_cvtepi32_epi16(rounded));
  } else {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
    // 32-bit lanes holding 16-bit values -> 8 packed halves (packus saturates nothing here).
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h),
                     _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1)));
  }
}

// The variant's register, loaded from or stored as element type T (see load_lanes).
template <int T>
inline Vec load_vec(const void* base, int64_t i) { return load_lanes<kVecLanes, T>(base, i); }
template <int T>
inline void store_vec(void* base, int64_t i, Vec x) { store_lanes<T>(base, i, x); }

// dst[0:n] = scale * the n elements of `base` from element i, as fp32; n a multiple of 16.
template <int T>
inline void load_scaled(const void* base, int64_t i, int64_t n, float scale, float* dst) {
  const Vec s = splat<kVecLanes>(scale);
  for (int64_t c = 0; c < n; c += kVecLanes) store_lanes<kF32>(dst, c, vmul(load_vec<T>(base, i + c), s));
}

// The n elements of `base` from element i = scale * src[0:n], rounded to T; n a multiple of 16.
template <int T>
inline void store_scaled(const float* src, float scale, int64_t n, void* base, int64_t i) {
  const Vec s = splat<kVecLanes>(scale);
  for (int64_t c = 0; c < n; c += kVecLanes) store_vec<T>(base, i + c, vmul(load_lanes<kVecLanes, kF32>(src, c), s));
}

// exp(x) for x <= 0 (score minus running max): Cody-Waite reduction and a degree-6
// polynomial, relative error below 1e-6 over [-87, 0]; 0 below -87 (and for -inf).
template <class F>
inline F exp_nonpositive(F x) {
  constexpr int W = sizeof(F) / sizeof(float);
  const F lo = splat<W>(-87.0f);
  const F v = vmax(x, lo);
  const F k = vfloor(fmadd(v, splat<W>(1.4426950408889634f), splat<W>(0.5f)));
  F r = fnmadd(k, splat<W>(0.693359375f), v);
  r = fnmadd(k, splat<W>(-2.12194440e-4f), r);
  F p = splat<W>(1.9875691500e-4f);
  p = fmadd(p, r, splat<W>(1.3981999507e-3f));
  p = fmadd(p, r, splat<W>(8.3334519073e-3f));
  p = fmadd(p, r, splat<W>(4.1665795894e-2f));
  p = fmadd(p, r, splat<W>(1.6666665459e-1f));
  p = fmadd(p, r, splat<W>(5.0000001201e-1f));
  p = fmadd(p, vmul(r, r), vadd(r, splat<W>(1.0f)));
  return where_greater(x, lo, times_pow2(p, k));
}

inline float exp_nonpositive_scalar(float x) { return first_lane(exp_nonpositive(splat<kVecLanes>(x))); }

// ---- Scalar helpers ---------------------------------------------------------------------

// The cache slot (block * block_size + offset in it) of context token t of the sequence
// whose block table is `table`.
inline int64_t token_slot(const PagedLayer& a, const int32_t* table, int64_t t) {
  return static_cast<int64_t>(table[t / a.block_size]) * a.block_size + t % a.block_size;
}

// Element offsets in the cache of the token rows pb .. min(pb + kPartition, end) (all
// heads, `row` elements each); returns how many.
inline int64_t row_offsets(const PagedLayer& a, const int32_t* table, int64_t row, int64_t pb, int64_t end,
                           int64_t* offs) {
  const int64_t n = std::max<int64_t>(0, std::min(pb + kPartition, end) - pb);
  for (int64_t j = 0; j < n; ++j) offs[j] = token_slot(a, table, pb + j) * row;
  return n;
}

inline float softcapped(float x, float softcap) { return softcap > 0 ? softcap * std::tanh(x / softcap) : x; }

// Softmax statistics (running max -inf, denominator 0) of `rows` rows, `stride` floats apart.
inline void reset_stats(float* stats, int64_t rows, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r) {
    stats[stride * r] = -std::numeric_limits<float>::infinity();
    stats[stride * r + 1] = 0.0f;
  }
}

// out_row = acc / den, as T; a sink adds exp(sink) to the denominator only.
template <int T>
inline void normalize_row(const float* acc, float m, float den, const float* sinks, int64_t hq, int64_t head_dim,
                          void* out, int64_t out_offset) {
  float inv = 1.0f / den;
  if (sinks != nullptr) {
    const float mx = std::max(m, sinks[hq]);
    inv = std::exp(m - mx) / (den * std::exp(m - mx) + std::exp(sinks[hq] - mx));
  }
  store_scaled<T>(acc, inv, head_dim, out, out_offset);
}

// torch's max(dim=-1) propagates NaN, with the index of the first NaN: where x[0:cols)
// holds one, that NaN and its index into out_max / out_idx, and true.
inline bool first_nan(const float* x, int64_t cols, float* out_max, int64_t* out_idx) {
  for (int64_t t = 0; t < cols; ++t)
    if (std::isnan(x[t])) {
      *out_max = x[t];
      *out_idx = t;
      return true;
    }
  return false;
}

// fn(k, scratch) for every k < count on the thread pool, handed out one at a time in order
// (callers list their longest items first); each thread has its own Scratch.
template <class Scratch, class Fn>
void on_pool(int64_t count, int num_threads, Fn fn) {
#pragma omp parallel num_threads(num_threads)
  {
    Scratch w;
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < count; ++k) fn(k, w);
  }
}

// Cache lines of token rows (all heads) still to prefetch, issued a few at a time from inside
// the compute loops. A burst of a whole partition's rows (hundreds of lines) stalls once the
// core's outstanding L2 misses are used up and then waits for nearly all of them; a few lines
// per inner iteration keep the requests in flight while the arithmetic runs. Into L2, not
// L1: a core has far more L2 misses in flight than L1 fill buffers, and with prefetches into
// L1 the kernel read scattered blocks at 8-10 GB/s where into L2 it reached 12-15 GB/s (34
// sequences x 250 tokens, bf16, 30 layers' caches in rotation, back to back).
struct LineQueue {
  const char* rows[2 * kPartition];  // at most one partition's V rows and the next one's K rows
  int64_t count = 0, next = 0, line = 0, row_bytes = 0;

  void reset(int64_t bytes_per_row) { count = next = line = 0; row_bytes = bytes_per_row; }
  void add(const void* cache, const int64_t* offs, int64_t n, int64_t elem_bytes) {
    const char* base = static_cast<const char*>(cache);
    for (int64_t j = 0; j < n; ++j) rows[count++] = base + offs[j] * elem_bytes;
  }
  // About how many lines are still to go: the rate the loops issue them at.
  int64_t lines() const { return (count - next) * ((row_bytes + 63) / 64) + 1; }
  inline void issue(int64_t k) {
    for (; k > 0 && next < count; --k) {
      _mm_prefetch(rows[next] + line, _MM_HINT_T1);
      line += 64;
      if (line >= row_bytes) {
        _mm_prefetch(rows[next] + row_bytes - 1, _MM_HINT_T1);
        line = 0;
        ++next;
      }
    }
  }
  void drain() { issue(std::numeric_limits<int64_t>::max()); }
};

// ---- Decode: one work item per (sequence, context split), every head --------------------

// Decode item `item`'s sequence `seq` and its tokens [tok_lo, tok_hi): the visible context
// (the sliding window's) cut into num_splits block-aligned pieces, piece `split`.
struct DecodeSpan {
  int64_t seq, split, tok_lo, tok_hi;
};

inline DecodeSpan decode_span(const DecodeArgs& a, int64_t item) {
  const int64_t i = item / a.num_splits, split = item % a.num_splits, seq_len = a.seq_lens[i];
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, seq_len - a.window) : 0;
  const int64_t chunk = (seq_len - lo + a.num_splits * a.block_size - 1) / (a.num_splits * a.block_size) * a.block_size;
  const int64_t tok_lo = std::min(lo + split * chunk, seq_len);
  return {i, split, tok_lo, std::min(tok_lo + chunk, seq_len)};
}

// Sequence i's query rows times the scale, as fp32 [num_heads][D].
template <int T>
inline void load_queries(const DecodeArgs& a, int64_t i, int64_t D, float* qf) {
  for (int64_t hq = 0; hq < a.num_heads; ++hq)
    load_scaled<T>(a.q, i * a.q_stride_token + hq * a.q_stride_head, D, a.scale, qf + hq * D);
}

// An item's result for every head (accumulators acc [H][D], (max, denominator) pairs in
// stats): normalised into `out` when the context is not split, else its split's partials.
template <int T>
void finish_decode_item(const DecodeArgs& a, const DecodeSpan& s, int64_t D, const float* acc, const float* stats) {
  const int64_t H = a.num_heads;
  for (int64_t hq = 0; hq < H; ++hq) {
    if (a.num_splits == 1) {
      normalize_row<T>(acc + hq * D, stats[2 * hq], stats[2 * hq + 1], a.sinks, hq, D, a.out, (s.seq * H + hq) * D);
    } else {
      const int64_t part = (s.seq * H + hq) * a.num_splits + s.split;
      a.part_stats[2 * part] = stats[2 * hq];
      a.part_stats[2 * part + 1] = stats[2 * hq + 1];
      std::memcpy(a.part_acc + part * D, acc + hq * D, D * sizeof(float));
    }
  }
}

// Merge the per-split (max, denominator, accumulator) of row (i, hq) into out; acc: scratch.
template <int T>
void combine_row(const DecodeArgs& a, int64_t row, std::vector<float>& acc) {
  const int64_t D = a.head_dim, S = a.num_splits, hq = row % a.num_heads;
  const float* stats = a.part_stats + row * S * 2;
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < S; ++s) m = std::max(m, stats[2 * s]);
  float den = 0.0f;
  acc.assign(D, 0.0f);
  for (int64_t s = 0; s < S; ++s) {
    if (stats[2 * s + 1] <= 0) continue;  // an empty split
    const float wgt = std::exp(stats[2 * s] - m);
    den += stats[2 * s + 1] * wgt;
    const float* part = a.part_acc + (row * S + s) * D;
    for (int64_t d = 0; d < D; ++d) acc[d] += part[d] * wgt;
  }
  normalize_row<T>(acc.data(), m, den, a.sinks, hq, D, a.out, row * D);
}

// The variant's decode of one (sequence, split) item, written out with finish_decode_item;
// kD is the head size where it is a common one (64, 128), so its loops get compile-time
// bounds there, else 0. DecodeScratch: a thread's buffers, reused across its items. Kept
// out of line, a function of its own per head size, as when each variant had its own loop.
struct DecodeScratch;
template <int T, int kD>
__attribute__((noinline)) void decode_item(const DecodeArgs& a, int64_t item, DecodeScratch& w);

// Decode of every (sequence, split) item on the thread pool, then the splits merged.
template <int T>
void decode_typed(const DecodeArgs& a, int num_threads) {
  on_pool<DecodeScratch>(a.num_seqs * a.num_splits, num_threads, [&](int64_t k, DecodeScratch& w) {
    switch (a.head_dim) {
      case 64: return decode_item<T, 64>(a, k, w);
      case 128: return decode_item<T, 128>(a, k, w);
      default: return decode_item<T, 0>(a, k, w);
    }
  });
  if (a.num_splits > 1) {
#pragma omp parallel num_threads(num_threads)
    {
      std::vector<float> acc;
#pragma omp for schedule(static)
      for (int64_t row = 0; row < a.num_seqs * a.num_heads; ++row) combine_row<T>(a, row, acc);
    }
  }
}

// ---- Prefill: one work item per (sequence, KV head, tile of query rows) -----------------
//
// An item's row m is query head it.head * group + m % group of the tile's token
// it.row0 + m / group: the KV head's `group` query heads of each token, all attending the
// same K/V rows.

// Where an item's rows sit in the sequence.
struct PrefillSpan {
  int64_t q0;              // the sequence's first row in q and out
  int64_t seq_len;         // its context, in tokens
  int64_t lo_pos, hi_pos;  // context positions of the tile's first and last token
  int64_t k_lo;            // the first key any row of the tile sees (sliding window)
  const int32_t* table;    // the sequence's block table
};

inline PrefillSpan prefill_span(const PrefillArgs& a, const PrefillItem& it) {
  const int64_t q0 = a.query_start_loc[it.seq], q_len = a.query_start_loc[it.seq + 1] - q0;
  const int64_t seq_len = a.seq_lens[it.seq], lo_pos = seq_len - q_len + it.row0;
  const int64_t k_lo = a.window > 0 ? std::max<int64_t>(0, lo_pos - a.window + 1) : 0;
  return {q0, seq_len, lo_pos, lo_pos + it.rows - 1, k_lo, a.block_tables + it.seq * a.table_stride};
}

// The keys [first, last] of a chunk (n keys from position `base`) that the query at position
// `pos` sees: causal, and within its sliding window.
struct KeyRange {
  int64_t first, last;
  bool empty() const { return last < 0 || first > last; }
};

inline KeyRange visible_keys(const PagedLayer& a, int64_t pos, int64_t base, int64_t n) {
  return {a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1 - base) : 0, std::min<int64_t>(n - 1, pos - base)};
}

// The element offset in q of an item's row m.
inline int64_t prefill_query_offset(const PrefillArgs& a, const PrefillItem& it, int64_t q0, int64_t m) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  return (q0 + it.row0 + m / group) * a.q_stride_token + (it.head * group + m % group) * a.q_stride_head;
}

// The element offset in the cache of the item's KV head in context token t's row.
inline int64_t prefill_key_offset(const PrefillArgs& a, const PrefillItem& it, const int32_t* table, int64_t t) {
  return token_slot(a, table, t) * a.num_kv_heads * a.head_dim + it.head * a.head_dim;
}

// An item's `rows` rows out: accumulators acc [rows][head_dim], normalised by each row's
// (max, denominator) at stats[stats_stride * m].
template <int T>
void finish_prefill_item(const PrefillArgs& a, const PrefillItem& it, int64_t q0, int64_t rows, const float* acc,
                         const float* stats, int64_t stats_stride) {
  const int64_t D = a.head_dim, group = a.num_heads / a.num_kv_heads;
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t hq = it.head * group + m % group;
    normalize_row<T>(acc + m * D, stats[stats_stride * m], stats[stats_stride * m + 1], a.sinks, hq, D, a.out,
                     ((q0 + it.row0 + m / group) * a.num_heads + hq) * D);
  }
}

}  // namespace
