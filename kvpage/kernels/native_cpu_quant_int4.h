// kvpage native CPU kernels: the int4 store (native_cpu_quant.h has the formats and the
// overview). Each channel group's grid comes from the search of kv_quant.int4_ranges, whose
// docstring is the contract: the plain [min, max] grid against least-squares fits from
// kInt4Starts, the least squared error winning. The search runs for W groups at once, lane j
// holding group j, so its sums need no horizontal reductions and its per-group solves are
// lane-wise too. Every step is integer arithmetic or one IEEE fp32 operation (double only
// where it holds integers exactly), and no a * b + c is written (the build would contract
// it into an FMA), so the bytes are the reference's whatever the order of the sums.

#pragma once

namespace {

constexpr int kInt4Starts[] = {29, 30, 31};  // kv_quant.INT4_STARTS
constexpr int kInt4Fits = 2;                 // kv_quant.INT4_FITS
constexpr int32_t kInt4PlainS = (32 * 65536 + 15) / 30;  // kv_quant.INT4_PLAIN_STEP

template <int W>
inline RegI<W> isplat(int32_t v) { if constexpr (W == 16) return _mm512_set1_epi32(v); else return _mm256_set1_epi32(v); }
template <int W>
inline RegI<W> iadd(RegI<W> a, RegI<W> b) { if constexpr (W == 16) return _mm512_add_epi32(a, b); else return _mm256_add_epi32(a, b); }
template <int W>
inline RegF<W> gather_lanes(const float* base, RegI<W> index) {
  if constexpr (W == 16) return _mm512_i32gather_ps(index, base, 4); else return _mm256_i32gather_ps(base, index, 4);
}
template <int W>
inline RegI<W> load_ints(const int32_t* p) {
  RegI<W> a;
  std::memcpy(&a, p, sizeof(a));
  return a;
}

// One batch of W groups, element-major: t[i] holds element i's T of every group (exact
// integers in [0, 2^16]), place[i] the same as int32.
template <int W>
struct Int4Batch {
  RegF<W> t[16 * kMaxChunks], u[16 * kMaxChunks];  // T, and 16 T
  RegI<W> place[16 * kMaxChunks];
  RegI<W> ST;  // sum of T per group
  int64_t G;
};

// Per-group sums of codes l over the batch's G elements: of l, l * l and l * T (int32 lanes:
// exact for G <= 256), and with kError the squared error sum (16 T - M - l S)^2 (int64:
// even groups in err[0], odd ones in err[1]).
template <int W>
struct Int4Sums {
  RegI<W> l, ll, lt;
  RegI<W> err[2];
};

// The codes clip(rint((y - m) * f), 0, 15) of every element and group (y = 16 T with
// kLine, else T), and their sums. The sums run in fp32 over 16 elements at a time, where they
// are exact integers (l * T < 2^20, so 16 of them stay below 2^24: an FMA rounds nothing),
// then move to int32.
template <int W, bool kLine, bool kError>
inline Int4Sums<W> int4_pass(const Int4Batch<W>& b, RegF<W> m, RegF<W> f, RegI<W> M, RegI<W> S) {
  const RegF<W> top = splat<W>(15.0f);
  Int4Sums<W> q{isplat<W>(0), isplat<W>(0), isplat<W>(0), {isplat<W>(0), isplat<W>(0)}};
  for (int64_t c = 0; c < b.G; c += 16) {
    RegF<W> sl = vzero<W>(), sll = vzero<W>(), slt = vzero<W>();
    for (int64_t i = c; i < c + 16; ++i) {
      const RegF<W> lf = vmin(vmax(vrint(vmul(vsub(kLine ? b.u[i] : b.t[i], m), f)), vzero<W>()), top);
      sl = vadd(sl, lf);
      sll = fmadd(lf, lf, sll);
      slt = fmadd(lf, b.t[i], slt);
      if constexpr (kError) {
        const RegI<W> l = to_int32<W>(lf);
        if constexpr (W == 16) {  // 16 T - M - l S: |e| < 2^27, squared in int64 (even lanes, then odd)
          const __m512i e = _mm512_sub_epi32(_mm512_sub_epi32(_mm512_slli_epi32(b.place[i], 4), M),
                                             _mm512_mullo_epi32(l, S));
          q.err[0] = _mm512_add_epi64(q.err[0], _mm512_mul_epi32(e, e));
          const __m512i odd = _mm512_srli_epi64(e, 32);
          q.err[1] = _mm512_add_epi64(q.err[1], _mm512_mul_epi32(odd, odd));
        } else {
          const __m256i e = _mm256_sub_epi32(_mm256_sub_epi32(_mm256_slli_epi32(b.place[i], 4), M),
                                             _mm256_mullo_epi32(l, S));
          q.err[0] = _mm256_add_epi64(q.err[0], _mm256_mul_epi32(e, e));
          const __m256i odd = _mm256_srli_epi64(e, 32);
          q.err[1] = _mm256_add_epi64(q.err[1], _mm256_mul_epi32(odd, odd));
        }
      }
    }
    q.l = iadd<W>(q.l, to_int32<W>(sl));
    q.ll = iadd<W>(q.ll, to_int32<W>(sll));
    q.lt = iadd<W>(q.lt, to_int32<W>(slt));
  }
  return q;
}

// The per-group squared errors of a pass with kError, in group order.
template <int W>
inline void int4_errors(const Int4Sums<W>& q, int64_t* out) {
  alignas(64) int64_t even[W / 2], odd[W / 2];
  std::memcpy(even, &q.err[0], sizeof(even));
  std::memcpy(odd, &q.err[1], sizeof(odd));
  for (int k = 0; k < W / 2; ++k) {
    out[2 * k] = even[k];
    out[2 * k + 1] = odd[k];
  }
}

// Double-precision halves of W int32 lanes (AVX-512: 2 x 8, AVX2: 2 x 4), and back to fp32.
template <int W>
using Doubles = std::conditional_t<W == 16, __m512d, __m256d>;
template <int W>
inline Doubles<W> dhalf(RegI<W> x, int h) {
  if constexpr (W == 16) return _mm512_cvtepi32_pd(h ? _mm512_extracti64x4_epi64(x, 1) : _mm512_castsi512_si256(x));
  else return _mm256_cvtepi32_pd(h ? _mm256_extracti128_si256(x, 1) : _mm256_castsi256_si128(x));
}
template <int W>
inline Doubles<W> dset(double v) { if constexpr (W == 16) return _mm512_set1_pd(v); else return _mm256_set1_pd(v); }
template <int W>
inline Doubles<W> dsub(Doubles<W> a, Doubles<W> b) {
  if constexpr (W == 16) return _mm512_sub_pd(a, b); else return _mm256_sub_pd(a, b);
}
template <int W>
inline Doubles<W> dmul(Doubles<W> a, Doubles<W> b) {
  if constexpr (W == 16) return _mm512_mul_pd(a, b); else return _mm256_mul_pd(a, b);
}
// fp32 of each lane of two halves, correctly rounded, as one register.
template <int W>
inline RegF<W> djoin(Doubles<W> a, Doubles<W> b) {
  if constexpr (W == 16) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm512_cvtpd_ps(a))),
                                               _mm256_castps_pd(_mm512_cvtpd_ps(b)), 1));
  } else {
    return _mm256_set_m128(_mm256_cvtpd_ps(b), _mm256_cvtpd_ps(a));
  }
}

// fp32(16 num) / fp32(den) and fp32(16 P) / fp32(n den) of each lane's fit (below), rounded
// half to even; ok: den > 0 and num > 0. Every product and difference is an integer below
// 2^53, exact in double, so its fp32 is the reference's conversion of the int64.
template <int W>
inline void int4_quotients(const Int4Sums<W>& q, RegI<W> ST, int64_t n, RegF<W>* fs, RegF<W>* fm, RegF<W>* ok) {
  const Doubles<W> dn = dset<W>(static_cast<double>(n)), sixteen = dset<W>(16.0);
  Doubles<W> num[2], den[2], p[2], nden[2];
  for (int h = 0; h < 2; ++h) {
    const Doubles<W> l = dhalf<W>(q.l, h), ll = dhalf<W>(q.ll, h), lt = dhalf<W>(q.lt, h), st = dhalf<W>(ST, h);
    den[h] = dsub<W>(dmul<W>(dn, ll), dmul<W>(l, l));
    num[h] = dsub<W>(dmul<W>(dn, lt), dmul<W>(l, st));
    p[h] = dmul<W>(sixteen, dsub<W>(dmul<W>(st, den[h]), dmul<W>(num[h], l)));
    nden[h] = dmul<W>(dn, den[h]);
    num[h] = dmul<W>(sixteen, num[h]);
  }
  const RegF<W> fnum = djoin<W>(num[0], num[1]), fden = djoin<W>(den[0], den[1]);
  const RegF<W> fp = djoin<W>(p[0], p[1]), fnden = djoin<W>(nden[0], nden[1]);
  // ok as 1.0 / 0.0 lanes; a lane not ok divides by 1 and is dropped by the caller
  if constexpr (W == 16) {
    const __mmask16 good = _mm512_cmp_ps_mask(fden, _mm512_setzero_ps(), _CMP_GT_OQ) &
                           _mm512_cmp_ps_mask(fnum, _mm512_setzero_ps(), _CMP_GT_OQ);
    const __m512 one = _mm512_set1_ps(1.0f);
    *ok = _mm512_maskz_mov_ps(good, one);
    *fs = vrint(_mm512_div_ps(fnum, _mm512_mask_mov_ps(one, good, fden)));
    *fm = vrint(_mm512_div_ps(fp, _mm512_mask_mov_ps(one, good, fnden)));
  } else {
    const __m256 good = _mm256_and_ps(_mm256_cmp_ps(fden, _mm256_setzero_ps(), _CMP_GT_OQ),
                                      _mm256_cmp_ps(fnum, _mm256_setzero_ps(), _CMP_GT_OQ));
    const __m256 one = _mm256_set1_ps(1.0f);
    *ok = _mm256_and_ps(good, one);
    *fs = vrint(_mm256_div_ps(fnum, _mm256_blendv_ps(one, fden, good)));
    *fm = vrint(_mm256_div_ps(fp, _mm256_blendv_ps(one, fnden, good)));
  }
}

// A least-squares fit of the line 16 T ~ M + l S to each group's codes (sums q): S and M, and
// whether the fit is usable (kv_quant.int4_ranges: den > 0, num > 0, 1 <= S < 2^22, |M| < 2^22).
template <int W>
inline void int4_fit(const Int4Sums<W>& q, RegI<W> ST, int64_t n, int32_t* S, int32_t* M, bool* valid) {
  RegF<W> fsv, fmv, okv;
  int4_quotients<W>(q, ST, n, &fsv, &fmv, &okv);
  alignas(64) float fs[W], fm[W], ok[W];
  vstore(fs, fsv);
  vstore(fm, fmv);
  vstore(ok, okv);
  for (int j = 0; j < W; ++j) {
    valid[j] = valid[j] && ok[j] > 0.0f && fs[j] >= 1.0f && fs[j] < 4194304.0f && std::fabs(fm[j]) < 4194304.0f;
    S[j] = valid[j] ? static_cast<int32_t>(fs[j]) : 1;
    M[j] = valid[j] ? static_cast<int32_t>(fm[j]) : 0;
  }
}

// low and scale (before their fp16 rounding) of W groups: vals [W][G] (G a multiple of W),
// their mins and maxes (-0.0 as +0.0).
template <int W>
void int4_grids(const float* vals, int64_t G, const float* smallest, const float* largest, float* low, float* scale) {
  alignas(64) float span[W], inverse[W], per_unit[W], keep[W];
  bool fits[W];
  for (int j = 0; j < W; ++j) {
    span[j] = largest[j] - smallest[j];
    inverse[j] = 1048576.0f / span[j];  // 16 * 2^16
    fits[j] = span[j] > 0.0f && std::isfinite(span[j]) && std::isfinite(inverse[j]);
    per_unit[j] = 65536.0f / (fits[j] ? span[j] : 1.0f);
    keep[j] = fits[j] ? 1.0f : 0.0f;
    low[j] = smallest[j];
    scale[j] = span[j] / 15.0f;
  }
  Int4Batch<W> b;
  b.G = G;
  alignas(64) int32_t lane_at[W];
  for (int j = 0; j < W; ++j) lane_at[j] = static_cast<int32_t>(j * G);
  const RegI<W> at = load_ints<W>(lane_at);
  const RegF<W> lo = vload<W>(smallest), pu = vload<W>(per_unit), kp = vload<W>(keep);
  const RegF<W> unit = splat<W>(65536.0f);
  b.ST = isplat<W>(0);
  for (int64_t i = 0; i < G; ++i) {
    // T = rint((x - min) * (2^16 / span)), 0 where the group is not searched (there the value
    // may be inf or NaN: max and min with 0 and 2^16 make it finite before the product with 0)
    const RegF<W> x = gather_lanes<W>(vals + i, at);
    const RegF<W> t = vmul(vmin(vmax(vrint(vmul(vsub(x, lo), pu)), vzero<W>()), unit), kp);
    b.t[i] = t;
    b.u[i] = vmul(t, splat<W>(16.0f));
    b.place[i] = to_int32<W>(t);
    b.ST = iadd<W>(b.ST, b.place[i]);
  }
  // The plain grid first.
  alignas(64) int64_t best[W], err[W];
  const RegI<W> plain_S = isplat<W>(kInt4PlainS), zero_i = isplat<W>(0);
  int4_errors<W>(int4_pass<W, true, true>(b, vzero<W>(), splat<W>(1.0f / static_cast<float>(kInt4PlainS)), zero_i,
                                          plain_S), best);
  alignas(64) int32_t best_S[W], best_M[W];
  bool refined[W];
  for (int j = 0; j < W; ++j) {
    best_S[j] = kInt4PlainS;
    best_M[j] = 0;
    refined[j] = false;
  }
  // Then each start's fits; the starts run one after another, the groups side by side.
  for (const int start : kInt4Starts) {
    Int4Sums<W> q = int4_pass<W, false, false>(b, vzero<W>(), splat<W>(static_cast<float>(start) / 131072.0f),
                                               zero_i, zero_i);
    alignas(64) int32_t S[W], M[W];
    alignas(64) float reciprocal[W], offset[W];
    bool valid[W];
    for (int j = 0; j < W; ++j) valid[j] = fits[j];
    for (int fit = 0; fit < kInt4Fits; ++fit) {
      int4_fit<W>(q, b.ST, G, S, M, valid);
      for (int j = 0; j < W; ++j) {
        reciprocal[j] = 1.0f / static_cast<float>(S[j]);
        offset[j] = static_cast<float>(M[j]);
      }
      const RegF<W> rv = vload<W>(reciprocal), mv = vload<W>(offset);
      if (fit + 1 < kInt4Fits) {
        q = int4_pass<W, true, false>(b, mv, rv, zero_i, zero_i);
      } else {
        q = int4_pass<W, true, true>(b, mv, rv, load_ints<W>(M), load_ints<W>(S));
        int4_errors<W>(q, err);
      }
    }
    for (int j = 0; j < W; ++j) {
      if (valid[j] && err[j] < best[j]) {
        best[j] = err[j];
        best_S[j] = S[j];
        best_M[j] = M[j];
        refined[j] = true;
      }
    }
  }
  for (int j = 0; j < W; ++j) {
    if (!refined[j]) continue;
    low[j] = smallest[j] + static_cast<float>(best_M[j]) / inverse[j];
    scale[j] = static_cast<float>(best_S[j]) / inverse[j];
  }
}

// int4 rows: rows [n, H, D] of element type R into slots (quantize_rows' contract). Per group
// of G channels (-0.0 extremes as +0.0): low = fp16 of int4_grids' low, s = fp16 of its scale,
// codes rint((x - low) / s) clipped to [0, 15] (0 where s is 0), two a byte (element 2j low).
// Groups go W at a time through the search, batches spread over the thread pool when many.
template <int R>
void quantize_rows_int4(uint8_t* cache, const QuantLayout& L, const void* rows, int64_t stride_token,
                        int64_t stride_head, const int64_t* slots, int64_t n) {
  constexpr int W = kVecLanes;
  const int64_t G = L.group, per_row = L.head_dim / G, per_token = L.heads * per_row;
  const int64_t total = n * per_token, batches = (total + W - 1) / W;
  const int64_t work = n * L.heads * L.head_dim;
  struct Place {
    int64_t t, h, g;  // token, head, group within the head
  };
  const auto place_of = [&](int64_t index) { return Place{index / per_token, index % per_token / per_row, index % per_row}; };
#pragma omp parallel for schedule(static) if (work >= (1 << 14))
  for (int64_t batch = 0; batch < batches; ++batch) {
    alignas(64) float vals[W * 16 * kMaxChunks], smallest[W], largest[W], low[W], scale[W];
    for (int j = 0; j < W; ++j) {
      const Place p = place_of(std::min(batch * W + j, total - 1));  // lanes past the end repeat the last group
      const int64_t source = p.t * stride_token + p.h * stride_head + p.g * G;
      Vec mn = splat<W>(std::numeric_limits<float>::infinity()), mx = splat<W>(-std::numeric_limits<float>::infinity());
      for (int64_t c = 0; c < G; c += W) {
        const Vec x = load_lanes<W, R>(rows, source + c);
        vstore(vals + j * G + c, x);
        mn = vmin(mn, x);
        mx = vmax(mx, x);
      }
      // + 0 turns -0.0 into +0.0 (as the reference does): which signed zero min/max return
      // depends on the order of the elements.
      smallest[j] = lanes_min(mn) + 0.0f;
      largest[j] = lanes_max(mx) + 0.0f;
    }
    int4_grids<W>(vals, G, smallest, largest, low, scale);
    for (int j = 0; j < W && batch * W + j < total; ++j) {
      const Place p = place_of(batch * W + j);
      uint8_t* codes = cache + L.codes_of(slots[p.t]) + p.h * L.code_bytes + p.g * G / 2;
      uint8_t* scales = cache + L.scales_of(slots[p.t]) + p.h * L.scale_bytes + 4 * p.g;
      const uint16_t low_half = _cvtss_sh(low[j], _MM_FROUND_TO_NEAREST_INT);
      const uint16_t scale_half = _cvtss_sh(scale[j], _MM_FROUND_TO_NEAREST_INT);
      std::memcpy(scales, &scale_half, 2);
      std::memcpy(scales + 2, &low_half, 2);
      const float s = _cvtsh_ss(scale_half), lowf = _cvtsh_ss(low_half);
      alignas(64) uint8_t nibbles[16 * kMaxChunks];
      if (!(s > 0.0f)) {
        std::memset(nibbles, 0, G);
      } else {
        const Vec sv = splat<W>(s), lv = splat<W>(lowf), top = splat<W>(15.0f);
        for (int64_t c = 0; c < G; c += W) {
          const Vec y = vmin(vmax(vrint(vdiv(vsub(vload<W>(vals + j * G + c), lv), sv)), vzero<W>()), top);
          store_low_bytes<W>(nibbles + c, to_int32<W>(y));
        }
      }
      for (int64_t k = 0; k < G / 2; ++k) codes[k] = static_cast<uint8_t>(nibbles[2 * k] | (nibbles[2 * k + 1] << 4));
    }
  }
}

}  // namespace
