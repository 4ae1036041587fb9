// kvpage native CPU kernels: decode scores over quantized K rows transposed 16 tokens at a
// time (AVX-512BW), for native_cpu_quant_decode.h; native_cpu_quant.h has the overview.

#pragma once

namespace {

// ---- Decode scores with the code rows transposed (AVX-512BW) ------------------------------
//
// Scoring row by row (quant_partials) ends every (token, query head) in a 16-lane partial sum
// that is stored, reloaded and reduced: about as much work as its multiply-adds. Here 16
// tokens' code rows of a KV head are transposed as bytes (64 byte unpacks per 16 rows of 64
// bytes), so each dim's 16 codes widen once into a vector over the tokens and every query head
// of the group adds q[d] times it into its own accumulator: one FMA per 16 (token, dim) pairs,
// no reductions. The scales fold in per token (a vector of the 16 rows' scales): int8 and fp8
// score = s * (q . codes); int4 score = sum over channel groups of scale * (q_g . codes_g) +
// min * sum(q_g).

#if defined(__AVX512BW__)
constexpr bool kTransposedScores = kVecLanes == 16;

template <int kBits, class I>
inline I unpack_lo(I a, I b) {
  if constexpr (sizeof(I) == 64) {
    if constexpr (kBits == 8) return _mm512_unpacklo_epi8(a, b);
    else if constexpr (kBits == 16) return _mm512_unpacklo_epi16(a, b);
    else if constexpr (kBits == 32) return _mm512_unpacklo_epi32(a, b);
    else return _mm512_unpacklo_epi64(a, b);
  } else {
    if constexpr (kBits == 8) return _mm256_unpacklo_epi8(a, b);
    else if constexpr (kBits == 16) return _mm256_unpacklo_epi16(a, b);
    else if constexpr (kBits == 32) return _mm256_unpacklo_epi32(a, b);
    else return _mm256_unpacklo_epi64(a, b);
  }
}
template <int kBits, class I>
inline I unpack_hi(I a, I b) {
  if constexpr (sizeof(I) == 64) {
    if constexpr (kBits == 8) return _mm512_unpackhi_epi8(a, b);
    else if constexpr (kBits == 16) return _mm512_unpackhi_epi16(a, b);
    else if constexpr (kBits == 32) return _mm512_unpackhi_epi32(a, b);
    else return _mm512_unpackhi_epi64(a, b);
  } else {
    if constexpr (kBits == 8) return _mm256_unpackhi_epi8(a, b);
    else if constexpr (kBits == 16) return _mm256_unpackhi_epi16(a, b);
    else if constexpr (kBits == 32) return _mm256_unpackhi_epi32(a, b);
    else return _mm256_unpackhi_epi64(a, b);
  }
}

// 16 rows r[j] transposed within each 128-bit lane: afterwards lane l of r[c] holds byte
// 16 l + c of rows 0 .. 15 (row j at byte j). Four rounds of unpacks, each pairing rows of the
// round before: after round k, a register holds 2^k rows of 16 / 2^k columns.
template <class I>
inline void transpose16(I* r) {
  I a[16], b[16];
  for (int p = 0; p < 8; ++p) {  // a[2p + h]: rows 2p, 2p + 1 of columns 8h .. 8h + 7
    a[2 * p] = unpack_lo<8>(r[2 * p], r[2 * p + 1]);
    a[2 * p + 1] = unpack_hi<8>(r[2 * p], r[2 * p + 1]);
  }
  for (int q = 0; q < 4; ++q)  // b[4q + c4]: rows 4q .. 4q + 3 of columns 4 c4 .. 4 c4 + 3
    for (int h = 0; h < 2; ++h) {
      b[4 * q + 2 * h] = unpack_lo<16>(a[4 * q + h], a[4 * q + 2 + h]);
      b[4 * q + 2 * h + 1] = unpack_hi<16>(a[4 * q + h], a[4 * q + 2 + h]);
    }
  for (int o = 0; o < 2; ++o)  // a[8o + c2]: rows 8o .. 8o + 7 of columns 2 c2, 2 c2 + 1
    for (int c4 = 0; c4 < 4; ++c4) {
      a[8 * o + 2 * c4] = unpack_lo<32>(b[8 * o + c4], b[8 * o + 4 + c4]);
      a[8 * o + 2 * c4 + 1] = unpack_hi<32>(b[8 * o + c4], b[8 * o + 4 + c4]);
    }
  for (int c2 = 0; c2 < 8; ++c2) {  // r[c]: rows 0 .. 15 of column c
    r[2 * c2] = unpack_lo<64>(a[c2], a[8 + c2]);
    r[2 * c2 + 1] = unpack_hi<64>(a[c2], a[8 + c2]);
  }
}

// kSlab bytes from byte `off` of the 16 rows, transposed into out: byte column b (< kSlab) of
// the rows is the 16 bytes at out + (b % 16) * kSlab + (b / 16) * 16 (see column_byte).
template <int kSlab>
inline void transpose_slab(const uint8_t* const* rows, int64_t off, uint8_t* out) {
  if constexpr (kSlab == 64) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(rows[j] + off);
    transpose16(r);
    for (int c = 0; c < 16; ++c) _mm512_store_si512(out + c * 64, r[c]);
  } else {
    __m256i r[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + off));
    transpose16(r);
    for (int c = 0; c < 16; ++c) _mm256_store_si256(reinterpret_cast<__m256i*>(out + c * 32), r[c]);
  }
}

// The byte column at position p of the transposed rows (16 bytes at tb + 16 p): slab
// p / kSlab, then column c = p / (kSlab / 16) % 16 of lane l = p % (kSlab / 16).
template <int kSlab>
constexpr int64_t column_byte(int64_t p) {
  constexpr int64_t kLanes = kSlab / 16;
  return p / kSlab * kSlab + p % kLanes * 16 + p / kLanes % 16;
}

// qf's rows in the transposed columns' order: qt[hq * D + i] multiplies the codes of column
// position p = i (int8, fp8) or of the low (i = 2p) and high (i = 2p + 1) nibbles of position p
// (int4), so the scoring loop walks the columns and the queries in address order.
template <int F>
void transposed_queries(const float* qf, int64_t rows, int64_t D, float* qt) {
  constexpr int kSlab = F == kInt4 ? 32 : 64;
  const int64_t positions = F == kInt4 ? D / 2 : D;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < positions; ++p) {
      const int64_t b = column_byte<kSlab>(p);
      if constexpr (F == kInt4) {
        qt[r * D + 2 * p] = qf[r * D + 2 * b];
        qt[r * D + 2 * p + 1] = qf[r * D + 2 * b + 1];
      } else {
        qt[r * D + p] = qf[r * D + b];
      }
    }
}

// Query heads scored per pass over the transposed codes (their accumulators in registers).
constexpr int kTransposedHeads = 8;

// Scores of the 16 tokens j0 .. j0 + 15 (m of them real) for query heads hq0 .. hq0 + kHeads - 1
// of KV head h into scores[hq * kPartition + j0 + j], from the transposed codes tb. The
// queries (w.qt, w.qsum) hold kTransposedHeads zero rows past the last head, so a pass may run
// past the group; only its first `heads` rows are stored.
template <int F, int kHeads>
void transposed_heads(const DecodeArgs& a, const QuantLayout& L, const uint8_t* tb, int64_t j0, int64_t h,
                      int64_t hq0, int64_t heads, const QuantDecodeScratch& w, float* scores) {
  const int64_t D = a.head_dim;
  const float* q = w.qt.data() + hq0 * D;
  __m512 acc[kHeads];
  for (int g = 0; g < kHeads; ++g) acc[g] = _mm512_setzero_ps();
  if constexpr (F == kInt4) {
    const int64_t groups = D / L.group;
    const float* params = w.kparams.data() + h * groups * 2 * kPartition + j0;
    for (int64_t gi = 0; gi < groups; ++gi) {
      __m512 raw[kHeads], odd[kHeads];  // the low and high nibbles' chains
      for (int g = 0; g < kHeads; ++g) raw[g] = odd[g] = _mm512_setzero_ps();
      // A group of 64 channels is 32 code bytes: slab gi, column positions 32 gi .. 32 gi + 31.
      for (int64_t p = gi * L.group / 2; p < (gi + 1) * L.group / 2; ++p) {
        const __m512i x = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(tb + 16 * p)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(15)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4));
        for (int g = 0; g < kHeads; ++g) {
          raw[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + 2 * p]), lo, raw[g]);
          odd[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + 2 * p + 1]), hi, odd[g]);
        }
      }
      for (int g = 0; g < kHeads; ++g) raw[g] = _mm512_add_ps(raw[g], odd[g]);
      const __m512 scale = _mm512_loadu_ps(params + 2 * gi * kPartition);
      const __m512 low = _mm512_loadu_ps(params + (2 * gi + 1) * kPartition);
      for (int g = 0; g < kHeads; ++g) {
        acc[g] = _mm512_fmadd_ps(scale, raw[g], acc[g]);
        acc[g] = _mm512_fmadd_ps(low, _mm512_set1_ps(w.qsum[(hq0 + g) * groups + gi]), acc[g]);
      }
    }
  } else {
    __m512 odd[kHeads];  // a second chain per head: one chain was bound by the multiply-adds' latency
    for (int g = 0; g < kHeads; ++g) odd[g] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D; p += 2) {
      const __m512 k0 = load_codes<16, F>(tb + 16 * p, 0), k1 = load_codes<16, F>(tb + 16 * p + 16, 0);
      for (int g = 0; g < kHeads; ++g) {
        acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + p]), k0, acc[g]);
        odd[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + p + 1]), k1, odd[g]);
      }
    }
    for (int g = 0; g < kHeads; ++g) acc[g] = _mm512_add_ps(acc[g], odd[g]);
    const __m512 scale = _mm512_loadu_ps(w.kscale.data() + h * kPartition + j0);
    for (int g = 0; g < kHeads; ++g) acc[g] = _mm512_mul_ps(acc[g], scale);
  }
  for (int g = 0; g < kHeads; ++g)
    if (g < heads) _mm512_storeu_ps(scores + (hq0 + g) * kPartition + j0, acc[g]);
}

// Scores of tokens j0 .. j0 + m - 1 (m <= 16; coffs from j0) of KV head h for its query heads.
template <int F>
void quant_scores_transposed(const DecodeArgs& a, const QuantLayout& L, const int64_t* coffs, int64_t m, int64_t j0,
                             int64_t h, QuantDecodeScratch& w) {
  constexpr int kSlab = F == kInt4 ? 32 : 64;
  alignas(64) uint8_t tb[16 * 16 * kMaxChunks];  // 16 rows of up to 256 code bytes
  const uint8_t* kb = static_cast<const uint8_t*>(a.key_cache);
  const uint8_t* rows[16];
  for (int j = 0; j < 16; ++j) rows[j] = kb + coffs[j < m ? j : 0] + h * L.code_bytes;  // past m: row 0 again
  for (int64_t off = 0; off < L.code_bytes; off += kSlab) transpose_slab<kSlab>(rows, off, tb + off * 16);
  const int64_t group = a.num_heads / a.num_kv_heads;
  float* scores = w.scores.data();
  for (int64_t g0 = 0; g0 < group; g0 += kTransposedHeads) {
    const int64_t heads = std::min<int64_t>(kTransposedHeads, group - g0), hq0 = h * group + g0;
    switch (heads) {
      case 1: transposed_heads<F, 1>(a, L, tb, j0, h, hq0, heads, w, scores); break;
      case 2: transposed_heads<F, 2>(a, L, tb, j0, h, hq0, heads, w, scores); break;
      case 3: transposed_heads<F, 3>(a, L, tb, j0, h, hq0, heads, w, scores); break;
      case 4: transposed_heads<F, 4>(a, L, tb, j0, h, hq0, heads, w, scores); break;
      default: transposed_heads<F, kTransposedHeads>(a, L, tb, j0, h, hq0, heads, w, scores); break;
    }
  }
}

// The int4 (scale, min) of every token row of the partition, head and channel group into
// out[((h * groups + g) * 2 + {0: scale, 1: min}) * kPartition + j].
inline void int4_token_params(const QuantLayout& L, const uint8_t* base, const int64_t* scales, int64_t n, float* out) {
  const int64_t groups = L.head_dim / L.group;
  for (int64_t h = 0; h < L.heads; ++h)
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* s = base + scales[j] + h * L.scale_bytes;
      for (int64_t g = 0; g < groups; ++g) {
        uint16_t half[2];
        std::memcpy(half, s + 4 * g, 4);
        out[((h * groups + g) * 2) * kPartition + j] = _cvtsh_ss(half[0]);
        out[((h * groups + g) * 2 + 1) * kPartition + j] = _cvtsh_ss(half[1]);
      }
    }
}
#else
constexpr bool kTransposedScores = false;
#endif

// Whether decode scores F's rows of head size D transposed.
template <int F>
// int4 is not: a transposed slab's 32 code bytes (64 channels) interleave two int4 groups of
// 32 channels, whose scales differ.
constexpr bool transposed_scores(int64_t D) { return kTransposedScores && D % 64 == 0 && F != kInt4; }

}  // namespace
