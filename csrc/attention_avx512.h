// AVX-512 key loop of the CPU paged-attention kernel (head sizes 32/64/128/256, no soft-capping).
// Compiled only where the build targets AVX-512 (-march=native on such a host).
#pragma once

#include "attention_common.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <type_traits>

namespace vllm_lite {
namespace attn {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16-lane version of fast_exp; 2^n is applied with scalef.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// In-place transpose of a 16x16 float tile held in 16 registers (three shuffle stages).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int h = 0; h < 16; h += 8) {
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

constexpr int64_t kTile16 = 16;  // keys per step on the AVX-512 path: one register of scores
constexpr int kRowBlock = 4;     // query rows whose scores are computed together

// AVX-512 path for head_size = 16 * NC: registers hold scores and the accumulator of a row.
template <typename T, int NC>
void key_loop_avx512(const ItemView<T>& it, Scratch& s) {
  constexpr int64_t D = 16 * NC;
  float* vbuf = s.v.data();                 // [16][D] value rows converted to float32
  float* kt = s.k_t.data();                 // [D][16] transposed keys
  alignas(64) float probs[kTile16];
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t k0 = it.key_begin; k0 < it.num_keys; k0 += kTile16) {
    const int64_t kn = std::min(kTile16, it.num_keys - k0);
    int64_t offs[kTile16];
    it.tile_offsets(k0, kn, offs);
    // Decode is bound by cache misses on the scattered KV rows: start fetching the next tile now.
    if (k0 + kTile16 < it.num_keys) {
      int64_t next[kTile16];
      const int64_t nn = std::min(kTile16, it.num_keys - k0 - kTile16);
      it.tile_offsets(k0 + kTile16, nn, next);
      for (int64_t j = 0; j < nn; ++j) {
        for (int64_t byte = 0; byte < D * static_cast<int64_t>(sizeof(T)); byte += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(it.k_cache + next[j]) + byte, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(it.v_cache + next[j]) + byte, _MM_HINT_T0);
        }
      }
    }
    const float* vrow[kTile16];  // value rows as float32: the cache itself, or converted copies
    for (int64_t j = 0; j < kn; ++j) {
      const T* vsrc = it.v_cache + offs[j];
      if constexpr (std::is_same_v<T, float>) {
        vrow[j] = vsrc;
      } else {
        float* vdst = vbuf + j * D;
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(vdst + 16 * c, load16(vsrc + 16 * c));
        vrow[j] = vdst;
      }
    }
    for (int c = 0; c < NC; ++c) {
      __m512 blk[16];
      for (int64_t j = 0; j < 16; ++j) blk[j] = j < kn ? load16(it.k_cache + offs[j] + 16 * c) : _mm512_setzero_ps();
      transpose16(blk);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (16 * c + i) * kTile16, blk[i]);
    }
    for (int64_t r0 = 0; r0 < it.rows; r0 += kRowBlock) {
      // s.q has rows padded to a multiple of kRowBlock, so all four rows are safe to read.
      __m512 sc[kRowBlock];
      for (int i = 0; i < kRowBlock; ++i) sc[i] = _mm512_setzero_ps();
      const float* q0 = s.q.data() + r0 * D;
      for (int64_t d = 0; d < D; ++d) {
        const __m512 kd = _mm512_loadu_ps(kt + d * kTile16);
        for (int i = 0; i < kRowBlock; ++i) sc[i] = _mm512_fmadd_ps(_mm512_set1_ps(q0[i * D + d]), kd, sc[i]);
      }
      const int64_t nr = std::min<int64_t>(kRowBlock, it.rows - r0);
      for (int64_t i = 0; i < nr; ++i) {
        const int64_t r = r0 + i;
        const int64_t valid = it.visible(r, k0, kn);
        const int64_t lo = it.first_visible(r, k0, kn);
        if (valid <= lo) continue;
        const __mmask16 m = static_cast<__mmask16>(((1u << valid) - 1u) & ~((1u << lo) - 1u));
        const __m512 sv = _mm512_mask_blend_ps(m, neg_inf, sc[i]);
        const float new_max = std::max(s.row_max[r], _mm512_reduce_max_ps(sv));
        const float alpha = std::exp(s.row_max[r] - new_max);  // 0 on the first tile
        const __m512 p = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(new_max))));
        s.row_max[r] = new_max;
        s.row_sum[r] = s.row_sum[r] * alpha + _mm512_reduce_add_ps(p);
        _mm512_store_ps(probs, p);
        float* acc = s.acc.data() + r * D;
        __m512 a[NC];
        const __m512 av = _mm512_set1_ps(alpha);
        for (int c = 0; c < NC; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), av);
        for (int64_t j = lo; j < valid; ++j) {
          const __m512 pj = _mm512_set1_ps(probs[j]);
          const float* vj = vrow[j];
          for (int c = 0; c < NC; ++c) a[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + 16 * c), a[c]);
        }
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Decode items of a float32 cache (one query token: it.rows == it.group, every row sees keys key_begin..num_keys-1).
// The key loop above pays, per 16 keys and per row, a horizontal max, a scalar exp, a horizontal sum and a reload
// and store of the row's accumulator: with the 2-4 rows of a GQA decode item that is most of its time (0.8 ms a
// layer for 64 sequences of ~200 keys, head 32, 2 Zen 4 cores: ~2x the time its KV reads take). Here, as in
// attention_decode_bf16.h, per chunk of up to kDecodeChunk keys:
//   1. scores: each 16-key tile transposed once (kt = [D][16]) and every row's 16 scores are D FMAs against the
//      broadcast (pre-scaled) query, four rows at a time; the tile's values start towards L2 meanwhile;
//   2. softmax: one max, one exp pass and one sum per row over the chunk (the online rescale only between chunks);
//   3. values: each key's value row loaded once for all rows of a register block, the rows' accumulators in
//      registers over the whole chunk.
// A row's result depends only on its own query and keys (not on the batch, the thread count or the work order).

// Scores of NR rows (q: [NR][D], pre-scaled) against the transposed tile kt, written to dst + i * dst_stride.
template <int64_t D, int NR>
inline void decode_f32_scores(const float* q, const float* kt, float* dst, int64_t dst_stride) {
  __m512 a[NR];
  for (int i = 0; i < NR; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 kd = _mm512_loadu_ps(kt + d * kTile16);
    for (int i = 0; i < NR; ++i) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i * D + d]), kd, a[i]);
  }
  for (int i = 0; i < NR; ++i) _mm512_storeu_ps(dst + i * dst_stride, a[i]);
}

// acc[NR][D] = acc * alpha + sum_j p[i][j] * v_j over the chunk's keys c0..c0+cn-1 (p: row i at p + i * p_stride).
template <int64_t D, int NR>
inline void decode_f32_values(const ItemView<float>& it, int64_t c0, int64_t cn, const float* p, int64_t p_stride,
                              const float* alpha, float* acc) {
  constexpr int NC = static_cast<int>(D / 16);
  __m512 a[NR][NC];
  for (int i = 0; i < NR; ++i) {
    const __m512 al = _mm512_set1_ps(alpha[i]);
    for (int c = 0; c < NC; ++c) a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + 16 * c), al);
  }
  for (int64_t t0 = 0; t0 < cn; t0 += kTile16) {
    const int64_t kn = std::min<int64_t>(kTile16, cn - t0);
    int64_t offs[kTile16];
    it.tile_offsets(c0 + t0, kn, offs);
    for (int64_t j = 0; j < kn; ++j) {
      const float* vj = it.v_cache + offs[j];
      __m512 v[NC];
      for (int c = 0; c < NC; ++c) v[c] = _mm512_loadu_ps(vj + 16 * c);
      for (int i = 0; i < NR; ++i) {
        const __m512 pj = _mm512_set1_ps(p[i * p_stride + t0 + j]);
        for (int c = 0; c < NC; ++c) a[i][c] = _mm512_fmadd_ps(pj, v[c], a[i][c]);
      }
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + i * D + 16 * c, a[i][c]);
  }
}

// One decode item of a float32 cache, head size 16 * NC. Contract as key_loop_avx512: s.q holds the rows'
// pre-scaled queries (padded to a multiple of 4 rows), s.acc / row_max / row_sum start at 0 / -inf / 0 and hold
// the unnormalised result at the end.
template <int NC>
void decode_f32(const ItemView<float>& it, Scratch& s) {
  constexpr int64_t D = 16 * NC;
  constexpr int64_t line = 16;  // floats per cache line
  const int64_t R = it.rows;
  const float* q = s.q.data();
  float* kt = s.k_t.data();  // [D][16]
  float* sc = s.sc.data();   // [R rounded up to 4][kDecodeChunk]
  float* acc = s.acc.data();
  float* alpha = s.alpha.data();
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t c0 = it.key_begin; c0 < it.num_keys; c0 += kDecodeChunk) {
    const int64_t cn = std::min<int64_t>(kDecodeChunk, it.num_keys - c0);
    // 1. Scores.
    for (int64_t t0 = 0; t0 < cn; t0 += kTile16) {
      const int64_t kn = std::min<int64_t>(kTile16, cn - t0);
      int64_t offs[kTile16];
      it.tile_offsets(c0 + t0, kn, offs);
      for (int64_t j = 0; j < kn; ++j) {  // this tile's values are read in pass 3: start them towards L2
        for (int64_t e = 0; e < D; e += line) {
          _mm_prefetch(reinterpret_cast<const char*>(it.v_cache + offs[j] + e), _MM_HINT_T1);
        }
      }
      // The next tile's keys; the first KV head's item also pulls the rest of those token rows (the other KV
      // heads' keys and values) towards L2: the same thread runs the request's other KV heads next.
      if (t0 + kTile16 < cn || c0 + cn < it.num_keys) {
        const int64_t nn = std::min<int64_t>(kTile16, it.num_keys - (c0 + t0 + kTile16));
        int64_t next[kTile16];
        it.tile_offsets(c0 + t0 + kTile16, nn, next);
        for (int64_t j = 0; j < nn; ++j) {
          for (int64_t e = 0; e < D; e += line) {
            _mm_prefetch(reinterpret_cast<const char*>(it.k_cache + next[j] + e), _MM_HINT_T0);
          }
          if (it.kv_off == 0) {
            for (int64_t e = D; e < it.tok_stride; e += line) {
              _mm_prefetch(reinterpret_cast<const char*>(it.k_cache + next[j] + e), _MM_HINT_T1);
              _mm_prefetch(reinterpret_cast<const char*>(it.v_cache + next[j] + e), _MM_HINT_T1);
            }
          }
        }
      }
      for (int c = 0; c < NC; ++c) {
        __m512 blk[16];
        for (int64_t j = 0; j < 16; ++j) blk[j] = j < kn ? _mm512_loadu_ps(it.k_cache + offs[j] + 16 * c) : _mm512_setzero_ps();
        transpose16(blk);
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (16 * c + i) * kTile16, blk[i]);
      }
      for (int64_t r0 = 0; r0 < R; r0 += kRowBlock) {
        float* dst = sc + r0 * kDecodeChunk + t0;
        switch (std::min<int64_t>(kRowBlock, R - r0)) {
          case 1: decode_f32_scores<D, 1>(q + r0 * D, kt, dst, kDecodeChunk); break;
          case 2: decode_f32_scores<D, 2>(q + r0 * D, kt, dst, kDecodeChunk); break;
          case 3: decode_f32_scores<D, 3>(q + r0 * D, kt, dst, kDecodeChunk); break;
          default: decode_f32_scores<D, 4>(q + r0 * D, kt, dst, kDecodeChunk); break;
        }
      }
    }
    // 2. Softmax over the chunk (keys past cn in the last tile are masked out); probabilities overwrite scores.
    for (int64_t r = 0; r < R; ++r) {
      float* srow = sc + r * kDecodeChunk;
      __m512 mx = neg_inf;
      for (int64_t t = 0; t < cn; t += kTile16) {
        const __mmask16 m = cn - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (cn - t)) - 1u);
        mx = _mm512_mask_max_ps(mx, m, mx, _mm512_loadu_ps(srow + t));
      }
      const float new_max = std::max(s.row_max[r], _mm512_reduce_max_ps(mx));
      alpha[r] = std::exp(s.row_max[r] - new_max);  // 0 on the first chunk
      const __m512 nm = _mm512_set1_ps(new_max);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < cn; t += kTile16) {
        const __mmask16 m = cn - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (cn - t)) - 1u);
        const __m512 p = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(srow + t), nm)));
        _mm512_storeu_ps(srow + t, p);
        sum = _mm512_add_ps(sum, p);
      }
      s.row_max[r] = new_max;
      s.row_sum[r] = s.row_sum[r] * alpha[r] + _mm512_reduce_add_ps(sum);
    }
    // 3. Values, rows in register blocks of RB (RB * D / 16 accumulators: 8-16 registers).
    constexpr int64_t RB = D <= 64 ? 4 : D <= 128 ? 2 : 1;
    for (int64_t r0 = 0; r0 < R; r0 += RB) {
      const float* p = sc + r0 * kDecodeChunk;
      const int64_t nr = std::min<int64_t>(RB, R - r0);
      if (nr == 4) decode_f32_values<D, (RB >= 4 ? 4 : 1)>(it, c0, cn, p, kDecodeChunk, alpha + r0, acc + r0 * D);
      if (nr == 3) decode_f32_values<D, (RB >= 3 ? 3 : 1)>(it, c0, cn, p, kDecodeChunk, alpha + r0, acc + r0 * D);
      if (nr == 2) decode_f32_values<D, (RB >= 2 ? 2 : 1)>(it, c0, cn, p, kDecodeChunk, alpha + r0, acc + r0 * D);
      if (nr == 1) decode_f32_values<D, 1>(it, c0, cn, p, kDecodeChunk, alpha + r0, acc + r0 * D);
    }
  }
}

}  // namespace attn
}  // namespace vllm_lite
#endif  // __AVX512F__
