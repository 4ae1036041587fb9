// kvpage native CPU kernels: what every instruction-set variant shares.
//
// native_cpu.cpp (AVX-512) and native_cpu_avx2.cpp (AVX2 + FMA) each include this header
// first, define the kernels below in their own way, then include native_cpu_api.h, which
// holds the one C interface both export (native_cpu.py loads whichever the CPU runs). A
// variant provides, inside the anonymous namespace:
//
//   template <int T> void decode_typed(const DecodeArgs&, int num_threads);
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
#include <vector>

#include <xmmintrin.h>  // _mm_prefetch

namespace {

constexpr int kF32 = 0, kF16 = 1, kBF16 = 2;  // cache and q element types (MODE_* in numba_math)
constexpr int64_t kPartition = 64;  // decode: tokens per softmax partition, its K/V rows stay in L1
constexpr int kMaxChunks = 16;      // head_dim <= 256, in 16-float chunks

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


// Element offsets in the cache of the token rows pb .. min(pb + kPartition, end) (all
// heads, `row` elements each); returns how many.
inline int64_t row_offsets(const PagedLayer& a, const int32_t* table, int64_t row, int64_t pb, int64_t end,
                           int64_t* offs) {
  const int64_t n = std::max<int64_t>(0, std::min(pb + kPartition, end) - pb);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t t = pb + j;
    offs[j] = (static_cast<int64_t>(table[t / a.block_size]) * a.block_size + t % a.block_size) * row;
  }
  return n;
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

}  // namespace
