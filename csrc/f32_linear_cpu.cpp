// float32 linear on the CPU with MKL sgemm's own summation order, so its result equals F.linear's bit for bit
// where that order is the one MKL uses here (vllm_lite/worker/models/cpu_linear.py checks each case once):
//   f32_linear_kblocked(x [M, K], w [N, K], kc) -> out [M, N] = x @ w^T
// Each output is the sum over K in blocks of kc: within a block, one FMA chain in k order from zero; the blocks'
// partial sums then added in order (((P0 + P1) + P2) ...). MKL's sgemm on Zen 4 (torch 2.13's MKL 2024) does
// exactly this at 8+ rows with kc = K up to 192, K / 2 up to 383, else 192 (measured per K; the Python side
// searches candidates and keeps F.linear where none matches).
//
// Why: MKL ran the decode shapes of small models at 35-95 GFLOP/s on 2 Zen 4 cores ([64, 256] x [256, 384]:
// 178 us; the LM head [64, 256] x [256, 8000]: 2.8-3.5 ms); this kernel vectorises over the rows (x transposed
// into a [K, rows] tile, each weight element broadcast), so it reads the weight in its own [N, K] layout (no
// second copy) and keeps up to 24 accumulators of 16 rows in registers.
//
// Compile-time dispatch: AVX-512 (16 lanes, tiles of 4 vectors x 6 columns) or AVX2 + FMA (8 lanes, 2 x 5); other
// builds have no kernel (f32_linear_kblocked_available() false). Every check runs before any data access.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define VLLM_LITE_F32_KBLOCKED 1
#endif

#include "cpu_common.h"

namespace vllm_lite {
namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
constexpr int kMT = 4;  // row vectors per tile (64 rows)
constexpr int kNT = 6;  // columns per tile: 24 accumulators
typedef __m512 vreg;
inline vreg vzero() { return _mm512_setzero_ps(); }
inline vreg vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vreg v) { _mm512_storeu_ps(p, v); }
inline vreg vbcast(const float* p) { return _mm512_set1_ps(*p); }
inline vreg vfma(vreg a, vreg b, vreg c) { return _mm512_fmadd_ps(a, b, c); }
inline vreg vadd(vreg a, vreg b) { return _mm512_add_ps(a, b); }
#elif defined(VLLM_LITE_F32_KBLOCKED)
constexpr int64_t kLanes = 8;
constexpr int kMT = 2;
constexpr int kNT = 5;  // 10 accumulators, 2 row vectors, 1 broadcast of AVX2's 16 registers
typedef __m256 vreg;
inline vreg vzero() { return _mm256_setzero_ps(); }
inline vreg vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vreg v) { _mm256_storeu_ps(p, v); }
inline vreg vbcast(const float* p) { return _mm256_broadcast_ss(p); }
inline vreg vfma(vreg a, vreg b, vreg c) { return _mm256_fmadd_ps(a, b, c); }
inline vreg vadd(vreg a, vreg b) { return _mm256_add_ps(a, b); }
#endif

#if defined(VLLM_LITE_F32_KBLOCKED)
constexpr int64_t kTileRows = kMT * kLanes;

// acc[j][i] (column n0 + j, rows i*L..) over k in [k0, k1) from zero, then added into part (first block: stored).
// xt: this row tile transposed, [K][kTileRows]; w: rows n0.. of the weight, ldw = K.
template <int MT, int NT>
inline void tile_block(const float* xt, const float* w, int64_t ldw, int64_t k0, int64_t k1, float* part,
                       bool first) {
  vreg acc[NT][MT];
#pragma GCC unroll 8
  for (int j = 0; j < NT; ++j)
#pragma GCC unroll 4
    for (int i = 0; i < MT; ++i) acc[j][i] = vzero();
  for (int64_t k = k0; k < k1; ++k) {
    vreg xv[MT];
    const float* xk = xt + k * kTileRows;
#pragma GCC unroll 4
    for (int i = 0; i < MT; ++i) xv[i] = vload(xk + i * kLanes);
#pragma GCC unroll 8
    for (int j = 0; j < NT; ++j) {
      const vreg b = vbcast(w + j * ldw + k);
#pragma GCC unroll 4
      for (int i = 0; i < MT; ++i) acc[j][i] = vfma(xv[i], b, acc[j][i]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NT; ++j)
#pragma GCC unroll 4
    for (int i = 0; i < MT; ++i) {
      float* p = part + (j * kMT + i) * kLanes;
      vstore(p, first ? acc[j][i] : vadd(vload(p), acc[j][i]));
    }
}

template <int MT, int NT>
void tile(const float* xt, const float* w, int64_t k, int64_t kc, float* part) {
  bool first = true;
  for (int64_t k0 = 0; k0 < k; k0 += kc, first = false)
    tile_block<MT, NT>(xt, w, k, k0, std::min(k, k0 + kc), part, first);
}

template <int MT>
void tile_cols(const float* xt, const float* w, int64_t k, int64_t kc, float* part, int nt) {
  switch (nt) {
    case 6: if constexpr (kNT >= 6) { tile<MT, 6>(xt, w, k, kc, part); return; } break;
    case 5: tile<MT, 5>(xt, w, k, kc, part); return;
    case 4: tile<MT, 4>(xt, w, k, kc, part); return;
    case 3: tile<MT, 3>(xt, w, k, kc, part); return;
    case 2: tile<MT, 2>(xt, w, k, kc, part); return;
    default: tile<MT, 1>(xt, w, k, kc, part); return;
  }
}

void run_tile(const float* xt, const float* w, int64_t k, int64_t kc, float* part, int mt, int nt) {
  switch (mt) {
    case 4: if constexpr (kMT >= 4) { tile_cols<4>(xt, w, k, kc, part, nt); return; } break;
    case 3: if constexpr (kMT >= 3) { tile_cols<3>(xt, w, k, kc, part, nt); return; } break;
    case 2: tile_cols<2>(xt, w, k, kc, part, nt); return;
    default: tile_cols<1>(xt, w, k, kc, part, nt); return;
  }
  tile_cols<1>(xt, w, k, kc, part, nt);
}
#endif

bool f32_linear_kblocked_available() {
#if defined(VLLM_LITE_F32_KBLOCKED)
  return true;
#else
  return false;
#endif
}

at::Tensor f32_linear_kblocked(const at::Tensor& x, const at::Tensor& w, int64_t kc) {
  TORCH_CHECK(f32_linear_kblocked_available(), "f32_linear_kblocked: not built for this CPU (needs AVX-512 or AVX2+FMA)");
  check_cpu(x, "x");
  check_cpu(w, "w");
  check_dim(x, 2, "x");
  check_dim(w, 2, "w");
  check_dtype(x, at::kFloat, "x");
  check_dtype(w, at::kFloat, "w");
  check_contiguous(w, "w");
  TORCH_CHECK_VALUE(x.stride(1) == 1 || x.size(1) <= 1,
                    msg("f32_linear_kblocked: x's rows must be contiguous (got strides ", x.strides(), ")"));
  TORCH_CHECK_VALUE(x.size(1) == w.size(1),
                    msg("f32_linear_kblocked: x ", x.sizes(), " and w ", w.sizes(), " disagree on K"));
  TORCH_CHECK_VALUE(kc > 0, msg("f32_linear_kblocked: kc must be positive, got ", kc));
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
#if defined(VLLM_LITE_F32_KBLOCKED)
  if (m == 0 || n == 0) return out;
  if (k == 0) {
    out.zero_();
    return out;
  }
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Rows in chunks whose transposed tiles stay in L2 (~256 KB) while a thread sweeps its columns over them.
  const int64_t n_mtiles = (m + kTileRows - 1) / kTileRows;
  const int64_t chunk_tiles = std::max<int64_t>(1, (65536 / k) / kTileRows);
  // x transposed per row tile: [tile][K][kTileRows], rows past M zero.
  std::unique_ptr<float[]> xt_buf(new float[static_cast<size_t>(n_mtiles * k * kTileRows)]);
  float* const xt = xt_buf.get();
  const int64_t n_groups = (n + kNT - 1) / kNT;
  const int64_t macs = m * n * k;
  const int num_threads = macs < (1 << 17) ? 1
                          : static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_groups)));
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp for schedule(static)
    for (int64_t tt = 0; tt < n_mtiles; ++tt) {
      float* dst = xt + tt * k * kTileRows;
      const int64_t r0 = tt * kTileRows, rows = std::min<int64_t>(kTileRows, m - r0);
      for (int64_t kk = 0; kk < k; ++kk) {
        float* d = dst + kk * kTileRows;
        for (int64_t r = 0; r < rows; ++r) d[r] = xp[(r0 + r) * ldx + kk];
        for (int64_t r = rows; r < kTileRows; ++r) d[r] = 0.0f;
      }
    }
    // implicit barrier of the omp for
    // This thread's contiguous run of column groups: it streams one stretch of the weight.
    const int64_t g0 = n_groups * tid / nt, g1 = n_groups * (tid + 1) / nt;
    alignas(64) float part[kNT * kMT * kLanes];
    for (int64_t c0 = 0; c0 < n_mtiles; c0 += chunk_tiles) {
      const int64_t c1 = std::min(n_mtiles, c0 + chunk_tiles);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t col0 = g * kNT;
        const int ncols = static_cast<int>(std::min<int64_t>(kNT, n - col0));
        for (int64_t tt = c0; tt < c1; ++tt) {
          const int64_t r0 = tt * kTileRows, rows = std::min<int64_t>(kTileRows, m - r0);
          const int mt = static_cast<int>((rows + kLanes - 1) / kLanes);
          run_tile(xt + tt * k * kTileRows, wp + col0 * k, k, kc, part, mt, ncols);
          // part[j][i*L + l] is row r0 + i*L + l of column col0 + j.
          for (int64_t r = 0; r < rows; ++r) {
            float* o = op + (r0 + r) * n + col0;
            const int64_t i = r / kLanes, l = r % kLanes;
            for (int j = 0; j < ncols; ++j) o[j] = part[(j * kMT + i) * kLanes + l];
          }
        }
      }
    }
  }
#else
  (void)kc;
  (void)m;
  (void)k;
  (void)n;
#endif
  return out;
}

}  // namespace
}  // namespace vllm_lite

TORCH_LIBRARY_FRAGMENT(vllm_lite, m) {
  m.def("f32_linear_kblocked_available() -> bool", &vllm_lite::f32_linear_kblocked_available);
  m.def("f32_linear_kblocked(Tensor x, Tensor w, int kc) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_lite, CPU, m) { m.impl("f32_linear_kblocked", &vllm_lite::f32_linear_kblocked); }
