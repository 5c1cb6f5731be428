// Small helpers shared by the CPU kernels: dtype conversion, a vectorisable exp, input checks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>

namespace vllm_lite {

inline float to_f32(float x) { return x; }

// bfloat16 -> float32 is a 16-bit shift; written out so loops over it vectorise.
inline float to_f32(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline void store_f32(float v, float* dst) { *dst = v; }
// c10's constructor rounds to nearest-even, the same rounding torch uses for .to(bfloat16).
inline void store_f32(float v, c10::BFloat16* dst) { *dst = c10::BFloat16(v); }

// exp(x) by range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial (Cephes coefficients).
// Branch-free so the compiler vectorises the softmax loops; relative error ~2 ulp for x in [-87, 88].
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
}

inline void check_dtype(const at::Tensor& t, c10::ScalarType want, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == want, name, " must have dtype ", want, ", got ", t.scalar_type());
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must have ", dim, " dimensions, got shape ", t.sizes());
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous (got strides ", t.strides(), ")");
}

}  // namespace vllm_lite
