// Fused small ops for the CPU forward (vllm_lite/worker/models/layers.py): each replaces several torch calls
// whose dispatch cost dominated a batch-1 decode step (benchmarks/PROFILE.md, "Zen 4 ... batch-1 decode"):
//   fused_rms_norm(x, residual?, weight, eps, gemma) -> (out, residual_out)
//       residual add + RMSNorm in one pass over each row; gemma multiplies by (1 + weight) in float32.
//   fused_rotary_embedding(positions, query!, key!, cos_sin_cache, head_size, rotary_dim)
//       NeoX-style (rotate-half) RoPE of q and k in place, cos/sin read from the float32 cache by position.
//   fused_silu_and_mul(x [.., 2d]) -> silu(x[.., :d]) * x[.., d:]
// bfloat16 and float32 inputs.
//   cpu_decoder_layers(weights, hidden, residual?, positions, kv_caches, ...) -> (hidden, residual)
//       a whole stack of Llama-family decoder layers (pre-norm attention + gated SiLU MLP) in one call: the ops
//       above, the q/k/v, o, gate_up and down linears through the kernels cpu_prepack.linear picks for the row
//       count (bf16_linear_small_m / bf16_linear_vnni / oneDNN's packed linear, or for unpacked weights
//       cpu_linear.linear's per-case choice handed in: F.linear, f32_linear_kblocked at a kc, or 768-output
//       slices), the K/V write (in the rotary's pass over the rows: rotary_rows with a KvDest) and paged attention
//       (ops.h); at decode row counts the gate_up kernel writes
//       silu(gate) * up itself (bf16_gate_up_small_m / _vnni over an interleaved copy: stack_mlp_act). A
//       layer's MLP may instead be a sparse mixture of experts (Mixtral, Qwen3-MoE: fused_moe.py's
//       SparseMoeBlock): the router and its top-k in one
//       moe_cpu_route call and the whole expert path in one moe_cpu_experts (float32) or moe_cpu_experts_bf16
//       call (csrc/moe_cpu.cpp), as SparseMoeBlock.forward runs them. Each layer's tensors are held by a
//       CpuDecoderWeights object built once per model (vllm_lite/worker/models/cpu_decoder_stack.py). Same
//       operations in the same order as the Python layers, so the same results bit for bit; what goes is ~20
//       Python-level calls and their dispatch a layer.
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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_common.h"
#include "cpu_vec.h"
#include "ops.h"

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

#ifdef VLLM_LITE_FUSED_VEC
constexpr int64_t kVecWidth = Vec::W;
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

// Where the rotary pass also puts each token's rotated key row and its value row (write_kv's copies, ops.h: the
// same bytes to the same slots, a negative slot skipped as padding), so the cache is written while the rows just
// rotated are in L1 and shared over the threads with them, not in a serial loop after. The caller has checked
// what write_kv checks (check_kv_write).
template <typename T>
struct KvDest {
  const T* v;            // value rows
  int64_t vs;            // their stride
  T* k_dst;              // the cache's key plane
  T* v_dst;              // its value plane
  int64_t row;           // elements of a cache token row
  const int64_t* slots;  // a token's slot, < 0: padding
};

// Rotary of q and k in place, row by row over the threads; with `kv`, the K/V write of each row after it.
template <typename T, typename P>
void rotary_rows(const P* pos, int64_t pos_stride, at::Tensor& query, at::Tensor& key, const float* cache,
                 int64_t head_size, int64_t rotary_dim, const KvDest<T>* kv) {
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
      if (kv == nullptr || kv->slots[i] < 0) continue;
      const int64_t slot = kv->slots[i];
      std::memcpy(kv->k_dst + slot * kv->row, kp + i * ks, kv->row * sizeof(T));
      std::memcpy(kv->v_dst + slot * kv->row, kv->v + i * kv->vs, kv->row * sizeof(T));
    }
  });
}

// rotary_rows for the positions' index type and q's dtype (bf16 or float32); with kv_cache (v and slots too): the
// K/V write in the same pass.
void rotary_dispatch(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const float* cache,
                     int64_t head_size, int64_t rotary_dim, const at::Tensor* v = nullptr,
                     at::Tensor* kv_cache = nullptr, const int64_t* slots = nullptr) {
  const auto run = [&](auto type, const auto* p) {
    using T = decltype(type);
    KvDest<T> dest{};
    if (kv_cache != nullptr) {
      const int64_t row = k.size(1) / head_size * head_size;
      T* k_dst = kv_cache->data_ptr<T>();
      dest = KvDest<T>{v->data_ptr<T>(), v->stride(0), k_dst, k_dst + kv_cache->size(1) * kv_cache->size(2) * row,
                       row, slots};
    }
    rotary_rows<T>(p, positions.stride(0), q, k, cache, head_size, rotary_dim, kv_cache != nullptr ? &dest : nullptr);
  };
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  if (positions.scalar_type() == at::kLong) {
    const int64_t* p = positions.data_ptr<int64_t>();
    if (bf16) {
      run(c10::BFloat16{}, p);
    } else {
      run(float{}, p);
    }
  } else {
    const int32_t* p = positions.data_ptr<int32_t>();
    if (bf16) {
      run(c10::BFloat16{}, p);
    } else {
      run(float{}, p);
    }
  }
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
  rotary_dispatch(positions, query, key, cos_sin_cache.data_ptr<float>(), head_size, rotary_dim);
}

// ------------------------------------------------------------------ SiLU and mul
// The element rule (silu_mul_vec / silu_mul_scalar, and which elements take which) is cpu_vec.h's, shared with
// the gate_up kernels' fused epilogue (bf16_small_m.cpp).

// bf16 on AVX-512 the vector columns take cpu_vec.h's table (silu_bf16_table / silu_mul_lut).

template <typename T>
void silu_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t d = x.size(-1) / 2;
  const Rows xr(x);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t vec_end = silu_vec_end<T>(d);
#ifdef VLLM_LITE_FUSED_AVX512
  const float* table = nullptr;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (vec_end > 0) table = silu_bf16_table();
  }
#endif
  at::parallel_for(0, xr.count, grain_rows(2 * d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = xp + xr.offset(r);
      const T* u = g + d;
      T* o = op + r * d;
      int64_t i = 0;
#ifdef VLLM_LITE_FUSED_AVX512
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (table != nullptr) {
          for (; i < vec_end; i += Vec::W) Vec::store(o + i, silu_mul_lut(table, g + i, Vec::load(u + i)));
        }
      }
#endif
#ifdef VLLM_LITE_FUSED_VEC
      for (; i < vec_end; i += Vec::W) Vec::store(o + i, silu_mul_vec<T>(Vec::load(g + i), Vec::load(u + i)));
#endif
      for (; i < d; ++i) store_f32(silu_mul_scalar<T>(to_f32(g[i]), to_f32(u[i])), o + i);
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


// ------------------------------------------------------------------ a stack of Llama decoder layers

// Per layer, in CpuDecoderWeights::t (a 0-element tensor stands for "absent"):
enum LayerTensor : int64_t {
  kInNorm = 0,    // input_layernorm.weight [hidden]
  kPostNorm,      // post_attention_layernorm.weight [hidden]
  kQNorm,         // q_norm.weight [head_dim] (Qwen3) or absent
  kKNorm,         // k_norm.weight [head_dim] or absent
  kCosSin,        // rotary cos_sin_cache, float32 [max_position, rotary_dim]
  kLinears,       // then 4 linears (qkv, o, gate_up, down), kLinearSlots each (gate_up, down absent for MoE)
  kRouter = kLinears + 4 * 5,  // MoE layers: the router's weight [E, hidden] (F.linear), else absent
  kW13,                        // MoE layers: the experts' gate/up in moe_cpu_pack(_bf16)'s layout, else absent
  kW2,                         // MoE layers: the experts' down projection, likewise
  kPerLayer,
};
// A linear's slots: the small-m copy [N/4, K/32, 4, 32], the VNNI copy [N/32, K/2, 32, 2], oneDNN's packed
// weight, the plain weight [N, K] (layers that are not prepacked), the bias.
enum LinearSlot : int64_t { kSmall = 0, kVnni, kPacked, kPlain, kBias, kLinearSlots };
enum LinearIndex : int64_t { kQkv = 0, kO, kGateUp, kDown };
// Per layer, in CpuDecoderWeights::ints / floats:
// kMlpKind: kDenseMlp, or a MoE layer whose experts run moe_cpu_experts (float32) / moe_cpu_experts_bf16;
// kTopK, kRenormalize, kRoundWeights, kMoeInter: fused_moe.FusedMoE's top_k, renormalize, round_weights and
// per-rank intermediate size (0 for dense layers). kGateUpD: cpu_prepack's gate_up_interleaved (0: none).
enum LayerInt : int64_t {
  kNumHeads = 0,
  kNumKvHeads,
  kHeadDim,
  kRotaryDim,
  kSlidingWindow,
  kMlpKind,
  kTopK,
  kRenormalize,
  kRoundWeights,
  kMoeInter,
  kGateUpD,  // d where gate_up's small-m / VNNI copies are interleaved for the fused SiLU (see stack_mlp_act), else 0
  kIntsPerLayer
};
enum MlpKind : int64_t { kDenseMlp = 0, kMoeF32, kMoeBf16 };
enum LayerFloat : int64_t { kEpsIn = 0, kEpsPost, kEpsQk, kScale, kSoftCap, kFloatsPerLayer };

struct CpuDecoderWeights : torch::CustomClassHolder {
  std::vector<at::Tensor> t;
  std::vector<int64_t> ints;
  std::vector<double> floats;
  int64_t num_layers = 0;

  CpuDecoderWeights(std::vector<at::Tensor> t_, std::vector<int64_t> ints_, std::vector<double> floats_)
      : t(std::move(t_)), ints(std::move(ints_)), floats(std::move(floats_)) {
    const int64_t n = static_cast<int64_t>(t.size()) / kPerLayer;
    TORCH_CHECK_VALUE(n > 0 && static_cast<int64_t>(t.size()) == n * kPerLayer &&
                          static_cast<int64_t>(ints.size()) == n * kIntsPerLayer &&
                          static_cast<int64_t>(floats.size()) == n * kFloatsPerLayer,
                      msg("CpuDecoderWeights: ", static_cast<int64_t>(kPerLayer), " tensors, ",
                          static_cast<int64_t>(kIntsPerLayer), " ints and ", static_cast<int64_t>(kFloatsPerLayer),
                          " floats a layer; got ", static_cast<int64_t>(t.size()), ", ",
                          static_cast<int64_t>(ints.size()), ", ", static_cast<int64_t>(floats.size())));
    num_layers = n;
    for (int64_t l = 0; l < n; ++l) check_layer(l);
  }

  const at::Tensor& get(int64_t layer, int64_t i) const { return t[layer * kPerLayer + i]; }
  const at::Tensor& lin(int64_t layer, int64_t which, int64_t slot) const {
    return t[layer * kPerLayer + kLinears + which * kLinearSlots + slot];
  }
  int64_t iv(int64_t layer, int64_t i) const { return ints[layer * kIntsPerLayer + i]; }
  double fv(int64_t layer, int64_t i) const { return floats[layer * kFloatsPerLayer + i]; }
  static bool has(const at::Tensor& x) { return x.defined() && x.numel() > 0; }

  // Metadata only (shapes, dtypes, layouts): the checks the per-op entry points make, once per model.
  void check_layer(int64_t l) const {
    for (int64_t i = 0; i < kPerLayer; ++i) check_cpu(t[l * kPerLayer + i], "CpuDecoderWeights tensor");
    const at::Tensor& w_in = get(l, kInNorm);
    check_float_dtype(w_in, "input_layernorm.weight");
    check_dim(w_in, 1, "input_layernorm.weight");
    check_contiguous(w_in, "input_layernorm.weight");
    const auto dt = w_in.scalar_type();
    const int64_t hidden = w_in.size(0);
    const int64_t h = iv(l, kNumHeads), kvh = iv(l, kNumKvHeads), d = iv(l, kHeadDim), rot = iv(l, kRotaryDim);
    TORCH_CHECK_VALUE(h > 0 && kvh > 0 && h % kvh == 0 && d > 0 && rot > 0 && rot % 2 == 0 && rot <= d,
                      msg("CpuDecoderWeights: layer ", l, ": bad heads ", h, "/", kvh, ", head_dim ", d,
                          ", rotary_dim ", rot));
    const at::Tensor& w_post = get(l, kPostNorm);
    check_dtype(w_post, dt, "post_attention_layernorm.weight");
    check_contiguous(w_post, "post_attention_layernorm.weight");
    TORCH_CHECK_VALUE(w_post.dim() == 1 && w_post.size(0) == hidden,
                      msg("post_attention_layernorm.weight must be [", hidden, "], got ", w_post.sizes()));
    TORCH_CHECK_VALUE(has(get(l, kQNorm)) == has(get(l, kKNorm)), "q_norm and k_norm come together");
    for (int64_t i : {kQNorm, kKNorm}) {
      const at::Tensor& w = get(l, i);
      if (!has(w)) continue;
      check_dtype(w, dt, "q/k norm weight");
      check_contiguous(w, "q/k norm weight");
      TORCH_CHECK_VALUE(w.dim() == 1 && w.size(0) == d, msg("q/k norm weight must be [", d, "], got ", w.sizes()));
    }
    const at::Tensor& cs = get(l, kCosSin);
    check_dtype(cs, at::kFloat, "cos_sin_cache");
    check_dim(cs, 2, "cos_sin_cache");
    check_contiguous(cs, "cos_sin_cache");
    TORCH_CHECK_VALUE(cs.size(1) == rot, msg("cos_sin_cache must be [max_position, ", rot, "], got ", cs.sizes()));
    const int64_t qkv_n = (h + 2 * kvh) * d;
    const int64_t kind = iv(l, kMlpKind);
    TORCH_CHECK_VALUE(kind == kDenseMlp || kind == kMoeF32 || kind == kMoeBf16,
                      msg("CpuDecoderWeights: layer ", l, ": unknown MLP kind ", kind));
    const bool moe = kind != kDenseMlp;
    if (moe) check_moe(l, hidden, dt);
    TORCH_CHECK_VALUE(iv(l, kGateUpD) == 0 || (!moe && dt == at::kBFloat16 && iv(l, kGateUpD) > 0 &&
                                               (lin_in(l, kDown) < 0 || iv(l, kGateUpD) == lin_in(l, kDown))),
                      msg("CpuDecoderWeights: layer ", l, ": interleaved gate_up for d = ", iv(l, kGateUpD),
                          " on a layer whose down projection takes ", lin_in(l, kDown)));
    // Widths the weights tell (oneDNN's packed layout alone does not: -1, and oneDNN checks those itself).
    const int64_t inter = moe ? -1 : lin_in(l, kDown);
    const int64_t want[4][2] = {{hidden, qkv_n}, {h * d, hidden}, {hidden, moe ? -1 : 2 * inter}, {inter, hidden}};
    for (int64_t which = 0; which < 4; ++which) {
      if (moe && which >= kGateUp) {
        for (int64_t s = 0; s < kLinearSlots; ++s)
          TORCH_CHECK_VALUE(!has(lin(l, which, s)), "CpuDecoderWeights: a MoE layer has no gate_up/down linear");
        continue;
      }
      const int64_t k_in = lin_in(l, which), n_out = lin_out(l, which, -1);
      TORCH_CHECK_VALUE((k_in < 0 || want[which][0] < 0 || k_in == want[which][0]) &&
                            (n_out < 0 || want[which][1] < 0 || n_out == want[which][1]),
                        msg("CpuDecoderWeights: layer ", l, " linear ", which, " is ", k_in, " -> ", n_out,
                            ", expected ", want[which][0], " -> ", want[which][1]));
      for (int64_t s = 0; s < kLinearSlots; ++s) {
        const at::Tensor& w = lin(l, which, s);
        if (!has(w)) continue;
        if (s != kPacked) check_contiguous(w, "linear weight");
        if (s == kBias) {
          check_dtype(w, dt, "linear bias");
          TORCH_CHECK_VALUE(w.dim() == 1 && (want[which][1] < 0 || w.size(0) == want[which][1]),
                            "linear bias has the wrong size");
        } else {
          check_dtype(w, dt, "linear weight");
        }
      }
      TORCH_CHECK_VALUE(has(lin(l, which, kPacked)) || has(lin(l, which, kPlain)),
                        "every linear needs a packed or a plain weight");
      TORCH_CHECK_VALUE(!(has(lin(l, which, kSmall)) || has(lin(l, which, kVnni))) || has(lin(l, which, kPacked)),
                        "the small-m and VNNI copies come with a packed weight");
    }
  }
  // A MoE layer's router and experts: the layouts moe_cpu_experts(_bf16) checks, once per model.
  void check_moe(int64_t l, int64_t hidden, at::ScalarType dt) const {
    const bool bf16 = iv(l, kMlpKind) == kMoeBf16;
    TORCH_CHECK_VALUE(dt == (bf16 ? at::kBFloat16 : at::kFloat),
                      msg("CpuDecoderWeights: layer ", l, ": MoE kind ", iv(l, kMlpKind), " for ", dt, " weights"));
    const at::Tensor& r = get(l, kRouter);
    check_dtype(r, dt, "router weight");
    check_contiguous(r, "router weight");
    TORCH_CHECK_VALUE(r.dim() == 2 && r.size(1) == hidden && r.size(0) > 0,
                      msg("router weight must be [E, ", hidden, "], got ", r.sizes()));
    const int64_t e = r.size(0), k = iv(l, kTopK), inter = iv(l, kMoeInter);
    TORCH_CHECK_VALUE(k > 0 && k <= e && k <= 64 && inter > 0,
                      msg("CpuDecoderWeights: layer ", l, ": top_k ", k, " of ", e, " experts, inter ", inter));
    for (int64_t i : {kW13, kW2}) {
      const at::Tensor& w = get(l, i);
      check_dtype(w, dt, "packed experts");
      check_contiguous(w, "packed experts");
      TORCH_CHECK_VALUE(w.dim() == 4 && w.size(0) == e,
                        msg("packed experts must be [", e, ", ...] (4 dims), got ", w.sizes()));
    }
  }
  // A linear's input width (K) and output width (N); `fallback` when only the packed weight tells.
  int64_t lin_in(int64_t l, int64_t which) const {
    const at::Tensor& p = lin(l, which, kPlain);
    if (has(p)) return p.size(1);
    const at::Tensor& s = lin(l, which, kSmall);
    if (has(s)) return s.size(1) * 32;
    const at::Tensor& v = lin(l, which, kVnni);
    if (has(v)) return v.size(1) * 2;
    return -1;
  }
  int64_t lin_out(int64_t l, int64_t which, int64_t fallback) const {
    const at::Tensor& p = lin(l, which, kPlain);
    if (has(p)) return p.size(0);
    if (which == kGateUp && iv(l, kGateUpD) > 0) return 2 * iv(l, kGateUpD);  // its copies hold padded blocks
    const at::Tensor& s = lin(l, which, kSmall);
    if (has(s)) return s.size(0) * 4;
    const at::Tensor& v = lin(l, which, kVnni);
    if (has(v)) return v.size(0) * 32;
    const at::Tensor& b = lin(l, which, kBias);
    if (has(b)) return b.size(0);
    return fallback;
  }
};

at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const c10::optional<at::Tensor>& b) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("vllm_lite::bf16_linear_small_m", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const c10::optional<at::Tensor>&)>();
  return op.call(x, w, n, b);
}

at::Tensor vnni_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const c10::optional<at::Tensor>& b) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("vllm_lite::bf16_linear_vnni", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const c10::optional<at::Tensor>&)>();
  return op.call(x, w, n, b);
}

using GateUpFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const c10::optional<at::Tensor>&, bool);

at::Tensor gate_up_small_m(const at::Tensor& x, const at::Tensor& w, int64_t d, const c10::optional<at::Tensor>& b) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("vllm_lite::bf16_gate_up_small_m", "").typed<GateUpFn>();
  return op.call(x, w, d, b, true);
}

at::Tensor gate_up_vnni(const at::Tensor& x, const at::Tensor& w, int64_t d, const c10::optional<at::Tensor>& b) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("vllm_lite::bf16_gate_up_vnni", "").typed<GateUpFn>();
  return op.call(x, w, d, b, true);
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& b) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack st;
  st.reserve(6);
  st.emplace_back(x);
  st.emplace_back(packed);
  st.emplace_back(b);
  st.emplace_back(std::string("none"));
  st.emplace_back(c10::List<c10::optional<at::Scalar>>());
  st.emplace_back(std::string(""));
  op.callBoxed(&st);
  return st[0].toTensor();
}

at::Tensor kblocked_linear(const at::Tensor& x, const at::Tensor& w, int64_t kc) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("vllm_lite::f32_linear_kblocked", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
  return op.call(x, w, kc);
}

// cpu_linear.linear for an unpacked weight, as the caller's per-linear choice `plan` says: 0 F.linear, > 0
// f32_linear_kblocked at that kc, < 0 F.linear over slices of -plan output rows, concatenated (blocked_linear).
at::Tensor plain_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        int64_t plan) {
  if (plan > 0) return kblocked_linear(x, weight, plan);
  if (plan == 0) return at::linear(x, weight, bias);
  const int64_t n = weight.size(0), block = -plan;
  std::vector<at::Tensor> parts;
  for (int64_t s = 0; s < n; s += block) {
    const int64_t len = std::min(block, n - s);
    parts.push_back(at::linear(x, weight.narrow(0, s, len),
                               bias.has_value() ? c10::optional<at::Tensor>(bias->narrow(0, s, len))
                                                : c10::optional<at::Tensor>()));
  }
  return at::cat(parts, -1);
}

// cpu_prepack.linear's choice for x's row count (then cpu_linear.linear's choice `plan` for unpacked weights).
at::Tensor stack_linear(const CpuDecoderWeights& w, int64_t l, int64_t which, const at::Tensor& x, int64_t small_max,
                        int64_t vnni_max, int64_t plan = 0) {
  const at::Tensor& bias_t = w.lin(l, which, kBias);
  const c10::optional<at::Tensor> bias = CpuDecoderWeights::has(bias_t) ? c10::optional<at::Tensor>(bias_t)
                                                                         : c10::optional<at::Tensor>();
  const at::Tensor& packed = w.lin(l, which, kPacked);
  if (!CpuDecoderWeights::has(packed)) return plain_linear(x, w.lin(l, which, kPlain), bias, plan);
  const int64_t rows = x.size(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (rows <= small_max && bf16) {
    const at::Tensor& s = w.lin(l, which, kSmall);
    if (CpuDecoderWeights::has(s)) return small_m_linear(x, s, s.size(0) * 4, bias);
  } else if (rows <= vnni_max && bf16) {
    const at::Tensor& v = w.lin(l, which, kVnni);
    if (CpuDecoderWeights::has(v)) return vnni_linear(x, v, v.size(0) * 32, bias);
  }
  return onednn_linear(x, packed, bias);
}

// The MLP's gate_up and SiLU-and-mul: silu(gate) * up [rows, d]. Where gate_up's small-m / VNNI copies are
// interleaved (kGateUpD > 0; cpu_prepack.interleave_gate_up) and stack_linear would run one of them for this row
// count, that kernel runs with SiLU-and-mul in its epilogue (bf16_gate_up_small_m / _vnni): the same bits as
// the kernel's [rows, 2d] output through silu_rows, without it. Otherwise stack_linear, then silu_rows (it never
// reaches an interleaved copy: the same row rules pick them here first).
at::Tensor stack_mlp_act(const CpuDecoderWeights& w, int64_t l, const at::Tensor& x, int64_t small_max,
                         int64_t vnni_max, int64_t plan) {
  const int64_t d = w.iv(l, kGateUpD), rows = x.size(0);
  if (d > 0 && x.scalar_type() == at::kBFloat16 && CpuDecoderWeights::has(w.lin(l, kGateUp, kPacked))) {
    const at::Tensor& bias_t = w.lin(l, kGateUp, kBias);
    const c10::optional<at::Tensor> bias = CpuDecoderWeights::has(bias_t) ? c10::optional<at::Tensor>(bias_t)
                                                                           : c10::optional<at::Tensor>();
    if (rows <= small_max) {
      const at::Tensor& s = w.lin(l, kGateUp, kSmall);
      if (CpuDecoderWeights::has(s)) return gate_up_small_m(x, s, d, bias);
    } else if (rows <= vnni_max) {
      const at::Tensor& v = w.lin(l, kGateUp, kVnni);
      if (CpuDecoderWeights::has(v)) return gate_up_vnni(x, v, d, bias);
    }
  }
  at::Tensor gu = stack_linear(w, l, kGateUp, x, small_max, vnni_max, plan);
  at::Tensor act = at::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  if (gu.scalar_type() == at::kFloat) {
    silu_rows<float>(gu, act);
  } else {
    silu_rows<c10::BFloat16>(gu, act);
  }
  return act;
}

// The VNNI copy stack_linear / stack_mlp_act would run for linear `which` of layer l at `rows` rows, or null
// (another kernel, or no such linear): the weight set_vnni_next_weight names before the linear that runs first.
const at::Tensor* stack_vnni_weight(const CpuDecoderWeights& w, int64_t l, int64_t which, int64_t rows, bool bf16,
                                    int64_t small_max, int64_t vnni_max) {
  if (!bf16 || rows <= small_max || rows > vnni_max || !CpuDecoderWeights::has(w.lin(l, which, kPacked)))
    return nullptr;
  const at::Tensor& v = w.lin(l, which, kVnni);
  return CpuDecoderWeights::has(v) ? &v : nullptr;
}

// Clears the calling thread's set_vnni_next_weight when the stack returns or throws.
struct VnniNextGuard {
  ~VnniNextGuard() { set_vnni_next_weight(nullptr); }
};

at::Tensor stack_norm(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
                      at::Tensor* res_out) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    norm_rows<float>(x, residual, weight, eps, false, out, res_out);
  } else {
    norm_rows<c10::BFloat16>(x, residual, weight, eps, false, out, res_out);
  }
  return out;
}

// Whether the stack may write this layer's K/V itself (rotary_rows with a KvDest): the cache in the rows' dtype, laid out
// as write_kv takes it, and every slot inside it (write_kv's checks; anything else goes to write_kv, which raises
// its own errors or converts).
bool check_kv_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_cache, const int64_t* slots,
                    int64_t t) {
  if (kv_cache.scalar_type() != k.scalar_type() || v.scalar_type() != k.scalar_type() || k.stride(1) != 1 ||
      v.stride(1) != 1 || !kv_cache.is_contiguous() || kv_cache.size(0) != 2)
    return false;
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  for (int64_t i = 0; i < t; ++i) {
    if (slots[i] >= num_slots) return false;
  }
  return true;
}

at::Tensor moe_experts_op(bool bf16, const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                          const at::Tensor& weights, const at::Tensor& ids, int64_t inter) {
  using Fn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, int64_t);
  static const auto f32 =
      c10::Dispatcher::singleton().findSchemaOrThrow("vllm_lite::moe_cpu_experts", "").typed<Fn>();
  static const auto b16 =
      c10::Dispatcher::singleton().findSchemaOrThrow("vllm_lite::moe_cpu_experts_bf16", "").typed<Fn>();
  return (bf16 ? b16 : f32).call(x, w13, w2, weights, ids, inter);
}

// SparseMoeBlock.forward on the CPU kernel experts (fused_moe.py): the router and route() in one moe_cpu_route
// call (csrc/moe_cpu.cpp), then KernelExperts / Bf16KernelExperts' call.
at::Tensor stack_moe(const CpuDecoderWeights& w, int64_t l, const at::Tensor& x) {
  static const auto route =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("vllm_lite::moe_cpu_route", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t, bool, bool)>();
  auto [weights, ids] =
      route.call(x, w.get(l, kRouter), w.iv(l, kTopK), w.iv(l, kRenormalize) != 0, w.iv(l, kRoundWeights) != 0);
  return moe_experts_op(w.iv(l, kMlpKind) == kMoeBf16, x, w.get(l, kW13), w.get(l, kW2), weights, ids,
                        w.iv(l, kMoeInter));
}

template <typename P>
int64_t max_position(const at::Tensor& positions) {
  const P* p = positions.data_ptr<P>();
  const int64_t n = positions.size(0), s = positions.stride(0);
  int64_t lo = 0, hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    lo = std::min<int64_t>(lo, p[i * s]);
    hi = std::max<int64_t>(hi, p[i * s]);
  }
  return lo < 0 ? -1 : hi;
}

std::tuple<at::Tensor, at::Tensor> cpu_decoder_layers(
    const c10::intrusive_ptr<CpuDecoderWeights>& weights, const at::Tensor& hidden_in,
    const c10::optional<at::Tensor>& residual_in, const at::Tensor& positions, at::TensorList kv_caches,
    const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
    const at::Tensor& slots, c10::string_view impl, const c10::optional<at::Tensor>& keep, int64_t small_m_max,
    int64_t vnni_max, at::OptionalIntArrayRef plans) {
  const CpuDecoderWeights& w = *weights;
  const int64_t nl = w.num_layers;
  TORCH_CHECK_VALUE(!plans.has_value() || static_cast<int64_t>(plans->size()) == 4 * nl,
                    msg("cpu_decoder_layers: plans must hold 4 entries a layer (", 4 * nl, "), got ",
                        plans.has_value() ? static_cast<int64_t>(plans->size()) : 0));
  auto plan = [&](int64_t l, int64_t which) -> int64_t { return plans.has_value() ? (*plans)[l * 4 + which] : 0; };
  check_cpu(hidden_in, "hidden");
  check_dim(hidden_in, 2, "hidden");
  check_contiguous(hidden_in, "hidden");
  const auto dt = w.get(0, kInNorm).scalar_type();
  check_dtype(hidden_in, dt, "hidden");
  const int64_t t = hidden_in.size(0), hidden = hidden_in.size(1);
  TORCH_CHECK_VALUE(hidden == w.get(0, kInNorm).size(0),
                    msg("cpu_decoder_layers: hidden must be [T, ", w.get(0, kInNorm).size(0), "], got ",
                        hidden_in.sizes()));
  TORCH_CHECK_VALUE(static_cast<int64_t>(kv_caches.size()) == nl,
                    msg("cpu_decoder_layers: ", nl, " layers but ", static_cast<int64_t>(kv_caches.size()),
                        " KV caches"));
  if (residual_in.has_value()) {
    check_dtype(*residual_in, dt, "residual");
    check_contiguous(*residual_in, "residual");
    TORCH_CHECK_VALUE(residual_in->sizes() == hidden_in.sizes(), "cpu_decoder_layers: residual must be hidden's shape");
  }
  check_cpu(positions, "positions");
  check_dim(positions, 1, "positions");
  TORCH_CHECK_TYPE(positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt,
                   msg("positions must be int64 or int32, got ", positions.scalar_type()));
  TORCH_CHECK_VALUE(positions.size(0) == t, msg("cpu_decoder_layers: ", t, " rows but ", positions.size(0),
                                                " positions"));
  check_dtype(slots, at::kLong, "slots");
  TORCH_CHECK_VALUE(slots.dim() == 1 && slots.size(0) >= t && slots.is_contiguous(),
                    msg("cpu_decoder_layers: slots must be int64 [>= ", t, "] contiguous"));
  if (keep.has_value()) {
    check_dtype(*keep, at::kLong, "keep");
    check_dim(*keep, 1, "keep");
  }
  if (t == 0) {
    return {hidden_in, residual_in.has_value() ? *residual_in : hidden_in};
  }
  const int64_t top = positions.scalar_type() == at::kLong ? max_position<int64_t>(positions)
                                                           : max_position<int32_t>(positions);
  for (int64_t l = 0; l < nl; ++l) {
    TORCH_CHECK_INDEX(top >= 0 && top < w.get(l, kCosSin).size(0),
                      msg("cpu_decoder_layers: a position is outside the cos/sin table of ", w.get(l, kCosSin).size(0),
                          " rows"));
    const at::Tensor& kv = kv_caches[l];
    check_cpu(kv, "kv_cache");
    TORCH_CHECK_VALUE(kv.dim() == 5 && kv.size(3) == w.iv(l, kNumKvHeads) && kv.size(4) == w.iv(l, kHeadDim),
                      msg("cpu_decoder_layers: layer ", l, "'s kv_cache has shape ", kv.sizes()));
  }
  const at::Tensor slot_rows = slots.narrow(0, 0, t);
  at::Tensor x = hidden_in;
  at::Tensor res;
  bool have_res = residual_in.has_value();
  if (have_res) res = *residual_in;
  // Each linear's threads prefetch the start of their first block of the next linear's weight (the stack knows the
  // order: qkv, o, gate_up, down, the next layer's qkv) while they work on their last block: set_vnni_next_weight.
  const VnniNextGuard next_guard;
  const bool bf16_rows = hidden_in.scalar_type() == at::kBFloat16;
  const auto next_w = [&](int64_t layer, int64_t which) {
    return stack_vnni_weight(w, layer, which, t, bf16_rows, small_m_max, vnni_max);
  };
  for (int64_t l = 0; l < nl; ++l) {
    const int64_t h = w.iv(l, kNumHeads), kvh = w.iv(l, kNumKvHeads), d = w.iv(l, kHeadDim);
    const bool dense = w.iv(l, kMlpKind) == kDenseMlp;
    // input_layernorm (adds the carried residual)
    at::Tensor hn;
    if (!have_res) {
      res = x;
      hn = stack_norm(x, nullptr, w.get(l, kInNorm), w.fv(l, kEpsIn), nullptr);
      have_res = true;
    } else {
      at::Tensor new_res = at::empty(x.sizes(), x.options());
      hn = stack_norm(x, &res, w.get(l, kInNorm), w.fv(l, kEpsIn), &new_res);
      res = new_res;
    }
    // attention: qkv, (q/k norm), rotary in place, K/V write, paged attention
    set_vnni_next_weight(next_w(l, kO));
    at::Tensor qkv = stack_linear(w, l, kQkv, hn, small_m_max, vnni_max, plan(l, kQkv));
    at::Tensor q = qkv.narrow(1, 0, h * d);
    at::Tensor k = qkv.narrow(1, h * d, kvh * d);
    at::Tensor v = qkv.narrow(1, (h + kvh) * d, kvh * d);
    if (CpuDecoderWeights::has(w.get(l, kQNorm))) {
      q = stack_norm(q.view({t, h, d}), nullptr, w.get(l, kQNorm), w.fv(l, kEpsQk), nullptr).view({t, h * d});
      k = stack_norm(k.view({t, kvh, d}), nullptr, w.get(l, kKNorm), w.fv(l, kEpsQk), nullptr).view({t, kvh * d});
    }
    at::Tensor kv = kv_caches[l];
    if (check_kv_write(k, v, kv, slot_rows.data_ptr<int64_t>(), t)) {
      rotary_dispatch(positions, q, k, w.get(l, kCosSin).data_ptr<float>(), d, w.iv(l, kRotaryDim), &v, &kv,
                      slot_rows.data_ptr<int64_t>());
    } else {
      rotary_dispatch(positions, q, k, w.get(l, kCosSin).data_ptr<float>(), d, w.iv(l, kRotaryDim));
      at::Tensor k3 = k.view({t, kvh, d}), v3 = v.view({t, kvh, d});
      if (k3.scalar_type() != kv.scalar_type()) {
        k3 = k3.to(kv.scalar_type());
        v3 = v3.to(kv.scalar_type());
      }
      write_kv(k3, v3, kv, slot_rows);
    }
    at::Tensor attn = at::empty({t, h, d}, q.options());
    paged_attention(attn, q.view({t, h, d}), kv, block_table, seq_lens, query_start_loc, w.fv(l, kScale),
                    w.iv(l, kSlidingWindow), w.fv(l, kSoftCap), impl);
    at::Tensor a2 = attn.view({t, h * d});
    if (l == nl - 1 && keep.has_value()) {  // past the last attention only the kept rows go on
      a2 = a2.index_select(0, *keep);
      res = res.index_select(0, *keep);
      if (keep->numel() == 0) return {at::empty({0, hidden}, x.options()), res};
    }
    set_vnni_next_weight(dense ? next_w(l, kGateUp) : nullptr);
    at::Tensor o = stack_linear(w, l, kO, a2, small_m_max, vnni_max, plan(l, kO));
    // post_attention_layernorm (adds the residual), gate_up, SiLU-and-mul, down
    at::Tensor new_res = at::empty(o.sizes(), o.options());
    at::Tensor hn2 = stack_norm(o, &res, w.get(l, kPostNorm), w.fv(l, kEpsPost), &new_res);
    res = new_res;
    if (w.iv(l, kMlpKind) != kDenseMlp) {
      x = stack_moe(w, l, hn2);
      continue;
    }
    set_vnni_next_weight(next_w(l, kDown));
    at::Tensor act = stack_mlp_act(w, l, hn2, small_m_max, vnni_max, plan(l, kGateUp));
    set_vnni_next_weight(l + 1 < nl ? next_w(l + 1, kQkv) : nullptr);
    x = stack_linear(w, l, kDown, act, small_m_max, vnni_max, plan(l, kDown));
  }
  return {x, res};
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
  m.class_<vllm_lite::CpuDecoderWeights>("CpuDecoderWeights")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<double>>())
      .def("num_layers", [](const c10::intrusive_ptr<vllm_lite::CpuDecoderWeights>& self) { return self->num_layers; });
  m.def(
      "cpu_decoder_layers(__torch__.torch.classes.vllm_lite.CpuDecoderWeights weights, Tensor hidden, "
      "Tensor? residual, Tensor positions, Tensor(a!)[] kv_caches, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, Tensor slots, str impl, Tensor? keep, int small_m_max, int vnni_max, "
      "int[]? plans=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vllm_lite, CPU, m) {
  m.impl("fused_rms_norm", &vllm_lite::fused_rms_norm);
  m.impl("fused_rotary_embedding", &vllm_lite::fused_rotary_embedding);
  m.impl("fused_silu_and_mul", &vllm_lite::fused_silu_and_mul);
  m.impl("cpu_decoder_layers", &vllm_lite::cpu_decoder_layers);
}
