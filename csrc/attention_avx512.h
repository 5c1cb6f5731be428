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

}  // namespace attn
}  // namespace vllm_lite
#endif  // __AVX512F__
