// What every key loop of the CPU paged-attention kernel shares: tile sizes, per-thread scratch and
// the view of one work item (where its keys live, which rows it owns, what each row may see).
#pragma once

#include "cpu_common.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace vllm_lite {
namespace attn {

constexpr int64_t kKeyTile = 32;      // keys per softmax step (two AVX-512 registers of scores)
constexpr int64_t kRowsPerItem = 64;  // target query rows (tokens x heads) per work item
constexpr int64_t kDecodeChunk = 256;  // keys per softmax pass of the bf16 decode path (attention_decode_bf16.h)


// Per-thread scratch, sized once per call.
struct Scratch {
  std::vector<float> q, acc, row_max, row_sum, k_t, v, sc, alpha, kc, vp;
  // q is padded to a multiple of 4 rows (zeros) so the vector paths can score rows four at a time; sc (the
  // decode path's scores of one chunk) likewise. kc / vp (the bf16 prefill path's transposed keys and paired
  // values of one chunk, kDecodeChunk * d bf16 each) only where that path runs (chunk_buffers).
  Scratch(int64_t rows, int64_t d, bool chunk_buffers = false)
      : q(((rows + 3) / 4) * 4 * d, 0.0f), acc(rows * d), row_max(rows), row_sum(rows), k_t(d * kKeyTile),
        v(kKeyTile * d), sc(((rows + 3) / 4) * 4 * kDecodeChunk, 0.0f), alpha(rows),
        kc(chunk_buffers ? kDecodeChunk * d / 2 : 0), vp(chunk_buffers ? kDecodeChunk * d / 2 : 0) {}
};

// What one work item needs to stream its keys: where they live and which rows it owns.
template <typename T>
struct ItemView {
  const T* k_cache;
  const T* v_cache;
  const int32_t* table;  // the request's block table row
  int64_t block_size, blk_stride, tok_stride, kv_off;  // kv_off: this KV head's offset in a token row
  int64_t ctx;           // position of the item's first query token
  int64_t rows, group;   // rows = tokens * group; row r is token r / group
  int64_t num_keys;      // keys key_begin..num_keys-1 are visible to some row
  int64_t window;        // sliding window, 0 = none
  int64_t key_begin;     // first key any row sees (0 without a window)
  float soft_cap;        // 0 = none

  // Cache offsets of keys k0..k0+n-1, walking the block table without a division per key.
  void tile_offsets(int64_t k0, int64_t n, int64_t* offs) const {
    int64_t blk = k0 / block_size, in_blk = k0 % block_size;
    int64_t base = static_cast<int64_t>(table[blk]) * blk_stride + kv_off;
    for (int64_t j = 0; j < n; ++j) {
      offs[j] = base + in_blk * tok_stride;
      if (++in_blk == block_size && j + 1 < n) {
        in_blk = 0;
        base = static_cast<int64_t>(table[++blk]) * blk_stride + kv_off;
      }
    }
  }
  // Keys of the tile starting at k0 that row r may see (causal), clamped to [0, kn].
  int64_t visible(int64_t r, int64_t k0, int64_t kn) const {
    return std::max<int64_t>(0, std::min(kn, ctx + r / group + 1 - k0));
  }
  // First key of that tile row r may see (the window's lower edge), clamped to [0, kn].
  int64_t first_visible(int64_t r, int64_t k0, int64_t kn) const {
    if (window <= 0) return 0;
    return std::max<int64_t>(0, std::min(kn, ctx + r / group - window + 1 - k0));
  }
};

}  // namespace attn
}  // namespace vllm_lite
