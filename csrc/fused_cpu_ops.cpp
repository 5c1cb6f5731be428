// Fused small ops for the CPU forward (vllm_lite/worker/models/layers.py): each replaces several torch calls
// whose dispatch cost dominated a batch-1 decode step (benchmarks/PROFILE.md, "Zen 4 ... batch-1 decode"):
//   fused_rms_norm(x, residual?, weight, eps, gemma) -> (out, residual_out)
//       residual add + RMSNorm in one pass over each row; gemma multiplies by (1 + weight) in float32.
//   fused_rotary_embedding(positions, query!, key!, cos_sin_cache, head_size, rotary_dim)
//       NeoX-style (rotate-half) RoPE of q and k in place, cos/sin read from the float32 cache by position.
//   fused_silu_and_mul(x [.., 2d]) -> silu(x[.., :d]) * x[.., d:]
// bfloat16 and float32 inputs.
//
// Numerics: each op reproduces the torch code it replaces operation by operation, rounding where torch rounds
// (bfloat16 after every elementwise op, products never fused into an FMA, the norm's sum of squares in torch's
// cascade order for a contiguous row, rsqrt as 1 / sqrt, SiLU's exp through the same SLEEF routine torch's
// vectorised kernels call, std::exp for the elements torch's scalar tail computes), so on a host where torch
// runs the vector width this library was compiled for (AVX-512: 16 floats, AVX2: 8) the results are the torch
// path's bit for bit (tests/test_cpu_fused_ops.py). Elsewhere they can differ in the last bit.
//
// Vector paths by compile-time dispatch (-march=native): AVX-512F, else AVX2, else portable scalar loops.
// Rows go over torch's intra-op threads only when there are many (grain sized to ~16K elements).

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

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

// Keeps the compiler from contracting a product into a following add/sub (an FMA rounds once, torch twice).
inline float nc(float v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));
  return v;
#else
  volatile float t = v;
  return t;
#endif
}

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
constexpr int64_t kVecWidth = Vec::W;
template <typename T>
inline Vec::R vround(Vec::R v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return Vec::round_bf16(v);
  }
}
inline Vec::R addv(Vec::R a, Vec::R b) { return Vec::add(a, b); }
template <typename A>
inline A zerov() {
  if constexpr (std::is_same_v<A, float>) {
    return 0.0f;
  } else {
    return Vec::zero();
  }
}
#else
constexpr int64_t kVecWidth = 1;
template <typename A>
inline A zerov() {
  return 0.0f;
}
#endif
inline float addv(float a, float b) { return a + b; }

// 8-float vectors for the norm's sum of squares (see sum_squares).
#if defined(__AVX2__)
#if defined(VLLM_LITE_FUSED_AVX512)  // (an AVX2 build has these as Vec's)
inline __m256 addv(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
template <>
inline __m256 zerov<__m256>() {
  return _mm256_setzero_ps();
}
#endif
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#else
struct F8 {
  float v[8];
};
inline F8 addv(F8 a, F8 b) {
  for (int l = 0; l < 8; ++l) a.v[l] += b.v[l];
  return a;
}
template <>
inline F8 zerov<F8>() {
  return F8{};
}
#endif

// ------------------------------------------------------------------ torch's cascade sum (SumKernel.cpp)
// sum() of a contiguous row: multi_row_sum over 4 interleaved accumulators with 4 levels of 16-element chunks,
// vectors first, then the scalar tail, then the lanes in order. Reproduced so the norm's mean matches torch's.

inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

template <typename A, typename Load>
inline void multi_row_sum4(A out[4], const Load& load, int64_t size) {
  constexpr int64_t levels = 4;
  const int64_t lp = std::max<int64_t>(4, ceil_log2(size) / levels);
  const int64_t step = int64_t(1) << lp, mask = step - 1;
  A acc[levels][4];
  for (int64_t j = 0; j < levels; ++j)
    for (int k = 0; k < 4; ++k) acc[j][k] = zerov<A>();
  int64_t i = 0;
  for (; i + step <= size;) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] = addv(acc[0][k], load(i * 4 + k));
    for (int64_t j = 1; j < levels; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k] = addv(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = zerov<A>();
      }
      if ((i & (mask << (j * lp))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k] = addv(acc[0][k], load(i * 4 + k));
  for (int64_t j = 1; j < levels; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k] = addv(acc[0][k], acc[j][k]);
  for (int k = 0; k < 4; ++k) out[k] = acc[0][k];
}

template <typename A, typename Load>
inline A row_sum(const Load& load, int64_t size) {
  const int64_t size_ilp = size / 4;
  A p[4];
  multi_row_sum4<A>(p, load, size_ilp);
  for (int64_t i = size_ilp * 4; i < size; ++i) p[0] = addv(p[0], load(i));
  for (int k = 1; k < 4; ++k) p[0] = addv(p[0], p[k]);
  return p[0];
}

// sum(s[i] * s[i]) for a row of n, in torch's order for a contiguous float32 row. torch registers its sum
// kernel without an AVX-512 variant (REGISTER_DISPATCH), so an AVX-512 host sums with its AVX2 code too:
// 8-float vectors on both, hence the 256-bit accumulators here whenever AVX2 is there.

template <typename T>
float sum_squares(const T* s, int64_t n) {
  constexpr int64_t w = 8;
  if (n >= w) {
    const int64_t nv = n / w;
    alignas(32) float lanes[w];
#if defined(__AVX2__)
    const __m256 part = row_sum<__m256>(
        [&](int64_t v) {
          __m256 a = load8(s + v * w);
          a = _mm256_mul_ps(a, a);
          asm("" : "+x"(a));  // the square is rounded before it is added (no FMA), as torch's pow(x, 2)
          return a;
        },
        nv);
    _mm256_store_ps(lanes, part);
#else  // torch's default (non-AVX) vectors are 8 floats as well
    const F8 part = row_sum<F8>(
        [&](int64_t v) {
          F8 a;
          for (int64_t l = 0; l < w; ++l) {
            const float e = to_f32(s[v * w + l]);
            a.v[l] = nc(e * e);
          }
          return a;
        },
        nv);
    for (int64_t l = 0; l < w; ++l) lanes[l] = part.v[l];
#endif
    float fin = 0.0f;
    for (int64_t k = nv * w; k < n; ++k) {
      const float a = to_f32(s[k]);
      fin += nc(a * a);
    }
    for (int64_t k = 0; k < w; ++k) fin += lanes[k];
    return fin;
  }
  return row_sum<float>(
      [&](int64_t i) {
        const float a = to_f32(s[i]);
        return nc(a * a);
      },
      n);
}

// ------------------------------------------------------------------ rows of an N-d tensor
// Offsets of the rows (all but the last dim) of a tensor whose last dim is contiguous.
struct Rows {
  int64_t ndim = 0;
  int64_t sizes[8] = {};
  int64_t strides[8] = {};
  int64_t count = 1;
  explicit Rows(const at::Tensor& t) {
    ndim = t.dim() - 1;
    for (int64_t d = 0; d < ndim; ++d) {
      sizes[d] = t.size(d);
      strides[d] = t.stride(d);
      count *= sizes[d];
    }
  }
  int64_t offset(int64_t r) const {
    int64_t off = 0;
    for (int64_t d = ndim - 1; d >= 0; --d) {
      off += (r % sizes[d]) * strides[d];
      r /= sizes[d];
    }
    return off;
  }
};

inline void check_float_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
                   msg(name, " must be float32 or bfloat16, got ", t.scalar_type()));
}

inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() >= 1 && t.dim() <= 9, msg(name, " must have 1 to 9 dimensions, got shape ", t.sizes()));
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1,
                    msg(name, " must be contiguous along its last dimension (strides ", t.strides(), ")"));
}

inline int64_t grain_rows(int64_t elems_per_row) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, elems_per_row));
}

// ------------------------------------------------------------------ RMSNorm (+ residual)

template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps, bool gemma,
               at::Tensor& out, at::Tensor* res_out) {
  const int64_t n = x.size(-1);
  const Rows xr(x);
  const Rows rr = residual ? Rows(*residual) : Rows(x);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  T* sp = res_out ? res_out->data_ptr<T>() : nullptr;
  const float epsf = static_cast<float>(eps);
  // Gemma: (1 + weight.float()) in float32, once. Plain: the weight in x's dtype (checked).
  at::Tensor wg;
  if (gemma) wg = weight.to(at::kFloat).add(1.0);
  const float* wgp = gemma ? wg.data_ptr<float>() : nullptr;
  const T* wp = gemma ? nullptr : weight.data_ptr<T>();
  at::parallel_for(0, xr.count, grain_rows(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* x_row = xp + xr.offset(r);
      const T* s = x_row;
      if (rp) {  // s = x + residual, rounded to T, is the new residual
        const T* r_row = rp + rr.offset(r);
        T* s_row = sp + r * n;
        int64_t i = 0;
#ifdef VLLM_LITE_FUSED_VEC
        for (; i + Vec::W <= n; i += Vec::W)
          Vec::store(s_row + i, Vec::add(Vec::load(x_row + i), Vec::load(r_row + i)));
#endif
        for (; i < n; ++i) store_f32(to_f32(x_row[i]) + to_f32(r_row[i]), s_row + i);
        s = s_row;
      }
      const float var = sum_squares(s, n) / static_cast<float>(n);
      const float rstd = 1.0f / std::sqrt(var + epsf);
      T* o_row = op + r * n;
      int64_t i = 0;
#ifdef VLLM_LITE_FUSED_VEC
      const Vec::R rv = Vec::set1(rstd);
      if (gemma) {
        for (; i + Vec::W <= n; i += Vec::W)
          Vec::store(o_row + i, Vec::mul(Vec::mul(Vec::load(s + i), rv), Vec::load(wgp + i)));
      } else {
        for (; i + Vec::W <= n; i += Vec::W)
          Vec::store(o_row + i, Vec::mul(vround<T>(Vec::mul(Vec::load(s + i), rv)), Vec::load(wp + i)));
      }
#endif
      if (gemma) {
        for (; i < n; ++i) store_f32((to_f32(s[i]) * rstd) * wgp[i], o_row + i);
      } else {
        for (; i < n; ++i) store_f32(round_t<T>(to_f32(s[i]) * rstd) * to_f32(wp[i]), o_row + i);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> fused_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                  const at::Tensor& weight, double eps, bool gemma) {
  check_cpu(x, "x");
  check_float_dtype(x, "x");
  check_rows(x, "x");
  const int64_t n = x.size(-1);
  check_cpu(weight, "weight");
  check_dim(weight, 1, "weight");
  check_contiguous(weight, "weight");
  TORCH_CHECK_VALUE(weight.size(0) == n,
                    msg("fused_rms_norm: weight must have ", n, " entries (x's last dim), got ", weight.size(0)));
  if (gemma) {
    check_float_dtype(weight, "weight");
  } else {
    check_dtype(weight, x.scalar_type(), "weight");
  }
  if (residual.has_value()) {
    check_cpu(*residual, "residual");
    check_dtype(*residual, x.scalar_type(), "residual");
    check_rows(*residual, "residual");
    TORCH_CHECK_VALUE(residual->sizes() == x.sizes(), msg("fused_rms_norm: residual must have x's shape ", x.sizes(),
                                                          ", got ", residual->sizes()));
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  // Without a residual the second output is an empty tensor (the schema has no optional outputs).
  at::Tensor res_out = at::empty(residual.has_value() ? x.sizes() : c10::IntArrayRef{0}, x.options());
  if (x.numel() == 0) return {out, res_out};
  const at::Tensor* rp = residual.has_value() ? &*residual : nullptr;
  at::Tensor* sp = residual.has_value() ? &res_out : nullptr;
  if (x.scalar_type() == at::kFloat) {
    norm_rows<float>(x, rp, weight, eps, gemma, out, sp);
  } else {
    norm_rows<c10::BFloat16>(x, rp, weight, eps, gemma, out, sp);
  }
  return {out, res_out};
}

// ------------------------------------------------------------------ rotary embedding (NeoX, in place)

// One head: x[i], x[half + i] for i < half rotated by cos c[i], sin s[i] (float32 table rows), as torch does:
// cos/sin rounded to T, each product rounded, then the difference/sum rounded.
template <typename T>
inline void rotate_head(T* x, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
#ifdef VLLM_LITE_FUSED_VEC
  for (; i + Vec::W <= half; i += Vec::W) {
    const Vec::R cv = vround<T>(Vec::load(c + i)), sv = vround<T>(Vec::load(s + i));
    const Vec::R x1 = Vec::load(x + i), x2 = Vec::load(x + half + i);
    const Vec::R a = vround<T>(Vec::nc(Vec::mul(x1, cv))), b = vround<T>(Vec::nc(Vec::mul(x2, sv)));
    const Vec::R e = vround<T>(Vec::nc(Vec::mul(x2, cv))), f = vround<T>(Vec::nc(Vec::mul(x1, sv)));
    Vec::store(x + i, Vec::sub(a, b));
    Vec::store(x + half + i, Vec::add(e, f));
  }
#endif
  for (; i < half; ++i) {
    const float cf = round_t<T>(c[i]), sf = round_t<T>(s[i]);
    const float x1 = to_f32(x[i]), x2 = to_f32(x[half + i]);
    const float a = round_t<T>(nc(x1 * cf)), b = round_t<T>(nc(x2 * sf));
    const float e = round_t<T>(nc(x2 * cf)), f = round_t<T>(nc(x1 * sf));
    store_f32(a - b, x + i);
    store_f32(e + f, x + half + i);
  }
}

template <typename T, typename P>
void rotary_rows(const P* pos, int64_t pos_stride, at::Tensor& query, at::Tensor& key, const float* cache,
                 int64_t head_size, int64_t rotary_dim) {
  const int64_t t = query.size(0), half = rotary_dim / 2;
  const int64_t qh = query.size(1) / head_size, kh = key.size(1) / head_size;
  const int64_t qs = query.stride(0), ks = key.stride(0);
  T* qp = query.data_ptr<T>();
  T* kp = key.data_ptr<T>();
  at::parallel_for(0, t, grain_rows((qh + kh) * rotary_dim), [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i) {
      const float* c = cache + static_cast<int64_t>(pos[i * pos_stride]) * rotary_dim;
      const float* s = c + half;
      for (int64_t h = 0; h < qh; ++h) rotate_head<T>(qp + i * qs + h * head_size, c, s, half);
      for (int64_t h = 0; h < kh; ++h) rotate_head<T>(kp + i * ks + h * head_size, c, s, half);
    }
  });
}

void fused_rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                            const at::Tensor& cos_sin_cache, int64_t head_size, int64_t rotary_dim) {
  check_cpu(positions, "positions");
  check_cpu(query, "query");
  check_cpu(key, "key");
  check_cpu(cos_sin_cache, "cos_sin_cache");
  TORCH_CHECK_TYPE(positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt,
                   msg("positions must be int64 or int32, got ", positions.scalar_type()));
  check_float_dtype(query, "query");
  check_dtype(key, query.scalar_type(), "key");
  check_dtype(cos_sin_cache, at::kFloat, "cos_sin_cache");
  check_dim(positions, 1, "positions");
  check_dim(query, 2, "query");
  check_dim(key, 2, "key");
  check_dim(cos_sin_cache, 2, "cos_sin_cache");
  check_contiguous(cos_sin_cache, "cos_sin_cache");
  TORCH_CHECK_VALUE(head_size > 0 && rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_size,
                    msg("fused_rotary_embedding: needs 0 < rotary_dim <= head_size and rotary_dim even, got head_size ",
                        head_size, ", rotary_dim ", rotary_dim));
  const int64_t t = positions.size(0);
  TORCH_CHECK_VALUE(query.size(0) == t && key.size(0) == t,
                    msg("fused_rotary_embedding: query and key must have ", t, " rows (positions), got ",
                        query.sizes(), " and ", key.sizes()));
  TORCH_CHECK_VALUE(query.size(1) % head_size == 0 && key.size(1) % head_size == 0,
                    msg("fused_rotary_embedding: query and key widths must be multiples of head_size ", head_size,
                        ", got ", query.sizes(), " and ", key.sizes()));
  TORCH_CHECK_VALUE((query.size(1) == 0 || query.stride(1) == 1) && (key.size(1) == 0 || key.stride(1) == 1),
                    msg("fused_rotary_embedding: query and key rows must be contiguous (strides ", query.strides(),
                        " and ", key.strides(), ")"));
  TORCH_CHECK_VALUE(cos_sin_cache.size(1) == rotary_dim,
                    msg("fused_rotary_embedding: cos_sin_cache must be [max_position, ", rotary_dim, "], got ",
                        cos_sin_cache.sizes()));
  if (t == 0) return;
  // The positions are indices into the table: checked before the parallel loop reads them.
  const int64_t max_pos = cos_sin_cache.size(0), ps = positions.stride(0);
  int64_t bad = -1;
  if (positions.scalar_type() == at::kLong) {
    const int64_t* p = positions.data_ptr<int64_t>();
    for (int64_t i = 0; i < t && bad < 0; ++i)
      if (p[i * ps] < 0 || p[i * ps] >= max_pos) bad = i;
    TORCH_CHECK_INDEX(bad < 0, msg("fused_rotary_embedding: position ", bad < 0 ? 0 : p[bad * ps], " at row ", bad,
                                   " is outside the cos/sin table of ", max_pos, " rows"));
  } else {
    const int32_t* p = positions.data_ptr<int32_t>();
    for (int64_t i = 0; i < t && bad < 0; ++i)
      if (p[i * ps] < 0 || p[i * ps] >= max_pos) bad = i;
    TORCH_CHECK_INDEX(bad < 0, msg("fused_rotary_embedding: position ", bad < 0 ? 0 : p[bad * ps], " at row ", bad,
                                   " is outside the cos/sin table of ", max_pos, " rows"));
  }
  const float* cache = cos_sin_cache.data_ptr<float>();
  const bool bf16 = query.scalar_type() == at::kBFloat16;
  if (positions.scalar_type() == at::kLong) {
    const int64_t* p = positions.data_ptr<int64_t>();
    if (bf16) {
      rotary_rows<c10::BFloat16>(p, ps, query, key, cache, head_size, rotary_dim);
    } else {
      rotary_rows<float>(p, ps, query, key, cache, head_size, rotary_dim);
    }
  } else {
    const int32_t* p = positions.data_ptr<int32_t>();
    if (bf16) {
      rotary_rows<c10::BFloat16>(p, ps, query, key, cache, head_size, rotary_dim);
    } else {
      rotary_rows<float>(p, ps, query, key, cache, head_size, rotary_dim);
    }
  }
}

// ------------------------------------------------------------------ SiLU and mul

inline float silu_scalar(float g) { return g / (1.0f + std::exp(-g)); }

template <typename T>
void silu_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t d = x.size(-1) / 2;
  const Rows xr(x);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // torch's vectorised loop covers whole pairs of Vectorized<T> (2 x 64 bytes on AVX-512); the rest of a row
  // goes through its scalar lambda (std::exp). Same split here, so the same exp computes each element.
  int64_t vec_end = 0;
#ifdef VLLM_LITE_FUSED_VEC
  if (Vec::has_exp()) {
    const int64_t pair = 2 * Vec::W * static_cast<int64_t>(sizeof(float) / sizeof(T));
    vec_end = d - d % pair;
  }
#endif
  at::parallel_for(0, xr.count, grain_rows(2 * d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = xp + xr.offset(r);
      const T* u = g + d;
      T* o = op + r * d;
      int64_t i = 0;
#ifdef VLLM_LITE_FUSED_VEC
      const Vec::R one = Vec::set1(1.0f);
      for (; i < vec_end; i += Vec::W) {
        const Vec::R gv = Vec::load(g + i);
        const Vec::R sv = vround<T>(Vec::div(gv, Vec::add(one, Vec::exp(Vec::neg(gv)))));
        Vec::store(o + i, Vec::mul(sv, Vec::load(u + i)));
      }
#endif
      for (; i < d; ++i) store_f32(round_t<T>(silu_scalar(to_f32(g[i]))) * to_f32(u[i]), o + i);
    }
  });
}

at::Tensor fused_silu_and_mul(const at::Tensor& x) {
  check_cpu(x, "x");
  check_float_dtype(x, "x");
  check_rows(x, "x");
  TORCH_CHECK_VALUE(x.size(-1) % 2 == 0,
                    msg("fused_silu_and_mul: x's last dim must be even ([.., 2 * d]), got shape ", x.sizes()));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() /= 2;
  at::Tensor out = at::empty(shape, x.options());
  if (out.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    silu_rows<float>(x, out);
  } else {
    silu_rows<c10::BFloat16>(x, out);
  }
  return out;
}

// Floats per vector of this build's elementwise loops: 16 (AVX-512), 8 (AVX2), 1 (portable).
int64_t fused_cpu_ops_vector_width() { return kVecWidth; }

// Whether SiLU's vector exp (SLEEF, from libtorch_cpu) was found; without it every element takes std::exp.
bool fused_cpu_ops_vector_exp() {
#ifdef VLLM_LITE_FUSED_VEC
  return Vec::has_exp();
#else
  return false;
#endif
}

}  // namespace
}  // namespace vllm_lite

TORCH_LIBRARY_FRAGMENT(vllm_lite, m) {
  m.def("fused_cpu_ops_vector_width() -> int", &vllm_lite::fused_cpu_ops_vector_width);
  m.def("fused_cpu_ops_vector_exp() -> bool", &vllm_lite::fused_cpu_ops_vector_exp);
  m.def("fused_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps, bool gemma=False) -> (Tensor, Tensor)");
  m.def(
      "fused_rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_sin_cache, "
      "int head_size, int rotary_dim) -> ()");
  m.def("fused_silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_lite, CPU, m) {
  m.impl("fused_rms_norm", &vllm_lite::fused_rms_norm);
  m.impl("fused_rotary_embedding", &vllm_lite::fused_rotary_embedding);
  m.impl("fused_silu_and_mul", &vllm_lite::fused_silu_and_mul);
}
