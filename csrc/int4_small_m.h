// Direct int4 matmul for a few activation rows (batch-1 decode): y[m, n] = sum_k x[m, k] (q[n, k] - z) s.
//
// At small m a linear layer is memory-bound: dequantizing the whole [N, K] weight into a float buffer and
// handing it to F.linear reads 0.5 byte a weight, writes 4 and reads those 4 back, where a float32 matvec
// reads 4. This kernel reads the packed nibbles once and never materialises the weight: each output column's
// row of words is unpacked in registers and multiplied into every activation row while it sits in L1.
//
// Layout (int4_cpu.cpp's CPU layout): qweight [N, K/8] int32 with nibble j of word c = input k = 8c + j,
// zeros [N, G] uint8, scales [N, G], plain groups of K/G inputs (act-order g_idx layers dequantize instead).
// Each weight is formed in registers as float(q - z) * s, the value dequantization stores in float32 (one
// row: the group's sum of x (q - z), exact integers times x, is scaled once), so only the summation order
// differs from dequantize + F.linear: close, not bit-identical (tests/test_int4_cpu_kernel.py bounds it).
//
// The AVX2 + FMA path (also what AVX-512 hosts run) loads 8 words (64 inputs) as one vector; shifting it
// right by 4t and masking gives, in lane l, input 8l + t, so x is pre-transposed per 64-input block
// (permute_x) to match. Without AVX2 a portable loop computes the same sums in natural order.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VLLM_LITE_INT4_AVX2 1
#endif

namespace vllm_lite {
namespace int4 {

// Rows of x a column's unpacked weights are multiplied into per pass (accumulators stay in registers).
constexpr int kTileRows = 8;

// One column (output n) for `rows` (<= kTileRows) rows of x; x row r at x + r * x_stride.
struct Column {
  const int32_t* q;   // [K/8] words of this column
  const uint8_t* z;   // [G]
  int64_t k;          // inputs
  int64_t wpg;        // words per group (K / G / 8)
};

// Portable: natural x order, the same products; the compiler vectorises the inner loop.
template <typename S>
inline void column_portable(const Column& c, const S* s, const float* x, int64_t x_stride, int rows, float* y) {
  const int64_t words = c.k / 8, groups = words / c.wpg;
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    float acc = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      const int32_t z = c.z[g];
      const float sg = static_cast<float>(s[g]);
      for (int64_t w = g * c.wpg; w < (g + 1) * c.wpg; ++w) {
        const uint32_t word = static_cast<uint32_t>(c.q[w]);
        for (int j = 0; j < 8; ++j)
          acc += xr[8 * w + j] * (static_cast<float>(static_cast<int32_t>((word >> (4 * j)) & 0xFu) - z) * sg);
      }
    }
    y[r] = acc;
  }
}

#ifdef VLLM_LITE_INT4_AVX2

// x rows -> per 64-input block, element 8t + l holds input 8l + t (the lane order of shifted words);
// inputs past the last whole block keep their order. Converts bfloat16 to float32 on the way.
template <typename X>
inline void permute_x(const X* x, int64_t rows, int64_t k, float* xp) {
  const int64_t full = (k / 64) * 64;
  for (int64_t r = 0; r < rows; ++r) {
    const X* xr = x + r * k;
    float* pr = xp + r * k;
    for (int64_t b = 0; b < full; b += 64)
      for (int l = 0; l < 8; ++l)
        for (int t = 0; t < 8; ++t) pr[b + 8 * t + l] = static_cast<float>(xr[b + 8 * l + t]);
    for (int64_t i = full; i < k; ++i) pr[i] = static_cast<float>(xr[i]);
  }
}

inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// Independent FMA chains per row: enough of them in flight to cover the FMA latency at one or two rows.
template <int M>
struct Chains {
  static constexpr int C = M >= 4 ? 1 : 4 / M;
};

// acc[r][t % C] += (nibble t of each of the block's 8 words - z) * s * xp[r][8t .. 8t + 8), t = 0..7.
// (q - z) * s is the dequantized weight exactly as the reference rounds it to float32 (one product), so
// only the summation order differs from F.linear over the dequantized weight. kScaled=false leaves out s
// (the caller scales the group's sum).
template <int M, bool kScaled = true>
inline void block_fma(__m256i v, __m256i z, __m256 s, const float* xb, int64_t x_stride,
                      __m256 (&acc)[M][Chains<M>::C]) {
  constexpr int C = Chains<M>::C;
  const __m256i mask = _mm256_set1_epi32(0xF);
#define VLLM_LITE_INT4_STEP(t)                                                                     \
  {                                                                                                \
    const __m256i qi = _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 4 * (t)), mask), z); \
    const __m256 w = kScaled ? _mm256_mul_ps(_mm256_cvtepi32_ps(qi), s) : _mm256_cvtepi32_ps(qi); \
    for (int r = 0; r < M; ++r)                                                                    \
      acc[r][(t) % C] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xb + r * x_stride + 8 * (t)), acc[r][(t) % C]); \
  }
  VLLM_LITE_INT4_STEP(0)
  VLLM_LITE_INT4_STEP(1)
  VLLM_LITE_INT4_STEP(2)
  VLLM_LITE_INT4_STEP(3)
  VLLM_LITE_INT4_STEP(4)
  VLLM_LITE_INT4_STEP(5)
  VLLM_LITE_INT4_STEP(6)
  VLLM_LITE_INT4_STEP(7)
#undef VLLM_LITE_INT4_STEP
}

// One column for M rows of permuted x (permute_x). Groups of whole blocks (group size a multiple of 64)
// broadcast one zero and scale per group; other group sizes build per-lane zeros and scales per block;
// words past the last whole block (K not a multiple of 64) are summed scalar.
template <int M, typename S>
inline void column_avx2(const Column& c, const S* s, const float* xp, int64_t x_stride, float* y) {
  constexpr int C = Chains<M>::C;
  const int64_t words = c.k / 8, blocks = words / 8;
  __m256 acc[M][C];
  for (int r = 0; r < M; ++r)
    for (int i = 0; i < C; ++i) acc[r][i] = _mm256_setzero_ps();
  if (c.wpg % 8 == 0) {
    const int64_t bpg = c.wpg / 8, groups = words / c.wpg;
    for (int64_t g = 0; g < groups; ++g) {
      const __m256i z = _mm256_set1_epi32(c.z[g]);
      const __m256 sg = _mm256_set1_ps(static_cast<float>(s[g]));
      if constexpr (M == 1) {
        // One row: sum x (q - z) over the group, then scale once; a multiply less per 8 weights is
        // 25-30% faster here (more rows amortise the multiply over their FMAs).
        __m256 dot[M][C];
        for (int i = 0; i < C; ++i) dot[0][i] = _mm256_setzero_ps();
        for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.q + 8 * b));
          block_fma<M, false>(v, z, sg, xp + 64 * b, x_stride, dot);
        }
        for (int i = 0; i < C; ++i) acc[0][i] = _mm256_fmadd_ps(dot[0][i], sg, acc[0][i]);
      } else {
        for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.q + 8 * b));
          block_fma<M>(v, z, sg, xp + 64 * b, x_stride, acc);
        }
      }
    }
  } else {
    alignas(32) int32_t zl[8];
    alignas(32) float sl[8];
    for (int64_t b = 0; b < blocks; ++b) {
      for (int l = 0; l < 8; ++l) {
        const int64_t g = (8 * b + l) / c.wpg;
        zl[l] = c.z[g];
        sl[l] = static_cast<float>(s[g]);
      }
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.q + 8 * b));
      block_fma<M>(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(zl)), _mm256_load_ps(sl), xp + 64 * b,
                   x_stride, acc);
    }
  }
  for (int r = 0; r < M; ++r) {
    __m256 a = acc[r][0];
    for (int i = 1; i < C; ++i) a = _mm256_add_ps(a, acc[r][i]);
    y[r] = hsum8(a);
  }
  for (int64_t w = blocks * 8; w < words; ++w) {  // only when K is not a multiple of 64
    const int64_t g = w / c.wpg;
    const int32_t z = c.z[g];
    const float sg = static_cast<float>(s[g]);
    const uint32_t word = static_cast<uint32_t>(c.q[w]);
    for (int r = 0; r < M; ++r)
      for (int j = 0; j < 8; ++j)
        y[r] += xp[r * x_stride + 8 * w + j] * (static_cast<float>(static_cast<int32_t>((word >> (4 * j)) & 0xFu) - z) * sg);
  }
}

template <typename S>
inline void column_tile(const Column& c, const S* s, const float* xp, int64_t x_stride, int rows, float* y) {
  switch (rows) {
    case 1:
      return column_avx2<1, S>(c, s, xp, x_stride, y);
    case 2:
      return column_avx2<2, S>(c, s, xp, x_stride, y);
    case 3:
      return column_avx2<3, S>(c, s, xp, x_stride, y);
    case 4:
      return column_avx2<4, S>(c, s, xp, x_stride, y);
    case 5:
      return column_avx2<5, S>(c, s, xp, x_stride, y);
    case 6:
      return column_avx2<6, S>(c, s, xp, x_stride, y);
    case 7:
      return column_avx2<7, S>(c, s, xp, x_stride, y);
    default:
      return column_avx2<8, S>(c, s, xp, x_stride, y);
  }
}

#else  // portable build

template <typename X>
inline void permute_x(const X* x, int64_t rows, int64_t k, float* xp) {
  for (int64_t i = 0; i < rows * k; ++i) xp[i] = static_cast<float>(x[i]);
}

template <typename S>
inline void column_tile(const Column& c, const S* s, const float* xp, int64_t x_stride, int rows, float* y) {
  column_portable<S>(c, s, xp, x_stride, rows, y);
}

#endif

// out[m, n] = x[m, k] W^T (+ bias): xp is x as permute_x leaves it (float32, [m, k]); columns split over
// torch's intra-op threads, each column's words read once per tile of kTileRows rows (from L1 after the first).
template <typename S, typename O>
void small_m_matmul(const float* xp, const int32_t* qw, const uint8_t* zeros, const S* scales, const float* bias,
                    O* out, int64_t m, int64_t n, int64_t k, int64_t groups) {
  const int64_t wpg = k / groups / 8;
  // About 64 KiB of packed weights per task at the least, so small layers do not pay for many wake-ups.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(k, 1));
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    float y[kTileRows];
    for (int64_t col = n0; col < n1; ++col) {
      const Column c{qw + col * (k / 8), zeros + col * groups, k, wpg};
      const S* s = scales + col * groups;
      const float b = bias == nullptr ? 0.0f : bias[col];
      for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - r0));
        column_tile<S>(c, s, xp + r0 * k, k, rows, y);
        for (int r = 0; r < rows; ++r) out[(r0 + r) * n + col] = static_cast<O>(y[r] + b);
      }
    }
  });
}

}  // namespace int4
}  // namespace vllm_lite
