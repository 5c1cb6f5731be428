// The float vector of the CPU elementwise kernels and SiLU-and-mul's element rule, shared by fused_cpu_ops.cpp
// (fused_silu_and_mul, the norms, rotary, cpu_decoder_layers) and bf16_small_m.cpp (the gate_up kernels' fused
// SiLU-and-mul epilogue), so both compute every element the same way.
//   Vec: 16 floats (AVX-512F) or 8 (AVX2) by compile-time dispatch (-march=native); absent in a portable build
//   (VLLM_LITE_FUSED_VEC undefined). Its exp is the SLEEF routine torch's vectorised kernels call (weak: found in
//   libtorch_cpu at load time, else has_exp() is false).
//   silu_mul_vec / silu_mul_scalar: one element (a vector of them) of silu(gate) * up in T, as torch computes
//   F.silu(gate) * up: the SiLU rounded to T, times up; the caller's store rounds the product to T.
//   silu_vec_end: the elements [0, silu_vec_end) of a row of d that torch's vectorised loop covers (the rest go
//   through its scalar lambda, std::exp).
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_common.h"

#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));  // exported by libtorch_cpu
#define VLLM_LITE_FUSED_AVX512 1
#elif defined(__AVX2__)
extern "C" __m256 Sleef_expf8_u10(__m256) __attribute__((weak));
#define VLLM_LITE_FUSED_AVX2 1
#endif

namespace vllm_lite {
namespace {

// Round a float to T's precision (torch rounds every elementwise result to the tensor's dtype).
template <typename T>
inline float round_t(float v);
template <>
inline float round_t<float>(float v) {
  return v;
}
template <>
inline float round_t<c10::BFloat16>(float v) {
  return to_f32(c10::BFloat16(v));
}
#if defined(VLLM_LITE_FUSED_AVX512)
struct Vec {
  using R = __m512;
  static constexpr int64_t W = 16;
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float v) { return _mm512_set1_ps(v); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static R load(const c10::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R div(R a, R b) { return _mm512_div_ps(a, b); }
  static R neg(R a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN))); }
  static R nc(R v) {
    asm("" : "+v"(v));
    return v;
  }
  // bfloat16 bits (round to nearest even, NaN -> 0x7fc0, as c10::BFloat16) in the low half of each lane.
  static __m512i bf16_bits(R v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  }
  static R round_bf16(R v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static void store(c10::BFloat16* p, R v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
  }
  static bool has_exp() { return Sleef_expf16_u10 != nullptr; }
  static R exp(R v) { return Sleef_expf16_u10(v); }
};
#elif defined(VLLM_LITE_FUSED_AVX2)
struct Vec {
  using R = __m256;
  static constexpr int64_t W = 8;
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float v) { return _mm256_set1_ps(v); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static R load(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R div(R a, R b) { return _mm256_div_ps(a, b); }
  static R neg(R a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  static R nc(R v) {
    asm("" : "+x"(v));
    return v;
  }
  static __m256i bf16_bits(R v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  }
  static R round_bf16(R v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static void store(c10::BFloat16* p, R v) {
    const __m256i r = bf16_bits(v);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static bool has_exp() { return Sleef_expf8_u10 != nullptr; }
  static R exp(R v) { return Sleef_expf8_u10(v); }
};
#endif

#if defined(VLLM_LITE_FUSED_AVX512) || defined(VLLM_LITE_FUSED_AVX2)
#define VLLM_LITE_FUSED_VEC 1
template <typename T>
inline Vec::R vround(Vec::R v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return Vec::round_bf16(v);
  }
}
#endif

// ------------------------------------------------------------------ SiLU and mul, one element

inline float silu_scalar(float g) { return g / (1.0f + std::exp(-g)); }

// silu(g) rounded to T, times u (g, u: values of T); the store to T rounds the result.
template <typename T>
inline float silu_mul_scalar(float g, float u) {
  return round_t<T>(silu_scalar(g)) * u;
}

#ifdef VLLM_LITE_FUSED_VEC
// The same for Vec::W lanes, with SLEEF's exp (only where Vec::has_exp()).
template <typename T>
inline Vec::R silu_mul_vec(Vec::R g, Vec::R u) {
  const Vec::R one = Vec::set1(1.0f);
  return Vec::mul(vround<T>(Vec::div(g, Vec::add(one, Vec::exp(Vec::neg(g))))), u);
}
#endif

// torch's vectorised loop covers whole pairs of Vectorized<T> (2 x 64 bytes on AVX-512); the rest of a row of d
// goes through its scalar lambda (std::exp). Elements [0, silu_vec_end<T>(d)) take silu_mul_vec, the rest
// silu_mul_scalar, so the same exp computes each element as in torch.
template <typename T>
inline int64_t silu_vec_end(int64_t d) {
#ifdef VLLM_LITE_FUSED_VEC
  if (Vec::has_exp()) {
    const int64_t pair = 2 * Vec::W * static_cast<int64_t>(sizeof(float) / sizeof(T));
    return d - d % pair;
  }
#endif
  return 0;
}

#ifdef VLLM_LITE_FUSED_AVX512
// bfloat16 on AVX-512: a gate's SiLU rounded to bf16 is a function of its 16 bits, so the vector columns of
// fused_silu_and_mul and of the gate_up kernels' epilogue look it up in a table of all 65,536 (256 KB a
// translation unit, built once by silu_mul_vec itself: times 1.0f, which is exact) instead of computing SLEEF's exp
// and a divide per element; the product with up and its rounding are silu_mul_vec's. Same bits by construction
// (tests/test_cpu_silu_bf16_table.py: every bf16 gate value against torch's F.silu * up). Only where
// silu_vec_end > 0 (SLEEF's exp found), as silu_mul_vec. SiLU of a vs_vllm prefill step's [2048, 6144] gate_up:
// 5.7 -> 3.8 ms on one Zen 4 core (PROFILE.md, helper PF).
inline const float* silu_bf16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    const Vec::R one = Vec::set1(1.0f);
    for (int32_t i = 0; i < 65536; i += 16) {
      const __m512i bits = _mm512_add_epi32(_mm512_set1_epi32(i), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                                      10, 11, 12, 13, 14, 15));
      const Vec::R g = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
      Vec::store(t.data() + i, silu_mul_vec<c10::BFloat16>(g, one));
    }
    return t;
  }();
  return table.data();
}

// silu_mul_vec<bf16>(g, u) for 16 bf16 gates at g, by the table.
inline Vec::R silu_mul_lut(const float* table, const c10::BFloat16* g, Vec::R u) {
  const __m512i idx = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
  return Vec::mul(_mm512_i32gather_ps(idx, table, 4), u);
}

// The same for 16 gates already widened to float32 from bf16 (their low 16 bits zero): the gate_up epilogue's.
inline Vec::R silu_mul_lut(const float* table, Vec::R g, Vec::R u) {
  const __m512i idx = _mm512_srli_epi32(_mm512_castps_si512(g), 16);
  return Vec::mul(_mm512_i32gather_ps(idx, table, 4), u);
}
#endif

}  // namespace
}  // namespace vllm_lite
