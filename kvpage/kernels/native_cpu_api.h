// kvpage native CPU kernels: the C interface, the same for every instruction-set variant.
// Included last by each variant (see native_cpu_common.h); the contract of every entry point
// is documented in native_cpu.py.
//
// `cache_format` is a native_cpu.CACHE_FORMATS code: the element type itself (0-2, the caches
// hold q's element type, laid out [num_blocks, block_size, H_kv, D]) or a quantized format
// (3-6, uint8 [num_blocks, block_bytes] buffers, native_cpu_quant.h).

#pragma once

namespace {

// 0 where the caches hold elem_type values, 1 where they are quantized (L filled in), -2 for a
// cache format the kernels do not take with this element type and these shapes.
inline int cache_kind(int elem_type, int cache_format, int64_t block_size, int64_t heads, int64_t head_dim,
                      QuantLayout* L) {
  if (elem_type < kF32 || elem_type > kBF16) return -2;
  if (cache_format == elem_type) return 0;
  return make_quant_layout(cache_format, block_size, heads, head_dim, L) ? 1 : -2;
}

}  // namespace

extern "C" {

// Version of this C interface; native_cpu.py refuses a library that differs.
int kvpage_native_abi() { return 7; }

// 1 when bf16 prefill attention of this head size runs on the AMX tile unit here (the CPU
// has it, the kernel was built for it, Linux granted the tile state, KVPAGE_AMX is not 0).
int kvpage_prefill_uses_amx(int elem_type, int64_t head_dim) { return prefill_on_amx(elem_type, head_dim) ? 1 : 0; }

// Paged decode attention (see native_cpu.decode_attention). Returns 0, or a negative code
// for shapes this kernel does not take (the caller checks them first).
int kvpage_decode_attention(int elem_type, int cache_format, const void* q, int64_t q_stride_token,
                            int64_t q_stride_head, const void* key_cache, const void* value_cache, int64_t block_size,
                            int64_t num_kv_heads, int64_t head_dim, int64_t num_heads, const int32_t* block_tables,
                            int64_t table_stride, const int32_t* seq_lens, int64_t num_seqs, float scale,
                            int64_t window, float softcap, const float* sinks, void* out, int64_t num_splits,
                            int num_threads) {
  if (head_dim % 16 || head_dim > 16 * kMaxChunks || num_kv_heads <= 0 || num_heads % num_kv_heads || num_splits < 1)
    return -1;
  QuantLayout layout;
  const int kind = cache_kind(elem_type, cache_format, block_size, num_kv_heads, head_dim, &layout);
  if (kind < 0) return kind;
  std::vector<float> part_acc, part_stats;
  if (num_splits > 1) {
    part_acc.resize(num_seqs * num_heads * num_splits * head_dim);
    part_stats.resize(num_seqs * num_heads * num_splits * 2);
  }
  DecodeArgs a{{q, q_stride_token, q_stride_head, key_cache, value_cache, block_size, num_kv_heads, head_dim,
                num_heads, block_tables, table_stride, seq_lens, scale, window, softcap, sinks, out},
               num_seqs, num_splits, part_acc.data(), part_stats.data()};
  if (kind == 1) {
    switch (elem_type) {
      case kF32: quant_decode<kF32>(a, layout, num_threads); break;
      case kF16: quant_decode<kF16>(a, layout, num_threads); break;
      default: quant_decode<kBF16>(a, layout, num_threads); break;
    }
    return 0;
  }
  switch (elem_type) {
    case kF32: decode_typed<kF32>(a, num_threads); break;
    case kF16: decode_typed<kF16>(a, num_threads); break;
    case kBF16: decode_typed<kBF16>(a, num_threads); break;
    default: return -2;
  }
  return 0;
}

// cache[slots[t]] = rows[t] for t < n: rows [n, H_kv, D] of elem_bytes elements at `rows`
// (token and head strides in elements, D contiguous), cache rows [num_slots, H_kv, D].
// Every slot is checked before anything is written: returns 0, or 1 + the index of the
// first slot outside the cache.
int64_t kvpage_store_rows(void* cache, int64_t num_slots, int64_t num_kv_heads, int64_t head_dim, int64_t elem_bytes,
                          const void* rows, int64_t stride_token, int64_t stride_head, const int64_t* slots,
                          int64_t n) {
  for (int64_t t = 0; t < n; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return t + 1;
  const int64_t head_bytes = head_dim * elem_bytes, row_bytes = num_kv_heads * head_bytes;
  for (int64_t t = 0; t < n; ++t) {
    char* dst = static_cast<char*>(cache) + slots[t] * row_bytes;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      std::memcpy(dst + h * head_bytes,
                  static_cast<const char*>(rows) + (t * stride_token + h * stride_head) * elem_bytes, head_bytes);
  }
  return 0;
}

// The quantized store: cache rows of slots[t] = rows[t] for t < n in `cache_format` (3-6),
// rows [n, H_kv, D] of rows_type elements (token and head strides in elements, D contiguous),
// byte for byte kv_quant.quantize_rows of the rows widened to fp32. Every slot is checked
// before anything is written: returns 0, 1 + the index of the first slot outside the cache,
// -1 for a format or head size it does not take, -2 for a row type it does not take.
int64_t kvpage_store_quantized(int cache_format, void* cache, int64_t num_blocks, int64_t block_size,
                               int64_t num_kv_heads, int64_t head_dim, int rows_type, const void* rows,
                               int64_t stride_token, int64_t stride_head, const int64_t* slots, int64_t n) {
  QuantLayout layout;
  if (!make_quant_layout(cache_format, block_size, num_kv_heads, head_dim, &layout)) return -1;
  if (rows_type < kF32 || rows_type > kBF16) return -2;
  for (int64_t t = 0; t < n; ++t)
    if (slots[t] < 0 || slots[t] >= num_blocks * block_size) return t + 1;
  quantize_rows_any(rows_type, static_cast<uint8_t*>(cache), layout, rows, stride_token, stride_head, slots, n);
  return 0;
}

// Scatter n new K/V rows ([n, H_kv, D] at k/v, token and head strides in elements, D
// contiguous) into the caches' slots, then decode attention; the write is skipped when k is
// null (a layer reading another layer's KV); a quantized cache_format quantizes them as
// kvpage_store_quantized. Returns 0, a negative code as above, or 1 + the index of the first
// slot outside the cache (nothing is then written or attended).
int64_t kvpage_write_decode(int elem_type, int cache_format, const void* q, int64_t q_stride_token,
                            int64_t q_stride_head, const void* k, int64_t k_stride_token, int64_t k_stride_head,
                            const void* v, int64_t v_stride_token, int64_t v_stride_head, const int64_t* slots,
                            int64_t num_new, void* key_cache, void* value_cache, int64_t num_blocks,
                            int64_t block_size, int64_t num_kv_heads, int64_t head_dim, int64_t num_heads,
                            const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens,
                            int64_t num_seqs, float scale, int64_t window, float softcap, const float* sinks,
                            void* out, int64_t num_splits, int num_threads) {
  if (k != nullptr && cache_format != elem_type) {
    const int64_t bad = kvpage_store_quantized(cache_format, key_cache, num_blocks, block_size, num_kv_heads, head_dim,
                                               elem_type, k, k_stride_token, k_stride_head, slots, num_new);
    if (bad > 0) return bad;
    if (bad < 0) return -2;
    kvpage_store_quantized(cache_format, value_cache, num_blocks, block_size, num_kv_heads, head_dim, elem_type, v,
                           v_stride_token, v_stride_head, slots, num_new);
  } else if (k != nullptr) {
    const int64_t elem = elem_type == kF32 ? 4 : 2, num_slots = num_blocks * block_size;
    const int64_t bad = kvpage_store_rows(key_cache, num_slots, num_kv_heads, head_dim, elem, k, k_stride_token,
                                          k_stride_head, slots, num_new);
    if (bad) return bad;  // V goes to the same slots, so it cannot fail once K did not
    kvpage_store_rows(value_cache, num_slots, num_kv_heads, head_dim, elem, v, v_stride_token, v_stride_head, slots,
                      num_new);
  }
  return kvpage_decode_attention(elem_type, cache_format, q, q_stride_token, q_stride_head, key_cache, value_cache,
                                 block_size, num_kv_heads, head_dim, num_heads, block_tables, table_stride, seq_lens,
                                 num_seqs, scale, window, softcap, sinks, out, num_splits, num_threads);
}

// Attention of the query rows of sequences first_seq .. num_seqs - 1 (each the last q_len
// positions of its context, causal, optional sliding window / softcap / sinks) into the
// same rows of out; rows of earlier sequences are left alone. Returns 0 or a negative code.
int kvpage_prefill_attention(int elem_type, int cache_format, const void* q, int64_t q_stride_token,
                             int64_t q_stride_head, const void* key_cache, const void* value_cache, int64_t block_size,
                             int64_t num_kv_heads, int64_t head_dim, int64_t num_heads, const int32_t* block_tables,
                             int64_t table_stride, const int32_t* query_start_loc, const int32_t* seq_lens,
                             int64_t first_seq, int64_t num_seqs, float scale, int64_t window, float softcap,
                             const float* sinks, void* out, int num_threads) {
  if (head_dim % 16 || head_dim > 16 * kMaxChunks || num_kv_heads <= 0 || num_heads % num_kv_heads || block_size <= 0)
    return -1;
  QuantLayout layout;
  const int kind = cache_kind(elem_type, cache_format, block_size, num_kv_heads, head_dim, &layout);
  if (kind < 0) return kind;
  const int64_t tile = kind == 1 ? kQuantQueryTile : prefill_query_tile(elem_type, head_dim);
  std::vector<PrefillItem> items;
  for (int64_t i = first_seq; i < num_seqs; ++i) {
    const int64_t q_len = query_start_loc[i + 1] - query_start_loc[i];
    if (q_len > seq_lens[i]) return -3;
    for (int64_t end = q_len; end > 0; end -= tile)  // the last rows (most keys) first
      for (int64_t h = 0; h < num_kv_heads; ++h)
        items.push_back({i, h, std::max<int64_t>(end - tile, 0), std::min(tile, end)});
  }
  PrefillArgs a{{q, q_stride_token, q_stride_head, key_cache, value_cache, block_size, num_kv_heads, head_dim,
                 num_heads, block_tables, table_stride, seq_lens, scale, window, softcap, sinks, out},
                query_start_loc};
  if (kind == 1) {
    switch (elem_type) {
      case kF32: quant_prefill<kF32>(a, layout, items, num_threads); break;
      case kF16: quant_prefill<kF16>(a, layout, items, num_threads); break;
      default: quant_prefill<kBF16>(a, layout, items, num_threads); break;
    }
    return 0;
  }
  switch (elem_type) {
    case kF32: prefill_typed<kF32>(a, items, num_threads); break;
    case kF16: prefill_typed<kF16>(a, items, num_threads); break;
    case kBF16: prefill_typed<kBF16>(a, items, num_threads); break;
    default: return -2;
  }
  return 0;
}

// For each of `rows` float32 rows (`cols` values each, `row_stride` elements apart): its
// maximum and the index of its first maximal value, as torch.max(dim=-1) gives them (NaN
// propagates, its index is the first NaN's). cols < 2^31.
void kvpage_row_argmax(const float* x, int64_t rows, int64_t cols, int64_t row_stride, float* out_max,
                       int64_t* out_idx, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) row_argmax(x + r * row_stride, cols, out_max + r, out_idx + r);
}

}  // extern "C"
