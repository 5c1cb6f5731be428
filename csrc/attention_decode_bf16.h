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
//   3. values: float32 FMAs over the values converted once per key, the rows' accumulators held in registers.
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

// acc[NR] += sum_j p[i][j] * v_j over the chunk's keys, two keys per VDPBF16PS: the probabilities as bf16 pairs
// (pb: row i's pair m at pb[i * pb_stride + m]), each key pair's values interleaved by unpack (so the accumulator
// of value register c holds d = 32c + 8l + k in its "lo" half and 32c + 8l + 4 + k in its "hi" half, lane
// group l, k < 4; decode_bf16 undoes that when it writes the output). Probabilities are rounded to bf16 before
// they weigh the values, as Hugging Face's eager attention rounds its softmax to the query dtype.
template <int64_t D, int NR>
inline void decode_values(const ItemView<c10::BFloat16>& it, int64_t c0, int64_t cn, const uint32_t* pb,
                          int64_t pb_stride, const float* alpha, float* acc) {
  constexpr int NV = static_cast<int>(D / 32);  // bf16 registers per value row
  __m512 a[NR][2 * NV];
  for (int i = 0; i < NR; ++i) {
    const __m512 al = _mm512_set1_ps(alpha[i]);
    for (int c = 0; c < 2 * NV; ++c) a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + 16 * c), al);
  }
  for (int64_t t0 = 0; t0 < cn; t0 += 16) {
    const int64_t kn = std::min<int64_t>(16, cn - t0);
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

// One decode item: it.rows query rows (the heads of one token that share it's KV head), at q / out with
// consecutive rows head_stride apart; keys it.key_begin..it.num_keys-1 all visible. Scratch: s.q holds the
// rows' bf16 pairs (padded to 4 rows), s.sc the chunk's scores [rows][kDecodeChunk], s.acc [rows][D].
template <int64_t D>
void decode_bf16(const ItemView<c10::BFloat16>& it, const c10::BFloat16* q, int64_t q_head_stride,
                 c10::BFloat16* out, int64_t o_head_stride, float scale, Scratch& s) {
  static_assert(D % 32 == 0 && D <= 256, "head size: a multiple of 32 up to 256");
  constexpr int64_t P = D / 2;  // bf16 pairs (32-bit lanes) per row
  const int64_t R = it.rows;
  const int64_t R4 = (R + 3) / 4 * 4;
  uint32_t* qdw = reinterpret_cast<uint32_t*>(s.q.data());
  for (int64_t r = 0; r < R4; ++r) {
    if (r < R) {
      std::memcpy(qdw + r * P, q + r * q_head_stride, D * sizeof(c10::BFloat16));
    } else {
      std::memset(qdw + r * P, 0, P * sizeof(uint32_t));
    }
  }
  float* kt = s.k_t.data();  // [P][16]
  float* sc = s.sc.data();   // [R4][kDecodeChunk]
  float* acc = s.acc.data();
  float* alpha = s.alpha.data();
  std::fill_n(acc, R * D, 0.0f);
  for (int64_t r = 0; r < R; ++r) {
    s.row_max[r] = -std::numeric_limits<float>::infinity();
    s.row_sum[r] = 0.0f;
  }
  constexpr int64_t line = 64 / static_cast<int64_t>(sizeof(c10::BFloat16));  // elements per cache line
  for (int64_t c0 = it.key_begin; c0 < it.num_keys; c0 += kDecodeChunk) {
    const int64_t cn = std::min<int64_t>(kDecodeChunk, it.num_keys - c0);
    // 1. Scores.
    for (int64_t t0 = 0; t0 < cn; t0 += 16) {
      const int64_t kn = std::min<int64_t>(16, cn - t0);
      int64_t offs[16];
      it.tile_offsets(c0 + t0, kn, offs);
      for (int64_t j = 0; j < kn; ++j) {  // this tile's values are read in pass 3: start them towards L2
        for (int64_t e = 0; e < D; e += line) {
          _mm_prefetch(reinterpret_cast<const char*>(it.v_cache + offs[j] + e), _MM_HINT_T1);
        }
      }
      // The next tile's keys. The first KV head's item also pulls the next tile's whole token rows (every KV
      // head's keys and values) towards L2: the same thread runs the request's other KV heads next
      // (attention.cpp hands them out together), so they stream from L2 instead of scattered DRAM lines.
      if (t0 + 16 < cn || c0 + cn < it.num_keys) {
        const int64_t nn = std::min<int64_t>(16, it.num_keys - (c0 + t0 + 16));
        int64_t next[16];
        it.tile_offsets(c0 + t0 + 16, nn, next);
        for (int64_t j = 0; j < nn; ++j) {
          for (int64_t e = 0; e < D; e += line) {
            _mm_prefetch(reinterpret_cast<const char*>(it.k_cache + next[j] + e), _MM_HINT_T0);
          }
          if (it.kv_off == 0) {
            for (int64_t e = D; e < it.tok_stride; e += line) {
              _mm_prefetch(reinterpret_cast<const char*>(it.k_cache + next[j] + e), _MM_HINT_T1);
            }
            for (int64_t e = D; e < it.tok_stride; e += line) {
              _mm_prefetch(reinterpret_cast<const char*>(it.v_cache + next[j] + e), _MM_HINT_T1);
            }
          }
        }
      }
      for (int64_t p0 = 0; p0 < P; p0 += 16) {
        __m512 blk[16];
        for (int64_t j = 0; j < 16; ++j) {
          blk[j] = j < kn ? _mm512_loadu_ps(reinterpret_cast<const float*>(it.k_cache + offs[j]) + p0)
                          : _mm512_setzero_ps();
        }
        transpose16(blk);
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (p0 + i) * 16, blk[i]);
      }
      for (int64_t r0 = 0; r0 < R; r0 += 4) {
        float* dst = sc + r0 * kDecodeChunk + t0;
        switch (std::min<int64_t>(4, R - r0)) {
          case 1: decode_scores<D, 1>(qdw + r0 * P, kt, scale, dst, kDecodeChunk); break;
          case 2: decode_scores<D, 2>(qdw + r0 * P, kt, scale, dst, kDecodeChunk); break;
          case 3: decode_scores<D, 3>(qdw + r0 * P, kt, scale, dst, kDecodeChunk); break;
          default: decode_scores<D, 4>(qdw + r0 * P, kt, scale, dst, kDecodeChunk); break;
        }
      }
    }
    // 2. Softmax over the chunk (keys past cn in the last tile are masked out).
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t r = 0; r < R; ++r) {
      float* srow = sc + r * kDecodeChunk;
      __m512 mx = neg_inf;
      for (int64_t t = 0; t < cn; t += 16) {
        const __mmask16 m = cn - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (cn - t)) - 1u);
        mx = _mm512_mask_max_ps(mx, m, mx, _mm512_loadu_ps(srow + t));
      }
      const float new_max = std::max(s.row_max[r], _mm512_reduce_max_ps(mx));
      alpha[r] = std::exp(s.row_max[r] - new_max);  // 0 on the first chunk
      const __m512 nm = _mm512_set1_ps(new_max);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < cn; t += 16) {
        const __mmask16 m = cn - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (cn - t)) - 1u);
        const __m512 p = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(srow + t), nm)));
        // bf16 probabilities overwrite the row's first half (bytes 2t.. while the floats read are at 4t..).
        const __m256bh h = _mm512_cvtneps_pbh(p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<c10::BFloat16*>(srow) + t),
                            reinterpret_cast<const __m256i&>(h));
        sum = _mm512_add_ps(sum, p);
      }
      s.row_max[r] = new_max;
      s.row_sum[r] = s.row_sum[r] * alpha[r] + _mm512_reduce_add_ps(sum);
    }
    // 3. Values, rows in register blocks (the accumulators of a block stay in registers over the chunk).
    constexpr int64_t RB = D <= 64 ? 4 : D <= 128 ? 2 : 1;
    for (int64_t r0 = 0; r0 < R; r0 += RB) {
      const uint32_t* pb = reinterpret_cast<const uint32_t*>(sc + r0 * kDecodeChunk);
      const int64_t nr = std::min<int64_t>(RB, R - r0);
      if (nr == 4) decode_values<D, (RB >= 4 ? 4 : 1)>(it, c0, cn, pb, kDecodeChunk, alpha + r0, acc + r0 * D);
      if (nr == 3) decode_values<D, (RB >= 3 ? 3 : 1)>(it, c0, cn, pb, kDecodeChunk, alpha + r0, acc + r0 * D);
      if (nr == 2) decode_values<D, (RB >= 2 ? 2 : 1)>(it, c0, cn, pb, kDecodeChunk, alpha + r0, acc + r0 * D);
      if (nr == 1) decode_values<D, 1>(it, c0, cn, pb, kDecodeChunk, alpha + r0, acc + r0 * D);
    }
  }
  // Undo decode_values' interleaved order while writing each row, rounded to bf16 as c10::BFloat16 rounds.
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.0f / s.row_sum[r];
    const float* a = acc + r * D;
    c10::BFloat16* dst = out + r * o_head_stride;
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

inline void decode_bf16_dispatch(int64_t d, const ItemView<c10::BFloat16>& it, const c10::BFloat16* q,
                                 int64_t q_head_stride, c10::BFloat16* out, int64_t o_head_stride, float scale,
                                 Scratch& s) {
  switch (d) {
    case 32: return decode_bf16<32>(it, q, q_head_stride, out, o_head_stride, scale, s);
    case 64: return decode_bf16<64>(it, q, q_head_stride, out, o_head_stride, scale, s);
    case 128: return decode_bf16<128>(it, q, q_head_stride, out, o_head_stride, scale, s);
    default: return decode_bf16<256>(it, q, q_head_stride, out, o_head_stride, scale, s);
  }
}

}  // namespace attn
}  // namespace vllm_lite
#endif
