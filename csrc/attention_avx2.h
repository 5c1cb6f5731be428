// AVX2 + FMA key loop of the CPU paged-attention kernel: 8-wide float32, for hosts without AVX-512
// (Zen 3 and older Intel), where it replaces the compiler-vectorised portable loop.
//
// Same structure as the AVX-512 loop: a tile of 16 keys is gathered through the block table and
// transposed (8x8 blocks) so the scores of four query rows against 16 keys are eight independent
// FMA chains (enough to keep both FMA ports busy through their latency). Online softmax per row;
// the value accumulation walks the row's head dimension in blocks of at most 8 registers so head
// size 128 and 256 do not spill. Soft-capping (Gemma 2) applies tanh to the row's visible scores.
// Compiled only where the build targets AVX2 and FMA (-march=native on such a host; AVX-512 hosts
// have both, so the path is built and tested there too).
#pragma once

#include "attention_common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <type_traits>

namespace vllm_lite {
namespace attn {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8-lane fast_exp (cpu_common.h): the same range reduction, rounding and polynomial.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// In-place transpose of an 8x8 float tile held in 8 registers.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int h = 0; h < 8; h += 4) {
    u[h + 0] = _mm256_shuffle_ps(t[h + 0], t[h + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[h + 1] = _mm256_shuffle_ps(t[h + 0], t[h + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

constexpr int64_t kTileAvx2 = 16;  // keys per step: two registers of scores per row
constexpr int kRowBlockAvx2 = 4;   // query rows scored together (8 accumulators)
constexpr int kAccBlock = 8;       // accumulator registers per pass over a row's head dimension

// Lanes [lo, valid) of a 16-key tile as two all-ones/all-zeros masks.
inline void lane_masks(int64_t lo, int64_t valid, __m256* m_lo, __m256* m_hi) {
  const __m256i iota_lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i iota_hi = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
  const __m256i v = _mm256_set1_epi32(static_cast<int32_t>(valid));
  const __m256i l = _mm256_set1_epi32(static_cast<int32_t>(lo) - 1);
  // lane < valid and lane > lo - 1
  *m_lo = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(v, iota_lo), _mm256_cmpgt_epi32(iota_lo, l)));
  *m_hi = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(v, iota_hi), _mm256_cmpgt_epi32(iota_hi, l)));
}

// AVX2 path for head_size = 8 * NC.
template <typename T, int NC>
void key_loop_avx2(const ItemView<T>& it, Scratch& s) {
  constexpr int64_t D = 8 * NC;
  float* vbuf = s.v.data();  // [16][D] value rows converted to float32 (bfloat16 caches)
  float* kt = s.k_t.data();  // [D][16] transposed keys
  alignas(32) float probs[kTileAvx2];
  alignas(32) float capped[kTileAvx2];
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t k0 = it.key_begin; k0 < it.num_keys; k0 += kTileAvx2) {
    const int64_t kn = std::min(kTileAvx2, it.num_keys - k0);
    int64_t offs[kTileAvx2];
    it.tile_offsets(k0, kn, offs);
    // Decode is bound by cache misses on the scattered KV rows: start fetching the next tile now.
    if (k0 + kTileAvx2 < it.num_keys) {
      int64_t next[kTileAvx2];
      const int64_t nn = std::min(kTileAvx2, it.num_keys - k0 - kTileAvx2);
      it.tile_offsets(k0 + kTileAvx2, nn, next);
      for (int64_t j = 0; j < nn; ++j) {
        for (int64_t byte = 0; byte < D * static_cast<int64_t>(sizeof(T)); byte += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(it.k_cache + next[j]) + byte, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(it.v_cache + next[j]) + byte, _MM_HINT_T0);
        }
      }
    }
    const float* vrow[kTileAvx2];  // value rows as float32: the cache itself, or converted copies
    for (int64_t j = 0; j < kn; ++j) {
      const T* vsrc = it.v_cache + offs[j];
      if constexpr (std::is_same_v<T, float>) {
        vrow[j] = vsrc;
      } else {
        float* vdst = vbuf + j * D;
        for (int c = 0; c < NC; ++c) _mm256_storeu_ps(vdst + 8 * c, load8(vsrc + 8 * c));
        vrow[j] = vdst;
      }
    }
    for (int64_t h = 0; h < 2; ++h) {
      for (int c = 0; c < NC; ++c) {
        __m256 blk[8];
        for (int64_t j = 0; j < 8; ++j) {
          const int64_t key = 8 * h + j;
          blk[j] = key < kn ? load8(it.k_cache + offs[key] + 8 * c) : _mm256_setzero_ps();
        }
        transpose8(blk);
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (8 * c + i) * kTileAvx2 + 8 * h, blk[i]);
      }
    }
    for (int64_t r0 = 0; r0 < it.rows; r0 += kRowBlockAvx2) {
      // s.q has rows padded to a multiple of 4, so all four rows are safe to read.
      __m256 lo_sc[kRowBlockAvx2], hi_sc[kRowBlockAvx2];
      for (int i = 0; i < kRowBlockAvx2; ++i) lo_sc[i] = hi_sc[i] = _mm256_setzero_ps();
      const float* q0 = s.q.data() + r0 * D;
      for (int64_t d = 0; d < D; ++d) {
        const __m256 k_lo = _mm256_loadu_ps(kt + d * kTileAvx2);
        const __m256 k_hi = _mm256_loadu_ps(kt + d * kTileAvx2 + 8);
        for (int i = 0; i < kRowBlockAvx2; ++i) {
          const __m256 qv = _mm256_broadcast_ss(q0 + i * D + d);
          lo_sc[i] = _mm256_fmadd_ps(qv, k_lo, lo_sc[i]);
          hi_sc[i] = _mm256_fmadd_ps(qv, k_hi, hi_sc[i]);
        }
      }
      const int64_t nr = std::min<int64_t>(kRowBlockAvx2, it.rows - r0);
      for (int64_t i = 0; i < nr; ++i) {
        const int64_t r = r0 + i;
        const int64_t valid = it.visible(r, k0, kn);
        const int64_t lo = it.first_visible(r, k0, kn);
        if (valid <= lo) continue;
        __m256 s_lo = lo_sc[i], s_hi = hi_sc[i];
        if (it.soft_cap > 0.0f) {
          _mm256_store_ps(capped, s_lo);
          _mm256_store_ps(capped + 8, s_hi);
          for (int64_t j = lo; j < valid; ++j) capped[j] = it.soft_cap * std::tanh(capped[j] / it.soft_cap);
          s_lo = _mm256_load_ps(capped);
          s_hi = _mm256_load_ps(capped + 8);
        }
        __m256 m_lo, m_hi;
        lane_masks(lo, valid, &m_lo, &m_hi);
        s_lo = _mm256_blendv_ps(neg_inf, s_lo, m_lo);
        s_hi = _mm256_blendv_ps(neg_inf, s_hi, m_hi);
        const float new_max = std::max(s.row_max[r], hmax8(_mm256_max_ps(s_lo, s_hi)));
        const float alpha = std::exp(s.row_max[r] - new_max);  // 0 on the first tile
        const __m256 nm = _mm256_set1_ps(new_max);
        const __m256 p_lo = _mm256_and_ps(m_lo, exp8(_mm256_sub_ps(s_lo, nm)));
        const __m256 p_hi = _mm256_and_ps(m_hi, exp8(_mm256_sub_ps(s_hi, nm)));
        s.row_max[r] = new_max;
        s.row_sum[r] = s.row_sum[r] * alpha + hsum8(_mm256_add_ps(p_lo, p_hi));
        _mm256_store_ps(probs, p_lo);
        _mm256_store_ps(probs + 8, p_hi);
        float* acc = s.acc.data() + r * D;
        const __m256 av = _mm256_set1_ps(alpha);
        for (int cb = 0; cb < NC; cb += kAccBlock) {
          constexpr int kMax = NC < kAccBlock ? NC : kAccBlock;
          const int nb = std::min(kAccBlock, NC - cb);
          __m256 a[kMax];
          for (int c = 0; c < kMax; ++c) {
            if (c < nb) a[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * (cb + c)), av);
          }
          for (int64_t j = lo; j < valid; ++j) {
            const __m256 pj = _mm256_broadcast_ss(probs + j);
            const float* vj = vrow[j] + 8 * cb;
            for (int c = 0; c < kMax; ++c) {
              if (c < nb) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * c), a[c]);
            }
          }
          for (int c = 0; c < kMax; ++c) {
            if (c < nb) _mm256_storeu_ps(acc + 8 * (cb + c), a[c]);
          }
        }
      }
    }
  }
}

}  // namespace attn
}  // namespace vllm_lite
#endif  // __AVX2__ && __FMA__
