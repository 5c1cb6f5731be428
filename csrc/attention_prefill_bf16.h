// Prefill path of the CPU paged-attention kernel for a bfloat16 KV cache: work items of several query tokens
// (prompt chunks) on AVX512-BF16, built where attention_decode_bf16.h's decode path is (VLLM_LITE_ATTN_DECODE_BF16).
//
// Why: the AVX-512 key loop (attention_avx512.h) converts every key and value to float32 and, per 16 keys and per
// row, runs a horizontal max, a scalar exp, a horizontal sum and a reload/store of the row's accumulator: ~90
// GFLOP/s for bench-model prefill on 2 Zen 4 cores, against ~450 for bf16 matmuls. Here an item (a request's query
// tokens x the GQA group of one KV head, up to kRowsPerItem rows) takes its keys in chunks of kDecodeChunk keys:
//   1. the chunk's keys are transposed once as bf16 pairs (32-bit lanes: [tile][D/2][16 keys]) and its values
//      interleaved once by key pairs, both shared by every row of the item;
//   2. scores: register blocks of 4 rows x 4 tiles (64 keys), D/2 VDPBF16PS each against broadcast bf16 query pairs;
//   3. softmax per row over its visible keys of the chunk (causal mask), probabilities rounded to bf16;
//   4. values: two keys per VDPBF16PS, register blocks of rows whose accumulators stay in registers over the chunk
//      (a chunk with a non-finite value: row by row over each row's own keys, so no later key reaches a row).
// Numerics: each row does exactly the arithmetic the decode path does for a single query token at the same position
// (same chunks from key 0, same score, max, exp, sum and value order; keys a row may not see weigh 0), so a prompt
// token's output is the bits decode_bf16_request gives it, whatever the batch, the item split or the thread count;
// probabilities are rounded to bf16 before P@V as in the decode path and Hugging Face's eager attention.
// Taken only without a sliding window (a row's window would move its chunk boundaries); windows run the key loops.
#pragma once

#include "attention_decode_bf16.h"

#ifdef VLLM_LITE_ATTN_DECODE_BF16
#define VLLM_LITE_ATTN_PREFILL_BF16 1

namespace vllm_lite {
namespace attn {

// Scores of NR rows (bf16 query pairs qdw, row i at qdw + i * D/2) against NT consecutive transposed key tiles of kt
// (tile t at kt + t * D/2 * 16), times scale, into dst + i * dst_stride + 16 t. Per lane the arithmetic of
// decode_scores: VDPBF16PS over d2 = 0..D/2-1 from zero, then one multiply by scale.
template <int64_t D, int NR, int NT>
inline void prefill_scores(const uint32_t* qdw, const float* kt, float scale, float* dst, int64_t dst_stride) {
  constexpr int64_t P = D / 2;
  __m512 a[NR][NT];
  for (int i = 0; i < NR; ++i) {
    for (int t = 0; t < NT; ++t) a[i][t] = _mm512_setzero_ps();
  }
  for (int64_t d2 = 0; d2 < P; ++d2) {
    __m512i kd[NT];
    for (int t = 0; t < NT; ++t) kd[t] = _mm512_castps_si512(_mm512_loadu_ps(kt + (t * P + d2) * 16));
    for (int i = 0; i < NR; ++i) {
      const __m512i qq = _mm512_set1_epi32(static_cast<int>(qdw[i * P + d2]));
      for (int t = 0; t < NT; ++t) a[i][t] = _mm512_dpbf16_ps(a[i][t], as_bh512(kd[t]), as_bh512(qq));
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int i = 0; i < NR; ++i) {
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(dst + i * dst_stride + 16 * t, _mm512_mul_ps(a[i][t], sv));
  }
}

// Scores of NR rows over tiles 0..ntiles-1, NT = 4 tiles at a time.
template <int64_t D, int NR>
inline void prefill_scores_rows(const uint32_t* qdw, const float* kt, int64_t ntiles, float scale, float* dst,
                                int64_t dst_stride) {
  constexpr int64_t P = D / 2;
  int64_t t = 0;
  for (; t + 4 <= ntiles; t += 4) prefill_scores<D, NR, 4>(qdw, kt + t * P * 16, scale, dst + 16 * t, dst_stride);
  switch (ntiles - t) {
    case 3: prefill_scores<D, NR, 3>(qdw, kt + t * P * 16, scale, dst + 16 * t, dst_stride); break;
    case 2: prefill_scores<D, NR, 2>(qdw, kt + t * P * 16, scale, dst + 16 * t, dst_stride); break;
    case 1: prefill_scores<D, NR, 1>(qdw, kt + t * P * 16, scale, dst + 16 * t, dst_stride); break;
    default: break;
  }
}

// acc[NR][D] = acc * alpha + sum over key pairs m < npairs of p[i][2m..2m+1] . v[2m..2m+1], as decode_values does:
// vp holds pair m's values interleaved (2 * D/32 registers: unpacklo, unpackhi of each 32-value slice), pb row i's
// bf16 probability pairs at pb + i * pb_stride; the accumulators keep decode_values' interleaved order.
template <int64_t D, int NR>
inline void prefill_values(const __m512i* vp, int64_t npairs, const uint32_t* pb, int64_t pb_stride,
                           const float* alpha, float* acc) {
  constexpr int NV = static_cast<int>(D / 32);
  __m512 a[NR][2 * NV];
  for (int i = 0; i < NR; ++i) {
    const __m512 al = _mm512_set1_ps(alpha[i]);
    for (int c = 0; c < 2 * NV; ++c) a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + 16 * c), al);
  }
  for (int64_t m = 0; m < npairs; ++m) {
    const __m512i* v = vp + m * 2 * NV;
    for (int i = 0; i < NR; ++i) {
      const __m512i pp = _mm512_set1_epi32(static_cast<int>(pb[i * pb_stride + m]));
      for (int c = 0; c < NV; ++c) {
        a[i][2 * c] = _mm512_dpbf16_ps(a[i][2 * c], as_bh512(_mm512_loadu_si512(v + 2 * c)), as_bh512(pp));
        a[i][2 * c + 1] = _mm512_dpbf16_ps(a[i][2 * c + 1], as_bh512(_mm512_loadu_si512(v + 2 * c + 1)), as_bh512(pp));
      }
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int c = 0; c < 2 * NV; ++c) _mm512_storeu_ps(acc + i * D + 16 * c, a[i][c]);
  }
}

// Values of one row over its v >= 1 visible keys of a chunk, for a chunk holding a non-finite value: as
// prefill_values<D, 1> over the pairs the row sees, except that when v is odd the last pair's partner (key v, which
// the row may not see) reads as 0, as in decode_values where key v is past the chunk. The register blocks of
// prefill_values read every row up to its block's last row's pairs with probability 0, and 0 * inf is NaN.
template <int64_t D>
inline void prefill_values_row(const __m512i* vp, int64_t v, const uint32_t* pb, float alpha, float* acc) {
  constexpr int NV = static_cast<int>(D / 32);
  __m512 a[2 * NV];
  const __m512 al = _mm512_set1_ps(alpha);
  for (int c = 0; c < 2 * NV; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), al);
  const int64_t npairs = (v + 1) / 2;
  const __m512i even = _mm512_set1_epi32(0xFFFF);  // a pair's first key (low half of each 32-bit lane)
  for (int64_t m = 0; m < npairs; ++m) {
    const __m512i* vm = vp + m * 2 * NV;
    const __m512i keep = 2 * m + 1 < v ? _mm512_set1_epi32(-1) : even;
    const __m512i pp = _mm512_set1_epi32(static_cast<int>(pb[m]));
    for (int c = 0; c < 2 * NV; ++c) {
      a[c] = _mm512_dpbf16_ps(a[c], as_bh512(_mm512_and_si512(_mm512_loadu_si512(vm + c), keep)), as_bh512(pp));
    }
  }
  for (int c = 0; c < 2 * NV; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
}

// One prefill item of one KV head: it.kv_off = the KV head's offset in a token row, it.rows = tokens * group
// (row r: token r / group, head r % group), it.ctx = the position of its first token, it.num_keys = one past the
// last token's position, no window (key_begin 0). q / out point at the item's first token and the KV head's first
// query head. Scratch: s.q (rows' bf16 pairs), s.sc ([rows][kDecodeChunk]), s.acc, s.kc and s.vp (one chunk's
// transposed keys and paired values).
template <int64_t D>
void prefill_bf16_item(const ItemView<c10::BFloat16>& it, const c10::BFloat16* q, int64_t q_tok_stride,
                       int64_t q_head_stride, c10::BFloat16* out, int64_t o_tok_stride, int64_t o_head_stride,
                       float scale, Scratch& s) {
  static_assert(D % 32 == 0 && D <= 256, "head size: a multiple of 32 up to 256");
  constexpr int64_t P = D / 2;
  constexpr int NV = static_cast<int>(D / 32);
  const int64_t R = it.rows, G = it.group;
  uint32_t* qdw = reinterpret_cast<uint32_t*>(s.q.data());
  for (int64_t tok = 0, r = 0; r < R; ++tok) {
    for (int64_t h = 0; h < G; ++h, ++r) {
      std::memcpy(qdw + r * P, q + tok * q_tok_stride + h * q_head_stride, D * sizeof(c10::BFloat16));
    }
  }
  float* kt = s.kc.data();                                // [tile][P][16]
  __m512i* vp = reinterpret_cast<__m512i*>(s.vp.data());  // [pair][2 * NV]
  float* sc = s.sc.data();                                // [rows][kDecodeChunk]
  float* acc = s.acc.data();
  float* alpha = s.alpha.data();
  std::fill_n(acc, R * D, 0.0f);
  for (int64_t r = 0; r < R; ++r) {
    s.row_max[r] = -std::numeric_limits<float>::infinity();
    s.row_sum[r] = 0.0f;
  }
  // Keys of chunk c0 that row r sees (<= 0: none).
  const auto vis = [&](int64_t r, int64_t c0, int64_t cn) { return std::min(cn, it.ctx + r / G + 1 - c0); };
  constexpr int64_t RB = D <= 64 ? 4 : D <= 128 ? 2 : 1;  // rows per register block of the values pass
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i abs_bits = _mm512_set1_epi16(0x7fff);
  const __m512i nonfinite_bits = _mm512_set1_epi16(0x7f80);
  for (int64_t c0 = 0; c0 < it.num_keys; c0 += kDecodeChunk) {
    const int64_t cn = std::min<int64_t>(kDecodeChunk, it.num_keys - c0);
    const int64_t ntiles = (cn + 15) / 16;
    // 1. The chunk's keys transposed as bf16 pairs and its values interleaved by key pairs (zeros past cn); vmag
    // keeps each 16-bit lane's largest |value| bits, so the chunk holds a non-finite value (exponent all ones) when
    // one reaches 0x7f80.
    __m512i vmag = _mm512_setzero_si512();
    for (int64_t t = 0; t < ntiles; ++t) {
      const int64_t kn = std::min<int64_t>(16, cn - 16 * t);
      int64_t offs[16];
      it.tile_offsets(c0 + 16 * t, kn, offs);
      for (int64_t p0 = 0; p0 < P; p0 += 16) {
        __m512 blk[16];
        for (int64_t j = 0; j < 16; ++j) {
          blk[j] = j < kn ? _mm512_loadu_ps(reinterpret_cast<const float*>(it.k_cache + offs[j]) + p0)
                          : _mm512_setzero_ps();
        }
        transpose16(blk);
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (t * P + p0 + i) * 16, blk[i]);
      }
      for (int64_t j = 0; j < kn; j += 2) {
        const c10::BFloat16* va = it.v_cache + offs[j];
        const c10::BFloat16* vb = j + 1 < kn ? it.v_cache + offs[j + 1] : nullptr;
        __m512i* dst = vp + (8 * t + j / 2) * 2 * NV;
        for (int c = 0; c < NV; ++c) {
          const __m512i x = _mm512_loadu_si512(va + 32 * c);
          const __m512i y = vb != nullptr ? _mm512_loadu_si512(vb + 32 * c) : _mm512_setzero_si512();
          vmag = _mm512_max_epu16(vmag, _mm512_and_si512(x, abs_bits));
          vmag = _mm512_max_epu16(vmag, _mm512_and_si512(y, abs_bits));
          _mm512_storeu_si512(dst + 2 * c, _mm512_unpacklo_epi16(x, y));
          _mm512_storeu_si512(dst + 2 * c + 1, _mm512_unpackhi_epi16(x, y));
        }
      }
    }
    // Rows before first_row see nothing of this chunk (their tokens come before c0).
    const int64_t first_row = std::max<int64_t>(0, (c0 - it.ctx) * G);
    // 2. Scores of every row that sees the chunk, over the tiles its register block needs.
    for (int64_t r0 = first_row; r0 < R; r0 += 4) {
      const int64_t nr = std::min<int64_t>(4, R - r0);
      const int64_t nt = (vis(r0 + nr - 1, c0, cn) + 15) / 16;
      float* dst = sc + r0 * kDecodeChunk;
      switch (nr) {
        case 1: prefill_scores_rows<D, 1>(qdw + r0 * P, kt, nt, scale, dst, kDecodeChunk); break;
        case 2: prefill_scores_rows<D, 2>(qdw + r0 * P, kt, nt, scale, dst, kDecodeChunk); break;
        case 3: prefill_scores_rows<D, 3>(qdw + r0 * P, kt, nt, scale, dst, kDecodeChunk); break;
        default: prefill_scores_rows<D, 4>(qdw + r0 * P, kt, nt, scale, dst, kDecodeChunk); break;
      }
    }
    // 3. Softmax of each row over its visible keys, as decode_bf16_request's over a chunk of that many keys; bf16
    // probabilities overwrite the row's first half, zeros up to the chunk's last tile (keys the row may not see).
    for (int64_t r = first_row; r < R; ++r) {
      const int64_t v = vis(r, c0, cn);
      float* srow = sc + r * kDecodeChunk;
      c10::BFloat16* prow = reinterpret_cast<c10::BFloat16*>(srow);
      __m512 mx = neg_inf;
      for (int64_t t = 0; t < v; t += 16) {
        const __mmask16 m = v - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (v - t)) - 1u);
        mx = _mm512_mask_max_ps(mx, m, mx, _mm512_loadu_ps(srow + t));
      }
      const float new_max = std::max(s.row_max[r], _mm512_reduce_max_ps(mx));
      alpha[r] = std::exp(s.row_max[r] - new_max);  // 0 on the first chunk
      const __m512 nm = _mm512_set1_ps(new_max);
      __m512 sum = _mm512_setzero_ps();
      int64_t t = 0;
      for (; t < v; t += 16) {
        const __mmask16 m = v - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (v - t)) - 1u);
        const __m512 p = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(srow + t), nm)));
        const __m256bh hb = _mm512_cvtneps_pbh(p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + t), reinterpret_cast<const __m256i&>(hb));
        sum = _mm512_add_ps(sum, p);
      }
      for (; t < 16 * ntiles; t += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + t), _mm256_setzero_si256());
      s.row_max[r] = new_max;
      s.row_sum[r] = s.row_sum[r] * alpha[r] + _mm512_reduce_add_ps(sum);
    }
    // 4. Values: register blocks of RB rows over the key pairs the block's last row sees (a row's keys past its
    // own visible ones weigh 0, and 0 * a finite value adds a zero that leaves the sum's bits as they are). A chunk
    // with a non-finite value instead runs each row over its own visible keys only (0 * inf would be NaN).
    if (_mm512_cmpge_epu16_mask(vmag, nonfinite_bits) != 0) {
      for (int64_t r = first_row; r < R; ++r) {
        prefill_values_row<D>(vp, vis(r, c0, cn), reinterpret_cast<const uint32_t*>(sc + r * kDecodeChunk), alpha[r],
                              acc + r * D);
      }
      continue;
    }
    for (int64_t r0 = first_row; r0 < R; r0 += RB) {
      const int64_t nr = std::min<int64_t>(RB, R - r0);
      const int64_t npairs = (vis(r0 + nr - 1, c0, cn) + 1) / 2;
      const uint32_t* pb = reinterpret_cast<const uint32_t*>(sc + r0 * kDecodeChunk);
      float* a = acc + r0 * D;
      const float* al = alpha + r0;
      if (nr == 4) prefill_values<D, (RB >= 4 ? 4 : 1)>(vp, npairs, pb, kDecodeChunk, al, a);
      if (nr == 3) prefill_values<D, (RB >= 3 ? 3 : 1)>(vp, npairs, pb, kDecodeChunk, al, a);
      if (nr == 2) prefill_values<D, (RB >= 2 ? 2 : 1)>(vp, npairs, pb, kDecodeChunk, al, a);
      if (nr == 1) prefill_values<D, 1>(vp, npairs, pb, kDecodeChunk, al, a);
    }
  }
  // Undo the values' interleaved order while writing each row, rounded to bf16 (as decode_bf16_request).
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.0f / s.row_sum[r];
    const float* a = acc + r * D;
    c10::BFloat16* dst = out + (r / G) * o_tok_stride + (r % G) * o_head_stride;
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

inline void prefill_bf16_dispatch(int64_t d, const ItemView<c10::BFloat16>& it, const c10::BFloat16* q,
                                  int64_t q_tok_stride, int64_t q_head_stride, c10::BFloat16* out,
                                  int64_t o_tok_stride, int64_t o_head_stride, float scale, Scratch& s) {
  switch (d) {
    case 32: return prefill_bf16_item<32>(it, q, q_tok_stride, q_head_stride, out, o_tok_stride, o_head_stride, scale, s);
    case 64: return prefill_bf16_item<64>(it, q, q_tok_stride, q_head_stride, out, o_tok_stride, o_head_stride, scale, s);
    case 128:
      return prefill_bf16_item<128>(it, q, q_tok_stride, q_head_stride, out, o_tok_stride, o_head_stride, scale, s);
    default:
      return prefill_bf16_item<256>(it, q, q_tok_stride, q_head_stride, out, o_tok_stride, o_head_stride, scale, s);
  }
}

}  // namespace attn
}  // namespace vllm_lite
#endif
