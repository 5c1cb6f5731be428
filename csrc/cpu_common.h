// Small helpers shared by the CPU kernels: dtype conversion, a vectorisable exp, error messages, input checks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>

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

// exp(x) / 2^n for n = round(x / ln2): x - n ln2 (in two parts, exact enough) into a degree-6 polynomial
// (Cephes coefficients). T is float or a GCC float vector (encoder_attn_cpu.cpp's exp_v), so both share it.
template <class T>
inline T exp_reduced(T x, T n) {
  T r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  T p = T{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) by range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial (Cephes coefficients).
// Branch-free so the compiler vectorises the softmax loops; relative error ~2 ulp for x in [-87, 88].
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float p = exp_reduced(x, n);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Error messages. Every check in these kernels builds its message with msg() and hands TORCH_CHECK* that one
// std::string (or a literal), never the values themselves (tests/test_cpu_kernels.py scans for this). c10::str
// would stream them through a std::ostringstream compiled into this library, and where $CXX links libstdc++
// statically into it (the H100 image's CXX=/opt/gcc/bin/g++, a wrapper of Ubuntu's g++ 13.3: the .so has no
// libstdc++.so.6 NEEDED entry and defines std::locale itself, while torch uses the shared libstdc++) streaming an
// integer or a shape there crashed the process with SIGSEGV instead of raising; strings and dtype names streamed
// fine, and the same sources built with /usr/bin/g++ raised. msg() formats integers with std::to_string and
// shapes by hand, so a bad input raises on every toolchain. Only plain data goes in: strings, integers,
// doubles, dtypes, devices, shapes.
namespace detail {
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, c10::string_view v) { s.append(v.data(), v.size()); }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
inline void append(std::string& s, T v) {
  s += std::to_string(v);
}
inline void append(std::string& s, double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  s += buf;
}
inline void append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, const c10::Device& v) { s += v.str(); }  // formatted inside libc10
inline void append(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
}  // namespace detail

template <typename... Args>
std::string msg(const Args&... args) {
  std::string s;
  (detail::append(s, args), ...);
  return s;
}

// Input checks read only a tensor's metadata (device, dtype, dims, strides), never its data, so they are safe
// to run in any order before a kernel touches memory; callers run them before any data access and before any
// parallel region (an exception leaving an OpenMP region terminates the process).
inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), msg(name, " must be a CPU tensor, got device ", t.device()));
}

inline void check_dtype(const at::Tensor& t, c10::ScalarType want, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == want, msg(name, " must have dtype ", want, ", got ", t.scalar_type()));
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == dim, msg(name, " must have ", dim, " dimensions, got shape ", t.sizes()));
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), msg(name, " must be contiguous (got strides ", t.strides(), ")"));
}

}  // namespace vllm_lite
