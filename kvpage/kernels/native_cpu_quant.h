// kvpage native CPU kernels: quantized KV caches (fp8 E4M3 / E5M2, int8, int4), stored and
// read in the byte layouts of kvpage/core/kv_formats.py, for either instruction-set variant.
//
// Included by native_cpu.cpp and native_cpu_avx2.cpp after their own kernels and before
// native_cpu_api.h. Written once over the variant's register (`Vec`, W = kVecLanes floats),
// as the shared code of native_cpu_common.h is; the variant provides, before including it:
//
//   Vec reduce_lanes(const Vec* v);  // lane i of the result: the sum of v[i]'s W lanes (v[0..W))
//
// A quantized layer buffer is uint8 [num_blocks, block_bytes]; a block holds the codes of its
// (token, head) rows [block_size][H][code_bytes] from byte 0, then their scales
// [block_size][H][scale_bytes] (QuantLayout). Codes are never dequantized into a copy of the
// cache: they are widened to fp32 in registers where they are used. The kernels:
//
// - store (this file): one (token, head) row of fp32/fp16/bf16 values into codes and scales,
//   byte for byte what kvpage.kernels.kv_quant.quantize_rows makes of the row widened to fp32:
//   fp32 arithmetic, true divisions x / s (vdivps is correctly rounded, as numpy's), rounding
//   half to even (vroundps), fp16 conversions to nearest even (F16C). fp8 divides only by
//   powers of two, which are exact as multiplications by their reciprocals. int4's grids
//   come from a search of their own (native_cpu_quant_int4.h).
// - decode (native_cpu_quant_decode.h): the unquantized decode's layout (one item per
//   (sequence, context split), softmax partitions of kPartition tokens, the LineQueue
//   prefetch). int8 and fp8 keep their per-row scale out of the inner loops: a score is
//   s_k * (q . codes) (one multiply per W scores), a V row enters with weight p * s_v (one
//   multiply per W weights). fp8 codes become fp16 bits by shifts (E5M2: b << 8 is the fp16 of
//   the value; E4M3: sign and the 7 low bits moved to fp16's places give the value / 2^8, a unit
//   folded into q and into the accumulators), then vcvtph2ps. int4's V rows are dequantized in
//   registers (min + code * scale, one FMA per chunk: the scale changes every channel group).
//   Scores: on AVX-512BW 16 tokens' K code rows are transposed as bytes so each dim's codes
//   widen once into a vector over the tokens (native_cpu_quant_transposed.h: no horizontal
//   sums; int4 folds its scale and min per group and token: scale * (q_g . codes_g) + min *
//   sum(q_g)); otherwise each K row is widened once per KV head for its group's query heads and
//   each (token, head) sum reduced W at a time.
// - prefill (native_cpu_quant_prefill.h): per (sequence, KV head, tile of query rows) item and
//   64-key chunk, K^T and V laid out as fp32 in the item's scratch as the unquantized kernels
//   lay them out (int8/fp8 as raw codes with the scales folded into the scores and weights,
//   int4 dequantized), then QK^T and P.V register-blocked over 4 (AVX2: 2) query rows.
//
// Vector FMAs in fp32 only (no AMX or bf16 dot products, which round operands or weights to
// bf16): every path computes what the oracle (fp32 attention over the dequantized cache)
// computes, up to the order of fp32 sums.

#pragma once

namespace {

// Cache format codes past the element types (native_cpu.CACHE_FORMATS).
constexpr int kFp8E4M3 = 3, kFp8E5M2 = 4, kInt8 = 5, kInt4 = 6;

// Where a quantized cache's rows lie.
struct QuantLayout {
  int format = 0;
  int64_t block_size = 0, heads = 0, head_dim = 0;
  int64_t code_bytes = 0, scale_bytes = 0;  // one (token, head) row's
  int64_t block_bytes = 0, scales_at = 0;   // a block's bytes; where its scales region starts
  int64_t group = 0;                        // int4: channels per (scale, min) pair

  // Byte offsets of slot's codes and of its scales (head 0; head h is h rows further).
  int64_t codes_of(int64_t slot) const {
    return slot / block_size * block_bytes + slot % block_size * heads * code_bytes;
  }
  int64_t scales_of(int64_t slot) const {
    return slot / block_size * block_bytes + scales_at + slot % block_size * heads * scale_bytes;
  }
};

// The layout of `format` (kv_formats.KVFormat.block_regions), or false for a format or head
// size the kernels do not take (head_dim a positive multiple of 16 up to 16 * kMaxChunks).
inline bool make_quant_layout(int format, int64_t block_size, int64_t heads, int64_t head_dim, QuantLayout* L) {
  if (format < kFp8E4M3 || format > kInt4 || head_dim <= 0 || head_dim % 16 || head_dim > 16 * kMaxChunks ||
      block_size <= 0 || heads <= 0)
    return false;
  L->format = format;
  L->block_size = block_size;
  L->heads = heads;
  L->head_dim = head_dim;
  L->group = head_dim % 32 == 0 ? 32 : head_dim;  // kv_formats.int4_group
  L->code_bytes = format == kInt4 ? head_dim / 2 : head_dim;
  L->scale_bytes = format == kInt8 ? 2 : format == kInt4 ? 4 * (head_dim / L->group) : 1;
  L->scales_at = block_size * heads * L->code_bytes;
  L->block_bytes = block_size * heads * (L->code_bytes + L->scale_bytes);
  return true;
}

// The converted codes of E4M3 are the values / 2^8: q and the accumulators carry the 2^8.
template <int F>
constexpr float kUnitInv = F == kFp8E4M3 ? 256.0f : 1.0f;
// int8 and fp8 have one scale per row, folded into scores and weights; int4 is dequantized.
template <int F>
constexpr bool kRowScaled = F != kInt4;

template <int W>
struct IntRegister;
template <>
struct IntRegister<16> {
  using type = __m512i;
};
template <>
struct IntRegister<8> {
  using type = __m256i;
};
template <int W>
using RegF = typename Register<W>::type;
template <int W>
using RegI = typename IntRegister<W>::type;

// ---- Width-generic helpers ----------------------------------------------------------------

template <int W>
inline RegF<W> vzero() { if constexpr (W == 16) return _mm512_setzero_ps(); else return _mm256_setzero_ps(); }
template <int W>
inline RegF<W> vload(const float* p) { return load_lanes<W, kF32>(p, 0); }
template <class F>
inline void vstore(float* p, F x) { store_lanes<kF32>(p, 0, x); }
template <class F>
inline F vmin(F a, F b) { if constexpr (kWide<F>) return _mm512_min_ps(a, b); else return _mm256_min_ps(a, b); }
template <class F>
inline F vsub(F a, F b) { if constexpr (kWide<F>) return _mm512_sub_ps(a, b); else return _mm256_sub_ps(a, b); }
template <class F>
inline F vdiv(F a, F b) { if constexpr (kWide<F>) return _mm512_div_ps(a, b); else return _mm256_div_ps(a, b); }
template <class F>
inline F vabs(F x) {
  if constexpr (kWide<F>) return _mm512_abs_ps(x);
  else return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
}
// Each lane rounded to the nearest integer, ties to even (numpy's rint).
template <class F>
inline F vrint(F x) {
  if constexpr (kWide<F>) return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  else return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

template <class F>
inline float lanes_sum(F x) {
  if constexpr (kWide<F>) {
    return _mm512_reduce_add_ps(x);
  } else {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
}
template <class F>
inline float lanes_max(F x) {
  if constexpr (kWide<F>) {
    return _mm512_reduce_max_ps(x);
  } else {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
}
template <class F>
inline float lanes_min(F x) {
  if constexpr (kWide<F>) {
    return _mm512_reduce_min_ps(x);
  } else {
    __m128 s = _mm_min_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_min_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_min_ss(s, _mm_movehdup_ps(s)));
  }
}

// x where first <= base + lane <= last, else fill.
template <int W>
inline RegF<W> keep_range(RegF<W> x, int64_t base, int64_t first, int64_t last, RegF<W> fill) {
  if constexpr (W == 16) {
    const __m512i key = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int>(base)));
    const __mmask16 in = _mm512_cmp_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(first)), _MM_CMPINT_NLT) &
                         _mm512_cmp_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(last)), _MM_CMPINT_LE);
    return _mm512_mask_mov_ps(fill, in, x);
  } else {
    const __m256i key = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                         _mm256_set1_epi32(static_cast<int>(base)));
    const __m256i ge = _mm256_cmpgt_epi32(key, _mm256_set1_epi32(static_cast<int>(first - 1)));
    const __m256i le = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(last + 1)), key);
    return _mm256_blendv_ps(fill, x, _mm256_castsi256_ps(_mm256_and_si256(ge, le)));
  }
}

// Each lane of x (integral) as int32.
template <int W>
inline RegI<W> to_int32(RegF<W> x) {
  if constexpr (W == 16) return _mm512_cvtps_epi32(x); else return _mm256_cvtps_epi32(x);
}

// The low bytes of the W int32 lanes of x, stored at dst.
template <int W>
inline void store_low_bytes(uint8_t* dst, RegI<W> x) {
  if constexpr (W == 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(x));
  } else {
    x = _mm256_and_si256(x, _mm256_set1_epi32(0xFF));
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(words, words));
  }
}

// 2^e as a float, exactly (e in [-149, 127]).
inline float pow2i(int e) {
  if (e < -126 || e > 127) return std::ldexp(1.0f, e);
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ---- Reading codes --------------------------------------------------------------------------

// W codes of a row (its code bytes at p), elements i .. i + W, as fp32 in the format's unit:
// int8 and int4 codes as integers, fp8 codes as their values (E4M3: / 2^8).
template <int W, int F>
inline RegF<W> load_codes(const uint8_t* p, int64_t i) {
  if constexpr (F == kInt8) {
    if constexpr (W == 16) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
    } else {
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i))));
    }
  } else if constexpr (F == kFp8E4M3 || F == kFp8E5M2) {
    // Sign-extended to 16 bits: E5M2's byte shifted to the top is its fp16; E4M3's shifted by
    // 7 puts the sign at bit 15 (bit 14, a copy of it, is cleared) and exponent and mantissa
    // where fp16 keeps them, which reads as the value / 2^8 (bias 15 instead of 7).
    if constexpr (W == 16) {
      __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
      if constexpr (F == kFp8E5M2) h = _mm256_slli_epi16(h, 8);
      else h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
      return _mm512_cvtph_ps(h);
    } else {
      __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i)));
      if constexpr (F == kFp8E5M2) h = _mm_slli_epi16(h, 8);
      else h = _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16(static_cast<short>(0xBF80)));
      return _mm256_cvtph_ps(h);
    }
  } else {  // int4: element 2j in the low nibble of byte j; each byte doubled, then shifted 0 or 4
    if constexpr (W == 16) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i / 2));
      __m512i x = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
      x = _mm512_srlv_epi32(x, _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4));
      return _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(15)));
    } else {
      int32_t word;
      std::memcpy(&word, p + i / 2, 4);
      const __m128i b = _mm_cvtsi32_si128(word);
      __m256i x = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
      x = _mm256_srlv_epi32(x, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
      return _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(15)));
    }
  }
}

// The scale of an int8 or fp8 row from its scale bytes: fp16 s, or 2^e for the signed byte e.
template <int F>
inline float row_scale(const uint8_t* s) {
  if constexpr (F == kInt8) {
    uint16_t h;
    std::memcpy(&h, s, 2);
    return _cvtsh_ss(h);
  } else {
    return pow2i(static_cast<int8_t>(s[0]));
  }
}

// An int4 row's (scale, min) of channel group g, broadcast.
template <int W>
inline void int4_params(const uint8_t* scales, int64_t g, RegF<W>& scale, RegF<W>& low) {
  int32_t word;
  std::memcpy(&word, scales + 4 * g, 4);
  const __m128 p = _mm_cvtph_ps(_mm_cvtsi32_si128(word));
  if constexpr (W == 16) {
    scale = _mm512_broadcastss_ps(p);
    low = _mm512_broadcastss_ps(_mm_movehdup_ps(p));
  } else {
    scale = _mm256_broadcastss_ps(p);
    low = _mm256_broadcastss_ps(_mm_movehdup_ps(p));
  }
}

// kC chunks of W values of one (token, head) row from element d0 into out: codes at `codes`,
// scales at `scales`; int4 dequantized (min + code * scale), the others in their unit.
template <int W, int F, int kC>
inline void row_chunks(const uint8_t* codes, const uint8_t* scales, int64_t d0, int64_t group, RegF<W>* out) {
  RegF<W> scale = vzero<W>(), low = vzero<W>();
  for (int c = 0; c < kC; ++c) {
    const int64_t d = d0 + c * W;
    out[c] = load_codes<W, F>(codes, d);
    if constexpr (F == kInt4) {
      if (c == 0 || d % group == 0) int4_params<W>(scales, d / group, scale, low);
      out[c] = fmadd(out[c], scale, low);
    }
  }
}

// int4 chunks of a row for the V sums, two at a time: chunk 2k holds the even elements of the
// 2W-element block at d0 + 2kW and chunk 2k + 1 its odd ones (dequantized), one widening of W
// bytes for both where row_chunks widens W / 2 bytes per chunk. The accumulators they are
// summed into hold that order until unpair_int4_rows (kC even, d0 a multiple of 2W).
template <int W, int kC>
inline void int4_value_chunks(const uint8_t* codes, const uint8_t* scales, int64_t d0, int64_t group, RegF<W>* out) {
  static_assert(kC % 2 == 0, "chunks come in pairs");
  RegF<W> scale = vzero<W>(), low = vzero<W>();
  for (int c = 0; c < kC; c += 2) {
    const int64_t d = d0 + c * W;
    if (c == 0 || d % group == 0) int4_params<W>(scales, d / group, scale, low);
    if constexpr (W == 16) {
      const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + d / 2)));
      out[c] = fmadd(_mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(15))), scale, low);
      out[c + 1] = fmadd(_mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4)), scale, low);
    } else {
      const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + d / 2)));
      out[c] = fmadd(_mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(15))), scale, low);
      out[c + 1] = fmadd(_mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4)), scale, low);
    }
  }
}

// Whether decode's int4 V sums of head size D take int4_value_chunks' order.
template <int F>
constexpr bool paired_values(int64_t D) { return F == kInt4 && D % (2 * kVecLanes) == 0; }

// `rows` accumulator rows of D floats from int4_value_chunks' order back to the elements'.
inline void unpair_int4_rows(float* acc, int64_t rows, int64_t D) {
  constexpr int W = kVecLanes;
  float block[2 * W];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = r * D; b < (r + 1) * D; b += 2 * W) {
      for (int i = 0; i < W; ++i) {
        block[2 * i] = acc[b + i];
        block[2 * i + 1] = acc[b + W + i];
      }
      std::memcpy(acc + b, block, sizeof(block));
    }
}

// ---- Streaming softmax ----------------------------------------------------------------------

// The softmax step of one row over scores s[0:n) (n <= kPartition; only keys first..last
// count): the row's (max, denominator) in st updated, the weights written over s (0 outside
// first..last, up to a multiple of W), and the factor the row's accumulator must be scaled by.
inline float quant_softmax_row(float* s, int64_t n, int64_t first, int64_t last, float* st) {
  constexpr int W = kVecLanes;
  const int64_t vecs = (n + W - 1) / W;
  const Vec neg_inf = splat<W>(-std::numeric_limits<float>::infinity());
  const int64_t whole = first <= 0 ? std::min(last + 1, n) / W : 0;  // vectors of visible keys only
  Vec mx = neg_inf;
  for (int64_t v = 0; v < whole; ++v) mx = vmax(mx, vload<W>(s + W * v));
  for (int64_t v = whole; v < vecs; ++v) {
    const Vec x = keep_range<W>(vload<W>(s + W * v), W * v, first, last, neg_inf);
    vstore(s + W * v, x);
    mx = vmax(mx, x);
  }
  const float m_old = st[0], m_new = std::max(m_old, lanes_max(mx));
  const Vec m = splat<W>(m_new);
  Vec total = vzero<W>();
  for (int64_t v = 0; v < vecs; ++v) {
    const Vec p = exp_nonpositive(vsub(vload<W>(s + W * v), m));  // -inf -> 0
    vstore(s + W * v, p);
    total = vadd(total, p);
  }
  const float alpha = m_old == m_new ? 1.0f : exp_nonpositive_scalar(m_old - m_new);  // 0 when m_old is -inf
  st[0] = m_new;
  st[1] = st[1] * alpha + lanes_sum(total);
  return alpha;
}

// x[0:n) *= y[0:n), W at a time (both padded to a multiple of W).
inline void multiply_rows(float* x, const float* y, int64_t n) {
  constexpr int W = kVecLanes;
  for (int64_t j = 0; j < n; j += W) vstore(x + j, vmul(vload<W>(x + j), vload<W>(y + j)));
}

inline void scale_row(float* x, float s, int64_t n) {
  constexpr int W = kVecLanes;
  const Vec sv = splat<W>(s);
  for (int64_t j = 0; j < n; j += W) vstore(x + j, vmul(vload<W>(x + j), sv));
}

// ---- Store: quantizing rows -----------------------------------------------------------------

// int8: s = fp16(absmax / 127), codes rint(x / s) clipped to [-127, 127] (0 where s is 0).
template <int R>
void quantize_int8(const void* src, int64_t at, int64_t D, uint8_t* codes, uint8_t* scales) {
  constexpr int W = kVecLanes;
  Vec amax = vzero<W>();
  for (int64_t c = 0; c < D; c += W) amax = vmax(amax, vabs(load_lanes<W, R>(src, at + c)));
  const uint16_t half = _cvtss_sh(lanes_max(amax) / 127.0f, _MM_FROUND_TO_NEAREST_INT);
  std::memcpy(scales, &half, 2);
  const float s = _cvtsh_ss(half);
  if (!(s > 0.0f)) {
    std::memset(codes, 0, D);
    return;
  }
  const Vec sv = splat<W>(s), lo = splat<W>(-127.0f), hi = splat<W>(127.0f);
  for (int64_t c = 0; c < D; c += W) {
    const Vec y = vmin(vmax(vrint(vdiv(load_lanes<W, R>(src, at + c), sv)), lo), hi);
    store_low_bytes<W>(codes + c, to_int32<W>(y));
  }
}

}  // namespace

#include "native_cpu_quant_int4.h"

namespace {

// fp8 codes of W values y (|y| within the format's range), rounded to nearest even, with
// x's sign bits: the magnitude rounded to the format's quantum at its binade (the subnormal
// one below the smallest normal), clipped to the largest value, then encoded through fp16,
// which holds every fp8 value exactly (E4M3's times 2^-8, see load_codes).
template <int F, class FV>
inline auto encode_fp8(FV x, FV y) {
  constexpr int kMan = F == kFp8E4M3 ? 3 : 2, kBias = F == kFp8E4M3 ? 7 : 15;
  constexpr float kLargest = F == kFp8E4M3 ? 448.0f : 57344.0f;
  const FV m = vabs(y);
  if constexpr (kWide<FV>) {
    const __m512i e = _mm512_max_epi32(_mm512_sub_epi32(_mm512_srli_epi32(_mm512_castps_si512(m), 23),
                                                        _mm512_set1_epi32(127)),
                                       _mm512_set1_epi32(1 - kBias));
    const __m512i q = _mm512_sub_epi32(e, _mm512_set1_epi32(kMan));  // log2 of the quantum
    const __m512 quantum = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(127)), 23));
    const __m512 inverse = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(127), q), 23));
    __m512 r = _mm512_min_ps(_mm512_mul_ps(vrint(_mm512_mul_ps(m, inverse)), quantum), _mm512_set1_ps(kLargest));
    if constexpr (F == kFp8E4M3) r = _mm512_mul_ps(r, _mm512_set1_ps(1.0f / 256.0f));
    __m512i code = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    code = _mm512_srli_epi32(code, F == kFp8E4M3 ? 7 : 8);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 24), _mm512_set1_epi32(0x80));
    return _mm512_or_si512(code, sign);
  } else {
    const __m256i e = _mm256_max_epi32(_mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(m), 23),
                                                        _mm256_set1_epi32(127)),
                                       _mm256_set1_epi32(1 - kBias));
    const __m256i q = _mm256_sub_epi32(e, _mm256_set1_epi32(kMan));
    const __m256 quantum = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q, _mm256_set1_epi32(127)), 23));
    const __m256 inverse = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(127), q), 23));
    __m256 r = _mm256_min_ps(_mm256_mul_ps(vrint(_mm256_mul_ps(m, inverse)), quantum), _mm256_set1_ps(kLargest));
    if constexpr (F == kFp8E4M3) r = _mm256_mul_ps(r, _mm256_set1_ps(1.0f / 256.0f));
    __m256i code = _mm256_cvtepu16_epi32(_mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    code = _mm256_srli_epi32(code, F == kFp8E4M3 ? 7 : 8);
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 24), _mm256_set1_epi32(0x80));
    return _mm256_or_si256(code, sign);
  }
}

// fp8: e = the least exponent with absmax / 2^e within the format's largest value (0 for an
// all-zero row; clipped to [-127, 127]), codes of x / 2^e.
template <int R, int F>
void quantize_fp8(const void* src, int64_t at, int64_t D, uint8_t* codes, uint8_t* scales) {
  constexpr int W = kVecLanes;
  constexpr int kLargestExp = F == kFp8E4M3 ? 9 : 16;  // 448 = 0.875 * 2^9, 57344 = 0.875 * 2^16
  Vec amax = vzero<W>();
  for (int64_t c = 0; c < D; c += W) amax = vmax(amax, vabs(load_lanes<W, R>(src, at + c)));
  const float am = lanes_max(amax);
  int e = 0;
  if (am > 0.0f) {
    int exp;
    const float mant = std::frexp(am, &exp);
    e = std::min(127, std::max(-127, exp - kLargestExp + (mant > 0.875f ? 1 : 0)));
  }
  scales[0] = static_cast<uint8_t>(static_cast<int8_t>(e));
  const Vec f = splat<W>(pow2i(-e));  // exact, as numpy's ldexp(x, -e)
  for (int64_t c = 0; c < D; c += W) {
    const Vec x = load_lanes<W, R>(src, at + c);
    store_low_bytes<W>(codes + c, encode_fp8<F>(x, vmul(x, f)));
  }
}

template <int R, int F>
inline void quantize_row(const void* src, int64_t at, const QuantLayout& L, uint8_t* codes, uint8_t* scales) {
  if constexpr (F == kInt8) quantize_int8<R>(src, at, L.head_dim, codes, scales);
  else quantize_fp8<R, F>(src, at, L.head_dim, codes, scales);
}

// cache rows of slots[t] = quantized rows[t] for t < n (rows [n, H, D] of element type R,
// token/head strides in elements, D contiguous; the caller checked the slots). Tokens are
// spread over the thread pool when there are many.
template <int R, int F>
void quantize_rows(uint8_t* cache, const QuantLayout& L, const void* rows, int64_t stride_token, int64_t stride_head,
                   const int64_t* slots, int64_t n) {
  if constexpr (F == kInt4) {
    quantize_rows_int4<R>(cache, L, rows, stride_token, stride_head, slots, n);
  } else {
    const int64_t work = n * L.heads * L.head_dim;
#pragma omp parallel for schedule(static) if (work >= (1 << 16))
    for (int64_t t = 0; t < n; ++t) {
      uint8_t* codes = cache + L.codes_of(slots[t]);
      uint8_t* scales = cache + L.scales_of(slots[t]);
      for (int64_t h = 0; h < L.heads; ++h)
        quantize_row<R, F>(rows, t * stride_token + h * stride_head, L, codes + h * L.code_bytes,
                           scales + h * L.scale_bytes);
    }
  }
}

// quantize_rows for a run-time row type and format; false for ones it does not take.
inline bool quantize_rows_any(int rows_type, uint8_t* cache, const QuantLayout& L, const void* rows,
                              int64_t stride_token, int64_t stride_head, const int64_t* slots, int64_t n) {
  const auto run = [&](auto r) {
    constexpr int R = decltype(r)::value;
    switch (L.format) {
      case kFp8E4M3: return quantize_rows<R, kFp8E4M3>(cache, L, rows, stride_token, stride_head, slots, n);
      case kFp8E5M2: return quantize_rows<R, kFp8E5M2>(cache, L, rows, stride_token, stride_head, slots, n);
      case kInt8: return quantize_rows<R, kInt8>(cache, L, rows, stride_token, stride_head, slots, n);
      default: return quantize_rows<R, kInt4>(cache, L, rows, stride_token, stride_head, slots, n);
    }
  };
  switch (rows_type) {
    case kF32: run(std::integral_constant<int, kF32>{}); return true;
    case kF16: run(std::integral_constant<int, kF16>{}); return true;
    case kBF16: run(std::integral_constant<int, kBF16>{}); return true;
    default: return false;
  }
}

}  // namespace

#include "native_cpu_quant_decode.h"
#include "native_cpu_quant_prefill.h"
