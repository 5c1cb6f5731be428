// Batched LoRA delta for CPU, every adapter of a step in one call (the CPU counterpart of punica's BGMV):
//   lora_add_cpu(y [T, N], x [T, K], lora_a [S, n_sub * r, K], lora_bt [S, r, N], token_slots [T] int32,
//                out_offsets, out_sizes)
// adds, in place, for every token t with slot s = token_slots[t] >= 0 and every sub-projection i:
//   y[t, off_i : off_i + size_i] += (A[s, i*r : (i+1)*r] @ x[t]) @ Bt[s, :, off_i : off_i + size_i]
// Tokens with slot -1 are not touched. lora_bt is B transposed ([r, N] per slot, sub i's B^T in its own output
// columns), so the expand runs along output columns (vector FMAs, no horizontal sums).
//
// Why (benchmarks/PROFILE.md, "LoRA on CPU"): a decode step of 32 tokens over 8 adapters spent 200-1,000 us a
// projection in the torch path (gathers, two or more bmm's, adds, each its own op and OpenMP region) for
// ~4 MFLOP and ~1 MB of adapter weights. Here the tokens are grouped by slot (a counting sort, before any
// parallel region); then one OpenMP region runs the shrink (work item: one slot's tokens x 8 rows of A; 4 rows
// of A x 4 tokens share each vector load, 2 x 4 on AVX2; x rows read in place, bfloat16 widened as loaded; the
// next rows of A prefetched) and, after its barrier, the expand (work item: one slot's tokens x 1024 output
// columns, 32 at a time, each B row prefetched kPrefetchCols ahead). In a decode step the adapters' weights come
// from DRAM (the base layers' weights pass through the caches between two calls), so these calls are bound by
// how fast A and B stream in: on Zen 4 (2 threads, 32 tokens, 8 adapters, base linears run between calls) a
// decode layer's four bf16 calls took ~410 us with neither prefetch, 256-column items and x copied to float32;
// ~340 with B's prefetch and 1024-column items, ~300 reading x in place (one barrier less), ~280 with A's
// prefetch. End to end, LoRA tok/s 1.04-1.11x (bf16) and 1.06x (float32) the kernel without them. The
// result stays float32 and each y element gets one float32 sum rounded once (bfloat16: nearest even, as
// torch's). Every output element is computed by one work item in a fixed order, so results do not depend on
// the thread count. float32 and bfloat16. The vector code is GCC vector extensions (16 float lanes): one
// AVX-512 register, two AVX2 ones, or scalar code, whatever -march=native targets; no intrinsics, so every
// x86 host builds the same source. Steps larger than KERNEL_MAX_TOKENS stay on torch's bmm's
// (vllm_lite/lora/torch_ops.py), which win there.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"

namespace vllm_lite {
namespace {

constexpr int64_t kLanes = 16;      // float32 lanes of the vector loops (one AVX-512 or two AVX2 registers)
constexpr int64_t kTokBlock = 4;    // tokens of one slot sharing each weight load
constexpr int64_t kShrinkRows = 8;  // A rows per shrink work item
#ifdef __AVX512F__
constexpr int kShrinkJ = 4;  // A rows sharing each x load: 4 x 4 accumulators fit AVX-512's 32 registers
#else
constexpr int kShrinkJ = 2;  // AVX2: 2 x 4 (x 2 halves) of its 16
#endif
constexpr int64_t kCols = 32;          // output columns per expand work item step
constexpr int64_t kExpandCols = 1024;  // output columns per expand work item
// How far ahead (in columns) the expand prefetches each B row: the hardware prefetcher alone left the expand at
// about half of DRAM's streaming rate (r rows of 64 bytes a step, each its own stream). 128 measured as 64/256.
constexpr int64_t kPrefetchCols = 128;
// Below this many multiply-adds a call runs on one thread (waking the pool costs more than it saves).
constexpr int64_t kSerialMacs = 1 << 16;

struct Group {
  int64_t slot, begin, end;  // rows begin..end of the slot-sorted token order
};

struct ExpandItem {
  int64_t group, sub, col, width;
};

// 16 float32 lanes as a GCC vector: one AVX-512 register, two AVX2 ones, or scalar code, as the target allows.
typedef float vf16 __attribute__((vector_size(64)));
typedef uint16_t vu16x16 __attribute__((vector_size(32)));
typedef uint32_t vu32x16 __attribute__((vector_size(64)));

inline vf16 load16(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vf16 load16(const c10::BFloat16* p) {  // bfloat16 -> float32 is a 16-bit shift
  vu16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const vu32x16 w = __builtin_convertvector(h, vu32x16) << 16;
  vf16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

inline float hsum(vf16 v) {
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// out[jb * TB + tb] = A row jb . x row tb, for JB rows of A (stride K) and TB rows of x (xr[tb], float or bf16,
// widened to float32 as loaded): each A vector is loaded once for TB tokens, each x vector once for JB rows.
template <typename T, int JB, int TB>
inline void shrink_dots(const T* __restrict a, const T* const* xr, int64_t k_len, int64_t k_vec, float* out) {
  vf16 acc[JB][TB];
  for (int jb = 0; jb < JB; ++jb)
    for (int tb = 0; tb < TB; ++tb) acc[jb][tb] = vf16{};
  for (int64_t k0 = 0; k0 < k_vec; k0 += kLanes) {
    vf16 av[JB];
    for (int jb = 0; jb < JB; ++jb) av[jb] = load16(a + jb * k_len + k0);
    // The next JB rows of A (this item's next block, or the next item's), one cache line each per line here:
    // A arrives from DRAM in short rows the hardware prefetcher barely catches (a hint: harmless past the end).
    if ((k0 * static_cast<int64_t>(sizeof(T))) % 64 == 0)
      for (int jb = 0; jb < JB; ++jb) __builtin_prefetch(a + (JB + jb) * k_len + k0);
    for (int tb = 0; tb < TB; ++tb) {
      const vf16 xv = load16(xr[tb] + k0);
      for (int jb = 0; jb < JB; ++jb) acc[jb][tb] += av[jb] * xv;
    }
  }
  for (int jb = 0; jb < JB; ++jb)
    for (int tb = 0; tb < TB; ++tb) {
      float s = hsum(acc[jb][tb]);
      for (int64_t k = k_vec; k < k_len; ++k) s += to_f32(a[jb * k_len + k]) * to_f32(xr[tb][k]);
      out[jb * TB + tb] = s;
    }
}

// TB (a run-time 1..kTokBlock) tokens' dots with JB rows of A, written to h (row stride ldh) at column j.
template <typename T, int JB>
inline void shrink_block(const T* a, const T* const* xr, int64_t k_len, int64_t k_vec, int64_t tbn, float* h,
                         int64_t ldh) {
  float out[JB * kTokBlock];
  switch (tbn) {
    case 1: shrink_dots<T, JB, 1>(a, xr, k_len, k_vec, out); break;
    case 2: shrink_dots<T, JB, 2>(a, xr, k_len, k_vec, out); break;
    case 3: shrink_dots<T, JB, 3>(a, xr, k_len, k_vec, out); break;
    default: shrink_dots<T, JB, 4>(a, xr, k_len, k_vec, out); break;
  }
  for (int jb = 0; jb < JB; ++jb)
    for (int64_t tb = 0; tb < tbn; ++tb) h[tb * ldh + jb] = out[jb * tbn + tb];
}

inline void store16(vf16 v, float* p) { std::memcpy(p, &v, sizeof(v)); }
// float32 -> bfloat16 rounded to nearest even, NaN to 0x7FC0: c10::BFloat16's rounding, 16 lanes at a time.
inline void store16(vf16 v, c10::BFloat16* p) {
  vu32x16 u;
  std::memcpy(&u, &v, sizeof(u));
  vu32x16 r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  r = (u & 0x7FFFFFFFu) > 0x7F800000u ? vu32x16{} + 0x7FC0u : r;
  const vu16x16 h = __builtin_convertvector(r, vu16x16);
  std::memcpy(p, &h, sizeof(h));
}

// y rows (TB of them) columns [0, 32) += h[tb] (r values, stride ldh) @ bt (r rows, stride ldb).
template <typename T, int TB, int64_t W>
inline void expand_block(const T* __restrict bt, int64_t ldb, const float* __restrict h, int64_t ldh, int64_t r,
                         T* const* y) {
  static_assert(W == 2 * kLanes, "two vectors of columns");
  vf16 acc[TB][2];
  for (int tb = 0; tb < TB; ++tb) acc[tb][0] = acc[tb][1] = vf16{};
  for (int64_t k = 0; k < r; ++k) {
    const T* b = bt + k * ldb;
    __builtin_prefetch(b + kPrefetchCols);  // a hint: past the row's end it is harmless
    const vf16 b0 = load16(b), b1 = load16(b + kLanes);
    for (int tb = 0; tb < TB; ++tb) {
      const float hk = h[tb * ldh + k];
      acc[tb][0] += hk * b0;
      acc[tb][1] += hk * b1;
    }
  }
  for (int tb = 0; tb < TB; ++tb) {
    T* yr = y[tb];
    store16(load16(yr) + acc[tb][0], yr);
    store16(load16(yr + kLanes) + acc[tb][1], yr + kLanes);
  }
}

// The same for any width w <= kCols (column tails).
template <typename T>
inline void expand_tail(const T* bt, int64_t ldb, const float* h, int64_t ldh, int64_t r, T* const* y, int64_t tbn,
                        int64_t w) {
  for (int64_t tb = 0; tb < tbn; ++tb) {
    float acc[kCols] = {};
    for (int64_t k = 0; k < r; ++k) {
      const float hk = h[tb * ldh + k];
      for (int64_t l = 0; l < w; ++l) acc[l] += hk * to_f32(bt[k * ldb + l]);
    }
    for (int64_t l = 0; l < w; ++l) store_f32(to_f32(y[tb][l]) + acc[l], y[tb] + l);
  }
}

template <typename T>
void run(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_bt,
         const std::vector<int64_t>& order, const std::vector<Group>& groups, const std::vector<int64_t>& offsets,
         const std::vector<int64_t>& sizes) {
  const int64_t n_act = static_cast<int64_t>(order.size());
  const int64_t k_len = x.size(1), n_bt = lora_bt.size(2), rows_a = lora_a.size(1), r = lora_bt.size(1);
  const int64_t k_vec = k_len / kLanes * kLanes;
  const int64_t ldy = y.stride(0), ldx = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* ap = lora_a.data_ptr<T>();
  const T* bp = lora_bt.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  // Scratch before any parallel region (an allocation failure must raise, not leave a region).
  std::vector<float> h(static_cast<size_t>(n_act * rows_a));
  const int64_t shrink_blocks = (rows_a + kShrinkRows - 1) / kShrinkRows;
  const int64_t n_shrink = static_cast<int64_t>(groups.size()) * shrink_blocks;
  std::vector<ExpandItem> expand;
  for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g)
    for (size_t i = 0; i < sizes.size(); ++i)
      for (int64_t c = 0; c < sizes[i]; c += kExpandCols)
        expand.push_back({g, static_cast<int64_t>(i), offsets[i] + c, std::min(kExpandCols, sizes[i] - c)});
  const int64_t n_expand = static_cast<int64_t>(expand.size());
  int64_t cols = 0;
  for (int64_t sz : sizes) cols += sz;
  const int64_t macs = n_act * (rows_a * k_len + r * cols);
  const int num_threads = macs < kSerialMacs ? 1
                                             : static_cast<int>(std::max<int64_t>(
                                                   1, std::min<int64_t>(at::get_num_threads(), n_shrink + n_expand)));

#pragma omp parallel num_threads(num_threads)
  {
    // Shrink: h[i, j] = A[slot, j] . x[order[i]].
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < n_shrink; ++w) {
      const Group& g = groups[w / shrink_blocks];
      const int64_t j0 = (w % shrink_blocks) * kShrinkRows, j1 = std::min(rows_a, j0 + kShrinkRows);
      for (int64_t t = g.begin; t < g.end; t += kTokBlock) {
        const int64_t tbn = std::min(kTokBlock, g.end - t);
        const T* xr[kTokBlock];  // this block's x rows (past tbn: the last one again, never stored)
        for (int64_t tb = 0; tb < kTokBlock; ++tb) xr[tb] = xp + order[t + std::min(tb, tbn - 1)] * ldx;
        float* ht = h.data() + t * rows_a;
        int64_t j = j0;
        for (; j + kShrinkJ <= j1; j += kShrinkJ)
          shrink_block<T, kShrinkJ>(ap + (g.slot * rows_a + j) * k_len, xr, k_len, k_vec, tbn, ht + j, rows_a);
        for (; j < j1; ++j)
          shrink_block<T, 1>(ap + (g.slot * rows_a + j) * k_len, xr, k_len, k_vec, tbn, ht + j, rows_a);
      }
    }
    // Expand: y[order[i], cols] += h[i, sub's r] @ Bt[slot, :, cols].
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < n_expand; ++w) {
      const ExpandItem& it = expand[w];
      const Group& g = groups[it.group];
      const T* bslot = bp + g.slot * r * n_bt;
      for (int64_t t = g.begin; t < g.end; t += kTokBlock) {
        const int64_t tbn = std::min(kTokBlock, g.end - t);
        const float* ht = h.data() + t * rows_a + it.sub * r;
        for (int64_t c = it.col; c < it.col + it.width; c += kCols) {
          T* yrows[kTokBlock];
          for (int64_t tb = 0; tb < tbn; ++tb) yrows[tb] = yp + order[t + tb] * ldy + c;
          const int64_t wc = std::min(kCols, it.col + it.width - c);
          if (wc < kCols) {
            expand_tail<T>(bslot + c, n_bt, ht, rows_a, r, yrows, tbn, wc);
            continue;
          }
          switch (tbn) {
            case 1: expand_block<T, 1, kCols>(bslot + c, n_bt, ht, rows_a, r, yrows); break;
            case 2: expand_block<T, 2, kCols>(bslot + c, n_bt, ht, rows_a, r, yrows); break;
            case 3: expand_block<T, 3, kCols>(bslot + c, n_bt, ht, rows_a, r, yrows); break;
            default: expand_block<T, 4, kCols>(bslot + c, n_bt, ht, rows_a, r, yrows); break;
          }
        }
      }
    }
  }
}

void lora_add_cpu(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_bt,
                  const at::Tensor& token_slots, c10::IntArrayRef out_offsets, c10::IntArrayRef out_sizes) {
  // Every check runs before any data is read and before the parallel region (whose body cannot throw).
  check_cpu(y, "y");
  check_cpu(x, "x");
  check_cpu(lora_a, "lora_a");
  check_cpu(lora_bt, "lora_bt");
  check_cpu(token_slots, "token_slots");
  const auto dt = y.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kBFloat16,
                   msg("lora_add_cpu: y must be float32 or bfloat16, got ", dt));
  check_dtype(x, dt, "x");
  check_dtype(lora_a, dt, "lora_a");
  check_dtype(lora_bt, dt, "lora_bt");
  check_dtype(token_slots, at::kInt, "token_slots");
  check_dim(y, 2, "y");
  check_dim(x, 2, "x");
  check_dim(lora_a, 3, "lora_a");
  check_dim(lora_bt, 3, "lora_bt");
  check_dim(token_slots, 1, "token_slots");
  check_contiguous(lora_a, "lora_a");
  check_contiguous(lora_bt, "lora_bt");
  check_contiguous(token_slots, "token_slots");
  TORCH_CHECK_VALUE(y.stride(1) == 1 && x.stride(1) == 1,
                    msg("lora_add_cpu: y and x need unit column stride, got strides ", y.strides(), " and ",
                        x.strides()));
  const int64_t t_len = x.size(0), k_len = x.size(1), n_out = y.size(1);
  const int64_t slots = lora_a.size(0), r = lora_bt.size(1), n_sub = static_cast<int64_t>(out_offsets.size());
  TORCH_CHECK_VALUE(y.size(0) == t_len && token_slots.size(0) == t_len,
                    msg("lora_add_cpu: y ", y.sizes(), ", x ", x.sizes(), " and token_slots ", token_slots.sizes(),
                        " must have the same number of tokens"));
  TORCH_CHECK_VALUE(lora_a.size(2) == k_len,
                    msg("lora_add_cpu: lora_a ", lora_a.sizes(), " must be [S, n_sub * r, ", k_len, "]"));
  TORCH_CHECK_VALUE(n_sub > 0 && static_cast<int64_t>(out_sizes.size()) == n_sub,
                    msg("lora_add_cpu: out_offsets (", n_sub, ") and out_sizes (",
                        static_cast<int64_t>(out_sizes.size()), ") must name the same, nonzero number of subs"));
  TORCH_CHECK_VALUE(lora_bt.size(0) == slots && lora_a.size(1) == n_sub * r,
                    msg("lora_add_cpu: lora_bt ", lora_bt.sizes(), " must be [", slots, ", r, N] with lora_a ",
                        lora_a.sizes(), " = [", slots, ", ", n_sub, " * r, K]"));
  const int64_t n_bt = lora_bt.size(2);
  std::vector<int64_t> offsets(out_offsets.begin(), out_offsets.end()), sizes(out_sizes.begin(), out_sizes.end());
  for (int64_t i = 0; i < n_sub; ++i)
    TORCH_CHECK_VALUE(offsets[i] >= 0 && sizes[i] >= 0 && offsets[i] + sizes[i] <= std::min(n_out, n_bt),
                      msg("lora_add_cpu: sub ", i, " columns [", offsets[i], ", ", offsets[i] + sizes[i],
                          ") lie outside y's ", n_out, " or lora_bt's ", n_bt));
  if (t_len == 0 || slots == 0) return;
  // Group the tokens by slot (counting sort), checking every slot index before any data access.
  const int32_t* sp = token_slots.data_ptr<int32_t>();
  std::vector<int64_t> count(static_cast<size_t>(slots) + 1, 0);
  for (int64_t t = 0; t < t_len; ++t) {
    const int32_t s = sp[t];
    TORCH_CHECK_VALUE(s >= -1 && s < slots,
                      msg("lora_add_cpu: token_slots[", t, "] = ", static_cast<int64_t>(s), " outside [-1, ",
                          slots, ")"));
    if (s >= 0) ++count[s + 1];
  }
  std::vector<Group> groups;
  for (int64_t s = 0; s < slots; ++s) {
    count[s + 1] += count[s];
    if (count[s + 1] > count[s]) groups.push_back({s, count[s], count[s + 1]});
  }
  if (groups.empty()) return;
  std::vector<int64_t> order(static_cast<size_t>(count[slots]));
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (int64_t t = 0; t < t_len; ++t)
    if (sp[t] >= 0) order[fill[sp[t]]++] = t;
  const at::Tensor xc = x;  // unit column stride checked; any row stride
  if (dt == at::kFloat)
    run<float>(y, xc, lora_a, lora_bt, order, groups, offsets, sizes);
  else
    run<c10::BFloat16>(y, xc, lora_a, lora_bt, order, groups, offsets, sizes);
}

}  // namespace
}  // namespace vllm_lite

TORCH_LIBRARY_FRAGMENT(vllm_lite, m) {
  m.def(
      "lora_add_cpu(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_bt, Tensor token_slots, int[] out_offsets, "
      "int[] out_sizes) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_lite, CPU, m) { m.impl("lora_add_cpu", &vllm_lite::lora_add_cpu); }
