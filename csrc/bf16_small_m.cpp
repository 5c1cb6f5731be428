// bfloat16 linear for the few-row forwards of decode on CPUs with AVX512-BF16 (Zen 4, Sapphire Rapids):
//   bf16_linear_small_m(x [M, K], weight_blocked, n, bias [N]?) -> y [M, N], bfloat16, M <= kMaxRows.
// The weight is laid out once, at load time (vllm_lite/worker/models/cpu_prepack.py), as
// [N/4, K/32, 4, 32]: for each group of 4 output rows, their 32-wide slices of K one after another, so a
// thread streams its share of the weight front to back.
//
// Why: at M = 1 a decode step only streams the weights. On a 2-core Zen 4 (benchmarks/PROFILE.md, "Zen 4")
// oneDNN's prepacked bf16 GEMV read the bench model's weights at 10-13 GB/s on one core and 15-19 on two;
// this loop reads them at 16 and 21-22 GB/s (the memory system gives ~20 and ~28-37).
// Each output is one float32 dot product (32 lanes summed at the end), plus the bias in float32, rounded once
// to bfloat16: F.linear's math summed in another order, so an output can differ from oneDNN's in the last
// bfloat16 bit. Each output is computed by one thread, so results do not depend on the thread count.
// Groups of rows are split over torch's intra-op threads. Built only where the compiler targets
// AVX512-BF16 (-march=native); elsewhere bf16_small_m_available() is false and callers keep oneDNN.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VLLM_LITE_BF16_SMALL_M 1
#endif

#include "cpu_common.h"

namespace vllm_lite {
namespace {

constexpr int64_t kRowsPerGroup = 4;  // output rows interleaved per group (the 4 in [N/4, K/32, 4, 32])
constexpr int64_t kKChunk = 32;       // bf16 lanes of one 512-bit register
constexpr int64_t kMaxRows = 8;       // x rows accepted (decode batches); callers send more to oneDNN

#ifdef VLLM_LITE_BF16_SMALL_M

static inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// out[m][0..3] = x[m] . w[group rows] (+ bias) for MM rows of x, one group of 4 weight rows.
template <int MM>
static inline void group_dots(const uint16_t* __restrict w, int64_t chunks, const uint16_t* __restrict x, int64_t k,
                              const float* bias, c10::BFloat16* __restrict out, int64_t n) {
  constexpr int R = static_cast<int>(kRowsPerGroup);
  __m512 acc[MM][R];
  for (int m = 0; m < MM; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_si512(w + (c * R + r) * kKChunk);
    for (int m = 0; m < MM; ++m) {
      const __m512i xv = _mm512_loadu_si512(x + m * k + c * kKChunk);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], as_bh(xv), as_bh(wv[r]));
    }
  }
  for (int m = 0; m < MM; ++m)
    for (int r = 0; r < R; ++r) {
      const float b = bias ? bias[r] : 0.0f;
      out[m * n + r] = c10::BFloat16(_mm512_reduce_add_ps(acc[m][r]) + b);
    }
}

void run(const at::Tensor& x, const at::Tensor& wb, int64_t n, const float* bias, at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), chunks = k / kKChunk;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(wb.data_ptr<c10::BFloat16>());
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t group_elems = chunks * kRowsPerGroup * kKChunk;
  at::parallel_for(0, n / kRowsPerGroup, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint16_t* w = wp + g * group_elems;
      const float* b = bias ? bias + g * kRowsPerGroup : nullptr;
      for (int64_t m0 = 0; m0 < rows; m0 += 4) {
        const uint16_t* xm = xp + m0 * k;
        c10::BFloat16* o = op + m0 * n + g * kRowsPerGroup;
        switch (std::min<int64_t>(4, rows - m0)) {
          case 1: group_dots<1>(w, chunks, xm, k, b, o, n); break;
          case 2: group_dots<2>(w, chunks, xm, k, b, o, n); break;
          case 3: group_dots<3>(w, chunks, xm, k, b, o, n); break;
          default: group_dots<4>(w, chunks, xm, k, b, o, n); break;
        }
      }
    }
  });
}

#endif  // VLLM_LITE_BF16_SMALL_M

bool bf16_small_m_available() {
#ifdef VLLM_LITE_BF16_SMALL_M
  return true;
#else
  return false;
#endif
}

int64_t bf16_small_m_max_rows() { return kMaxRows; }

at::Tensor bf16_linear_small_m(const at::Tensor& x, const at::Tensor& weight_blocked, int64_t n,
                               const c10::optional<at::Tensor>& bias) {
  // Every check runs before any data is read and before the parallel loop (whose body cannot throw).
  TORCH_CHECK(bf16_small_m_available(), "bf16_linear_small_m: not built for this CPU (needs AVX512-BF16)");
  check_cpu(x, "x");
  check_cpu(weight_blocked, "weight_blocked");
  check_dtype(x, at::kBFloat16, "x");
  check_dtype(weight_blocked, at::kBFloat16, "weight_blocked");
  check_dim(x, 2, "x");
  check_dim(weight_blocked, 4, "weight_blocked");
  check_contiguous(weight_blocked, "weight_blocked");
  const int64_t k = x.size(1);
  TORCH_CHECK_VALUE(n > 0 && n % kRowsPerGroup == 0 && k > 0 && k % kKChunk == 0,
                    msg("bf16_linear_small_m: needs N a positive multiple of ", kRowsPerGroup, " and K of ", kKChunk,
                        ", got N = ", n, ", K = ", k));
  TORCH_CHECK_VALUE(weight_blocked.size(0) == n / kRowsPerGroup && weight_blocked.size(1) == k / kKChunk &&
                        weight_blocked.size(2) == kRowsPerGroup && weight_blocked.size(3) == kKChunk,
                    msg("bf16_linear_small_m: weight_blocked must be [", n / kRowsPerGroup, ", ", k / kKChunk, ", ",
                        kRowsPerGroup, ", ", kKChunk, "], got ", weight_blocked.sizes()));
  TORCH_CHECK_VALUE(x.size(0) <= kMaxRows,
                    msg("bf16_linear_small_m: at most ", kMaxRows, " rows of x, got ", x.size(0)));
  at::Tensor bias_f;
  if (bias.has_value()) {
    check_cpu(*bias, "bias");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n,
                      msg("bf16_linear_small_m: bias must be [", n, "], got ", bias->sizes()));
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({xc.size(0), n}, xc.options());
  if (xc.size(0) == 0) return out;
#ifdef VLLM_LITE_BF16_SMALL_M
  run(xc, weight_blocked, n, bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, out);
#endif
  return out;
}

}  // namespace
}  // namespace vllm_lite

TORCH_LIBRARY_FRAGMENT(vllm_lite, m) {
  // No tensor arguments, so no dispatch key: defined with their kernels (catch-all).
  m.def("bf16_small_m_available() -> bool", &vllm_lite::bf16_small_m_available);
  m.def("bf16_small_m_max_rows() -> int", &vllm_lite::bf16_small_m_max_rows);
  m.def("bf16_linear_small_m(Tensor x, Tensor weight_blocked, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_lite, CPU, m) { m.impl("bf16_linear_small_m", &vllm_lite::bf16_linear_small_m); }
