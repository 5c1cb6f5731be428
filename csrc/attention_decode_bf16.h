// Decode fast path of the CPU paged-attention kernel: bfloat16 KV cache, one query token per work item,
// AVX512-BF16 (VDPBF16PS) for the scores. Compiled only where the build targets AVX512-BF16 (Zen 4,
// Sapphire Rapids, ... under -march=native); elsewhere the AVX-512 / AVX2 key loops run decodes too.
//
// Why a separate path: a decode item holds only `group` query rows (3 for the bench model), so the general
// key loop's per-16-key work (float32 conversion and transpose of the keys, an online-softmax update with a
// scalar exp and two horizontal reductions per row, the accumulators reloaded and stored) dominated: 0.85 ms
// for 32 sequences x 300 keys x 12 heads on 2 Zen 4 cores (benchmarks/attention.py). Here, per chunk of up to
// kDecodeChunk keys:
//   1. scores: each 16-key tile's bf16 pairs are transposed as 32-bit lanes (no conversion) and every row's
//      16 scores come from D/2 VDPBF16PS against a broadcast bf16 query pair (exact bf16 products, float32 sums);
//   2. softmax: one max over the chunk's scores, one exp pass, one sum per row (online rescale only between
//      chunks, so a context of <= kDecodeChunk keys needs none);
//   3. values: two keys per VDPBF16PS against bf16 probabilities, the rows' accumulators held in registers.
// A decode request is one work unit with all its KV heads (decode_bf16_request; a request split between two threads,
// some of its heads each): each token row of the cache (every KV head's keys, then values) is read once, and each
// thread runs its share of the batch's decodes as one stream
// (DecodeStream) whose software prefetches run a fixed distance ahead through both passes and across requests, so
// DRAM keeps streaming while the thread computes. Per-head items that prefetched a request's token rows during its
// first KV head only left DRAM idle while the other heads ran: 5.1 -> 4.1 ms a 12-layer step (32 decodes, contexts
// 97-321, 84.6 MB of KV; 2 Zen 4 threads, KV from DRAM), against ~3.3 ms for a contiguous read of the same bytes.
// Results depend only on the row's own query and keys (not on the batch, the thread count or the work order),
// so bf16 greedy decoding stays the same run to run.
#pragma once

#include "attention_common.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "attention_avx512.h"

#define VLLM_LITE_ATTN_DECODE_BF16 1

namespace vllm_lite {
namespace attn {

inline __m512bh as_bh512(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// Scores of NR rows against one transposed 16-key tile kt ([D/2][16] key pairs as 32-bit lanes), times scale.
template <int64_t D, int NR>
inline void decode_scores(const uint32_t* qdw, const float* kt, float scale, float* dst, int64_t dst_stride) {
  __m512 a[NR];
  for (int i = 0; i < NR; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < D / 2; ++d2) {
    const __m512i kd = _mm512_castps_si512(_mm512_loadu_ps(kt + d2 * 16));
    for (int i = 0; i < NR; ++i) {
      a[i] = _mm512_dpbf16_ps(a[i], as_bh512(kd), as_bh512(_mm512_set1_epi32(static_cast<int>(qdw[i * (D / 2) + d2]))));
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int i = 0; i < NR; ++i) _mm512_storeu_ps(dst + i * dst_stride, _mm512_mul_ps(a[i], sv));
}

// One decode request (a single query token) as the fused path sees it: where its block table row, keys, query
// and output rows are. The view's kv_off is 0 (the token row's start); rows = group.
struct DecodeReq {
  ItemView<c10::BFloat16> it;
  const c10::BFloat16* q;  // the token's first query head
  c10::BFloat16* out;      // the token's first output head
};

// How far ahead the decode stream prefetches, in keys (token rows; micro-benchmarked on Zen 4, 2 threads, the vs_vllm
// decode step): while a chunk is scored (pass 1), its keys kDecodeAheadK keys ahead and its values kDecodeAheadV keys
// ahead; while a chunk's values are summed (pass 3), the stream's next kDecodeNextK keys.
constexpr int64_t kDecodeAheadK = 64;
constexpr int64_t kDecodeAheadV = 16;
constexpr int64_t kDecodeNextK = 128;

// One thread's run of decode requests as one stream of keys (request after request, each from its key_begin), with
// two prefetch cursors running ahead of the compute: one over the keys' token rows (the run's KV heads' keys, towards
// L2), one over the values' token rows. The kernel moves them a little at every head of every tile, in both the
// scores and the values passes, so DRAM streams evenly the whole time the thread computes (and across request
// boundaries) instead of in bursts. A run may start and end inside a request (the threads' shares are split at
// (request, KV head) units): its first request's heads from first_head, its last request's up to last_head_end;
// the cursors then fetch only those heads' part of each token row.
class DecodeStream {
 public:
  DecodeStream(const DecodeReq* reqs, int64_t n, int64_t num_kv_heads, int64_t head_size, int64_t first_head,
               int64_t last_head_end)
      : reqs_(reqs), n_(n), k_(reqs, n, num_kv_heads, head_size, first_head, last_head_end),
        v_(reqs, n, num_kv_heads, head_size, first_head, last_head_end) {}
  // Position in the stream of request i's key `key` (requests are started in order, so i is the current one).
  int64_t pos(int64_t i, int64_t key) {
    while (base_i_ < i) base_ += reqs_[base_i_].it.num_keys - reqs_[base_i_].it.key_begin, ++base_i_;
    return base_ + key - reqs_[i].it.key_begin;
  }
  void keys_until(int64_t target) { k_.until(target, false); }
  void values_until(int64_t target) { v_.until(target, true); }

 private:
  struct Cursor {
    const DecodeReq* reqs;
    int64_t n, i = 0, key = 0, at = 0;  // request, key, stream position
    int64_t blk = 0, in_blk = 0;        // key's block (index into the table row) and slot in it
    int64_t kvh, d, first_head, last_head_end;
    int64_t row_lo = 0, row_hi = 0;     // the current request's part of a token row (elements)
    Cursor(const DecodeReq* r, int64_t nn, int64_t num_kv_heads, int64_t head_size, int64_t h0, int64_t h1)
        : reqs(r), n(nn), kvh(num_kv_heads), d(head_size), first_head(h0), last_head_end(h1) {
      if (n > 0) start(r[0].it);
    }
    void start(const ItemView<c10::BFloat16>& it) {
      key = it.key_begin;
      blk = key / it.block_size;
      in_blk = key % it.block_size;
      row_lo = i == 0 ? first_head * d : 0;
      row_hi = i + 1 == n ? last_head_end * d : kvh * d;
    }
    void until(int64_t target, bool values) {
      constexpr int64_t line = 64 / static_cast<int64_t>(sizeof(c10::BFloat16));
      while (at < target && i < n) {
        const ItemView<c10::BFloat16>& it = reqs[i].it;
        if (key >= it.num_keys) {
          if (++i < n) start(reqs[i].it);
          continue;
        }
        const int64_t off = static_cast<int64_t>(it.table[blk]) * it.blk_stride + in_blk * it.tok_stride;
        const c10::BFloat16* row = (values ? it.v_cache : it.k_cache) + off;
        for (int64_t e = row_lo; e < row_hi; e += line) {
          _mm_prefetch(reinterpret_cast<const char*>(row + e), _MM_HINT_T1);
        }
        if (++in_blk == it.block_size) in_blk = 0, ++blk;
        ++key;
        ++at;
      }
    }
  };
  const DecodeReq* reqs_;
  int64_t n_, base_ = 0, base_i_ = 0;
  Cursor k_, v_;
};

// acc[NR] += sum_j p[i][j] * v_j over the chunk's keys, two keys per VDPBF16PS: the probabilities as bf16 pairs
// (pb: row i's pair m at pb[i * pb_stride + m]), each key pair's values interleaved by unpack (so the accumulator
// of value register c holds d = 32c + 8l + k in its "lo" half and 32c + 8l + 4 + k in its "hi" half, lane
// group l, k < 4; decode_bf16_request undoes that when it writes the output). Probabilities are rounded to bf16 before
// they weigh the values, as Hugging Face's eager attention rounds its softmax to the query dtype.
template <int64_t D, int NR>
inline void decode_values(const ItemView<c10::BFloat16>& it, int64_t c0, int64_t cn, const uint32_t* pb,
                          int64_t pb_stride, const float* alpha, float* acc, DecodeStream& stream, int64_t pf_from,
                          int64_t pf_to) {
  constexpr int NV = static_cast<int>(D / 32);  // bf16 registers per value row
  __m512 a[NR][2 * NV];
  for (int i = 0; i < NR; ++i) {
    const __m512 al = _mm512_set1_ps(alpha[i]);
    for (int c = 0; c < 2 * NV; ++c) a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + 16 * c), al);
  }
  for (int64_t t0 = 0; t0 < cn; t0 += 16) {
    const int64_t kn = std::min<int64_t>(16, cn - t0);
    stream.keys_until(pf_from + (pf_to - pf_from) * (t0 + kn) / cn);
    int64_t offs[16];
    it.tile_offsets(c0 + t0, kn, offs);
    for (int64_t j = 0; j < kn; j += 2) {
      const c10::BFloat16* va = it.v_cache + offs[j];
      const c10::BFloat16* vb = j + 1 < kn ? it.v_cache + offs[j + 1] : nullptr;
      __m512i lo[NV], hi[NV];
      for (int c = 0; c < NV; ++c) {
        const __m512i x = _mm512_loadu_si512(va + 32 * c);
        const __m512i y = vb != nullptr ? _mm512_loadu_si512(vb + 32 * c) : _mm512_setzero_si512();
        lo[c] = _mm512_unpacklo_epi16(x, y);
        hi[c] = _mm512_unpackhi_epi16(x, y);
      }
      const int64_t m = (t0 + j) / 2;
      for (int i = 0; i < NR; ++i) {
        const __m512i pp = _mm512_set1_epi32(static_cast<int>(pb[i * pb_stride + m]));
        for (int c = 0; c < NV; ++c) {
          a[i][2 * c] = _mm512_dpbf16_ps(a[i][2 * c], as_bh512(lo[c]), as_bh512(pp));
          a[i][2 * c + 1] = _mm512_dpbf16_ps(a[i][2 * c + 1], as_bh512(hi[c]), as_bh512(pp));
        }
      }
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int c = 0; c < 2 * NV; ++c) _mm512_storeu_ps(acc + i * D + 16 * c, a[i][c]);
  }
}

// One decode request, its KV heads hb..he-1 (all of them unless the request is split between two threads) in one
// pass over its keys (each token row's part of the cache is read once): it.rows (= group) query rows per KV head,
// query head h at r.q + h * q_head_stride. Per chunk of up to kDecodeChunk keys: every head's scores tile by tile,
// the softmax of every row, then every head's values. Each row's arithmetic is the one a per-head item would do
// (same chunks, tiles and order, nothing shared between KV heads), so the results are the same bits whichever heads
// a call takes. Scratch: s.q holds the rows' bf16 pairs, s.sc the chunk's scores [heads][chunk], s.acc [heads][D]
// (sized for num_kv_heads * group rows; a call uses the rows of its heads).
template <int64_t D>
void decode_bf16_request(const DecodeReq& r, int64_t req_index, int64_t hb, int64_t he, int64_t q_head_stride,
                         int64_t o_head_stride, float scale, Scratch& s, DecodeStream& stream) {
  static_assert(D % 32 == 0 && D <= 256, "head size: a multiple of 32 up to 256");
  constexpr int64_t P = D / 2;  // bf16 pairs (32-bit lanes) per row
  const ItemView<c10::BFloat16>& it = r.it;
  const int64_t G = it.rows;
  const int64_t nh = he - hb;
  const int64_t R0 = hb * G, R1 = he * G;  // this call's rows
  uint32_t* qdw = reinterpret_cast<uint32_t*>(s.q.data());
  for (int64_t h = R0; h < R1; ++h) std::memcpy(qdw + h * P, r.q + h * q_head_stride, D * sizeof(c10::BFloat16));
  float* kt = s.k_t.data();  // [P][16]
  float* sc = s.sc.data();   // [rows][kDecodeChunk]
  float* acc = s.acc.data();
  float* alpha = s.alpha.data();
  std::fill_n(acc + R0 * D, (R1 - R0) * D, 0.0f);
  for (int64_t h = R0; h < R1; ++h) {
    s.row_max[h] = -std::numeric_limits<float>::infinity();
    s.row_sum[h] = 0.0f;
  }
  for (int64_t c0 = it.key_begin; c0 < it.num_keys; c0 += kDecodeChunk) {
    const int64_t cn = std::min<int64_t>(kDecodeChunk, it.num_keys - c0);
    const int64_t g0 = stream.pos(req_index, c0);  // the chunk's start in the thread's stream
    // 1. Scores, tile by tile, every KV head of the tile's token rows in turn.
    for (int64_t t0 = 0; t0 < cn; t0 += 16) {
      const int64_t kn = std::min<int64_t>(16, cn - t0);
      int64_t offs[16];
      it.tile_offsets(c0 + t0, kn, offs);
      for (int64_t kvh = hb; kvh < he; ++kvh) {
        const int64_t step = g0 + t0 + 16 * (kvh - hb + 1) / nh;
        stream.keys_until(step + kDecodeAheadK);
        stream.values_until(step + kDecodeAheadV);
        const c10::BFloat16* kbase = it.k_cache + kvh * D;
        for (int64_t p0 = 0; p0 < P; p0 += 16) {
          __m512 blk[16];
          for (int64_t j = 0; j < 16; ++j) {
            blk[j] = j < kn ? _mm512_loadu_ps(reinterpret_cast<const float*>(kbase + offs[j]) + p0)
                            : _mm512_setzero_ps();
          }
          transpose16(blk);
          for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (p0 + i) * 16, blk[i]);
        }
        for (int64_t r0 = kvh * G; r0 < (kvh + 1) * G; r0 += 4) {
          float* dst = sc + r0 * kDecodeChunk + t0;
          switch (std::min<int64_t>(4, (kvh + 1) * G - r0)) {
            case 1: decode_scores<D, 1>(qdw + r0 * P, kt, scale, dst, kDecodeChunk); break;
            case 2: decode_scores<D, 2>(qdw + r0 * P, kt, scale, dst, kDecodeChunk); break;
            case 3: decode_scores<D, 3>(qdw + r0 * P, kt, scale, dst, kDecodeChunk); break;
            default: decode_scores<D, 4>(qdw + r0 * P, kt, scale, dst, kDecodeChunk); break;
          }
        }
      }
    }
    // 2. Softmax over the chunk (keys past cn in the last tile are masked out).
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t h = R0; h < R1; ++h) {
      float* srow = sc + h * kDecodeChunk;
      __m512 mx = neg_inf;
      for (int64_t t = 0; t < cn; t += 16) {
        const __mmask16 m = cn - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (cn - t)) - 1u);
        mx = _mm512_mask_max_ps(mx, m, mx, _mm512_loadu_ps(srow + t));
      }
      const float new_max = std::max(s.row_max[h], _mm512_reduce_max_ps(mx));
      alpha[h] = std::exp(s.row_max[h] - new_max);  // 0 on the first chunk
      const __m512 nm = _mm512_set1_ps(new_max);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < cn; t += 16) {
        const __mmask16 m = cn - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (cn - t)) - 1u);
        const __m512 p = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(srow + t), nm)));
        // bf16 probabilities overwrite the row's first half (bytes 2t.. while the floats read are at 4t..).
        const __m256bh hb = _mm512_cvtneps_pbh(p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<c10::BFloat16*>(srow) + t),
                            reinterpret_cast<const __m256i&>(hb));
        sum = _mm512_add_ps(sum, p);
      }
      s.row_max[h] = new_max;
      s.row_sum[h] = s.row_sum[h] * alpha[h] + _mm512_reduce_add_ps(sum);
    }
    // 3. Values, per KV head, its rows in register blocks (a block's accumulators stay in registers over the chunk).
    constexpr int64_t RB = D <= 64 ? 4 : D <= 128 ? 2 : 1;
    for (int64_t kvh = hb; kvh < he; ++kvh) {
      ItemView<c10::BFloat16> hv = it;
      hv.kv_off = kvh * D;
      stream.values_until(g0 + cn);
      for (int64_t r0 = kvh * G; r0 < (kvh + 1) * G; r0 += RB) {
        const uint32_t* pb = reinterpret_cast<const uint32_t*>(sc + r0 * kDecodeChunk);
        const int64_t nr = std::min<int64_t>(RB, (kvh + 1) * G - r0);
        // This block's share of the next kDecodeNextK keys' prefetch.
        const int64_t nb = (G + RB - 1) / RB, bi = (kvh - hb) * nb + (r0 - kvh * G) / RB;
        const int64_t pf_from = g0 + cn + kDecodeNextK * bi / (nh * nb);
        const int64_t pf_to = g0 + cn + kDecodeNextK * (bi + 1) / (nh * nb);
        float* a = acc + r0 * D;
        const float* al = alpha + r0;
        if (nr == 4) decode_values<D, (RB >= 4 ? 4 : 1)>(hv, c0, cn, pb, kDecodeChunk, al, a, stream, pf_from, pf_to);
        if (nr == 3) decode_values<D, (RB >= 3 ? 3 : 1)>(hv, c0, cn, pb, kDecodeChunk, al, a, stream, pf_from, pf_to);
        if (nr == 2) decode_values<D, (RB >= 2 ? 2 : 1)>(hv, c0, cn, pb, kDecodeChunk, al, a, stream, pf_from, pf_to);
        if (nr == 1) decode_values<D, 1>(hv, c0, cn, pb, kDecodeChunk, al, a, stream, pf_from, pf_to);
      }
    }
  }
  // Undo decode_values' interleaved order while writing each row, rounded to bf16 as c10::BFloat16 rounds.
  for (int64_t h = R0; h < R1; ++h) {
    const float inv = 1.0f / s.row_sum[h];
    const float* a = acc + h * D;
    c10::BFloat16* dst = r.out + h * o_head_stride;
    for (int64_t c = 0; c < D / 32; ++c) {
      const float* lo = a + 32 * c;
      const float* hi = lo + 16;
      for (int64_t l = 0; l < 4; ++l) {
        for (int64_t k = 0; k < 4; ++k) {
          dst[32 * c + 8 * l + k] = c10::BFloat16(lo[4 * l + k] * inv);
          dst[32 * c + 8 * l + 4 + k] = c10::BFloat16(hi[4 * l + k] * inv);
        }
      }
    }
  }
}

// The decode path for head size D, or false where it has none (the caller runs the key loops instead).
inline bool decode_bf16_head_size(int64_t d) { return d == 32 || d == 64 || d == 128 || d == 256; }

inline void decode_bf16_dispatch(int64_t d, const DecodeReq& r, int64_t req_index, int64_t hb, int64_t he,
                                 int64_t q_head_stride, int64_t o_head_stride, float scale, Scratch& s,
                                 DecodeStream& stream) {
  switch (d) {
    case 32: return decode_bf16_request<32>(r, req_index, hb, he, q_head_stride, o_head_stride, scale, s, stream);
    case 64: return decode_bf16_request<64>(r, req_index, hb, he, q_head_stride, o_head_stride, scale, s, stream);
    case 128: return decode_bf16_request<128>(r, req_index, hb, he, q_head_stride, o_head_stride, scale, s, stream);
    default: return decode_bf16_request<256>(r, req_index, hb, he, q_head_stride, o_head_stride, scale, s, stream);
  }
}

}  // namespace attn
}  // namespace vllm_lite
#endif
