// The whole expert path of a fused-MoE layer on the CPU in one call and one OpenMP region
// (vllm_lite/worker/models/fused_moe.py, CpuExperts):
//   moe_cpu_pack(w13 [E, 2I, H], w2 [E, H, I]) -> (w13p, w2p)
//       float32 copies of the experts laid out for the kernel: w13p [E, Ip/W, H, 2W] (per block of W
//       intermediate columns, each k's W gate weights then its W up weights), w2p [E, Hp/2W, Ip, 2W]; Ip, Hp
//       rounded up to W and 2W with zeros. W is this build's vector width (moe_cpu_block_width()).
//   moe_cpu_experts(x [T, H], w13p, w2p, topk_weights [T, k], topk_ids [T, k], inter) -> out [T, H]
//       out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j].
//   moe_cpu_route(x [T, H], router [E, H], top_k, renormalize, round_weights) -> (weights f32 [T, k], ids [T, k])
//       the router and fused_moe.route in one call (the routing SparseMoeBlock runs with these experts; below).
//   moe_cpu_prefetch(enable) -> previous: whether the expert ops prefetch (below; on by default, same results).
//
// Inside: token-expert pairs grouped by expert (counting sort, serial), then one parallel region of three
// phases: (1) gate/up for blocks of W intermediate columns of one expert over all of its rows, SiLU-and-mul
// applied in registers, into an activation buffer [pairs, Ip]; (2) the down projection for blocks of 2W output
// columns of one expert over its rows, into [pairs, Hp]; (3) each token's k contributions weighted and summed
// in ascending expert id, products rounded before the adds: transformers' per-expert `index_add_` order and
// roundings (float32), so given the same per-pair outputs the sum is the torch path's bit for bit. The matmuls'
// own sums run in k order with FMAs (as oneDNN/MKL do, in their own orders): float32 results move by ~1e-6
// relative from F.linear's. SiLU is torch's: x / (1 + exp(-x)) with the SLEEF exp its vector loop calls.
//
// Each weight block is read once per layer call and reused for all of an expert's rows from cache, where a
// oneDNN call per expert and projection paid its dispatch and re-read for 8-32 rows at decode. Each phase gives
// every thread one contiguous run of items balanced by rows, so a thread streams one stretch of the weights.
// At decode (items of <= 64 rows) each item's tiles also prefetch the thread's next weight block into L2, so the
// weights stream from DRAM while the tiles compute instead of before (Prefetch, NextBlock).
// Vector code by compile-time dispatch through GCC vector extensions: W = 16 (AVX-512), else 8 (AVX2 or
// portable). Every check runs before any data access and before the parallel region.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_common.h"

#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));  // exported by libtorch_cpu
#elif defined(__AVX2__)
extern "C" __m256 Sleef_expf8_u10(__m256) __attribute__((weak));
#endif

namespace vllm_lite {
namespace {

#if defined(__AVX512F__)
constexpr int64_t kW = 16;
constexpr int kRows = 8;  // rows per register tile: 2 x 8 accumulators of 16 floats
#else
constexpr int64_t kW = 8;
constexpr int kRows = 6;  // AVX2's 16 ymm registers: 12 accumulators, 2 weights, 1 broadcast
#endif
typedef float vec __attribute__((vector_size(kW * 4)));
typedef float vec_u __attribute__((vector_size(kW * 4), aligned(4)));  // unaligned access

inline vec load(const float* p) { return *reinterpret_cast<const vec_u*>(p); }
inline void store(float* p, vec v) { *reinterpret_cast<vec_u*>(p) = v; }

// Software prefetch of the thread's next weight block (into L2) while the tiles of the current item compute. At
// decode an expert has ~16 rows: with whole-k tiles the first tile of an item streams its weight block from DRAM
// faster than one core's outstanding misses allow (stalling), the later ones reread it from cache with DRAM idle.
// Spreading the next block's lines over the current item's first tiles (one or two lines per k step, the rate the
// block is consumed) keeps DRAM busy during the compute: the item's block is in L2 when its first tile starts.
// A block is 1 or 2 cache lines per k step (float32: 2 x W floats; bfloat16: 2 x 32 bf16 a k pair).
// Only items of at most kPrefetchRows rows prefetch: with more (prefill) each block is reused from cache by many
// tiles and the prefetches only cost issue slots. moe_cpu_prefetch(false) turns it off (the same results: A/B).
constexpr int64_t kPrefetchRows = 64;
std::atomic<bool> g_prefetch{true};

struct Prefetch {
  const char* p = nullptr;  // null: none
  int lines = 0;            // lines per k step: 1 or 2
  inline void at(int64_t k) const {
    if (p == nullptr) return;
    __builtin_prefetch(p + k * lines * 64, 0, 2);
    if (lines == 2) __builtin_prefetch(p + k * 128 + 64, 0, 2);
  }
};

// The next item's block handed out to an item's tiles: `step_bytes` (64 or 128) a k step in all; with 128 and two
// or more tiles the first two take one line a step each, else the first tile takes the whole block. tile_rows:
// the rows functions' first tile (R, then (R + 1) / 2, ... down to 1 for the remainder).
struct NextBlock {
  const char* base = nullptr;
  int64_t step_bytes = 128;
  int lines = 1;     // lines a k step for one tile
  int64_t done = 0;  // bytes of the block handed out
  NextBlock(const void* next, int64_t rows, int64_t tile_rows, int64_t step)
      : base(rows <= kPrefetchRows && g_prefetch.load(std::memory_order_relaxed) ? static_cast<const char*>(next)
                                                                                 : nullptr),
        step_bytes(step) {
    int64_t tiles = 0;
    for (int64_t r = tile_rows;; r = (r + 1) / 2) {
      tiles += rows / r;
      rows %= r;
      if (r == 1 || rows == 0) break;
    }
    lines = tiles <= 1 && step == 128 ? 2 : 1;
  }
  // The Prefetch of the next tile over `ksteps` k steps.
  Prefetch for_tile(int64_t ksteps) {
    if (base == nullptr || done >= ksteps * step_bytes) return {};
    Prefetch pf{base + done, lines};
    done += ksteps * lines * 64;
    return pf;
  }
};

// Whether the vector exp torch's SiLU calls is here; else every element takes std::exp.
inline bool vector_exp() {
#if defined(__AVX512F__)
  return Sleef_expf16_u10 != nullptr;
#elif defined(__AVX2__)
  return Sleef_expf8_u10 != nullptr;
#else
  return false;
#endif
}

// silu(g) * u as torch computes it: g / (1 + exp(-g)), then the product (two roundings, no FMA possible).
inline vec silu_mul_vec(vec g, vec u) {
#if defined(__AVX512F__)
  const vec e = reinterpret_cast<vec>(Sleef_expf16_u10(reinterpret_cast<__m512>(-g)));
#elif defined(__AVX2__)
  const vec e = reinterpret_cast<vec>(Sleef_expf8_u10(reinterpret_cast<__m256>(-g)));
#else
  vec e;
  for (int64_t i = 0; i < kW; ++i) e[i] = std::exp(-g[i]);
#endif
  return g / (1.0f + e) * u;
}

inline float silu_mul_scalar(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }

// act rows[r][0, W) = silu(x_r . gate cols) * (x_r . up cols) for R rows; wp: [H][2W] (gate W, up W per k).
// vec_cols: how many of the W columns torch's SiLU computes with its vector exp (the rest: std::exp, or 0 for
// padding columns beyond the intermediate size).
template <int R>
inline void gate_up_tile(const float* const* xr, const float* wp, int64_t h, float* act, int64_t ld_act,
                         int64_t vec_cols, int64_t valid_cols, Prefetch pf) {
  vec g[R], u[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) g[r] = u[r] = vec{};
  for (int64_t k = 0; k < h; ++k) {
    pf.at(k);
    const vec wg = load(wp + k * 2 * kW), wu = load(wp + k * 2 * kW + kW);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float s = xr[r][k];
      g[r] += s * wg;
      u[r] += s * wu;
    }
  }
  for (int r = 0; r < R; ++r) {
    float* out = act + r * ld_act;
    if (vec_cols == kW) {
      store(out, silu_mul_vec(g[r], u[r]));
    } else {
      for (int64_t i = 0; i < kW; ++i)
        out[i] = i < vec_cols ? silu_mul_vec(g[r], u[r])[i] : (i < valid_cols ? silu_mul_scalar(g[r][i], u[r][i]) : 0.0f);
    }
  }
}

// y rows[r][0, 2W) = act_r . w2 cols for R rows; wp: [Ip][2W].
template <int R>
inline void down_tile(const float* act, int64_t ld_act, const float* wp, int64_t ip, float* y, int64_t ld_y,
                      Prefetch pf) {
  vec a[R], b[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) a[r] = b[r] = vec{};
  for (int64_t k = 0; k < ip; ++k) {
    pf.at(k);
    const vec w0 = load(wp + k * 2 * kW), w1 = load(wp + k * 2 * kW + kW);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float s = act[r * ld_act + k];
      a[r] += s * w0;
      b[r] += s * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    store(y + r * ld_y, a[r]);
    store(y + r * ld_y + kW, b[r]);
  }
}

template <int R>
void gate_up_rows(const float* const* xr, const float* wp, int64_t h, float* act, int64_t ld_act, int64_t vec_cols,
                  int64_t valid_cols, int64_t n, NextBlock& next) {
  int64_t r = 0;
  for (; r + R <= n; r += R)
    gate_up_tile<R>(xr + r, wp, h, act + r * ld_act, ld_act, vec_cols, valid_cols, next.for_tile(h));
  if (r == n) return;
  if constexpr (R > 1) gate_up_rows<(R + 1) / 2>(xr + r, wp, h, act + r * ld_act, ld_act, vec_cols,
                                                                 valid_cols, n - r, next);
}

template <int R>
void down_rows(const float* act, int64_t ld_act, const float* wp, int64_t ip, float* y, int64_t ld_y, int64_t n,
               NextBlock& next) {
  int64_t r = 0;
  for (; r + R <= n; r += R) down_tile<R>(act + r * ld_act, ld_act, wp, ip, y + r * ld_y, ld_y, next.for_tile(ip));
  if (r == n) return;
  if constexpr (R > 1) down_rows<(R + 1) / 2>(act + r * ld_act, ld_act, wp, ip, y + r * ld_y, ld_y, n - r, next);
}

// out = p0 + p1 + ... with p_j = y_j * w_j rounded before each add (torch's separate mul and add kernels).
__attribute__((optimize("fp-contract=off"), noinline)) void combine_row(const float* const* y, const float* w,
                                                                        int64_t k, int64_t h, float* out) {
  for (int64_t i = 0; i < h; ++i) out[i] = y[0][i] * w[0];
  for (int64_t j = 1; j < k; ++j) {
    const float wj = w[j];
    const float* yj = y[j];
    for (int64_t i = 0; i < h; ++i) out[i] = out[i] + yj[i] * wj;
  }
}

// ------------------------------------------------------------------------------------------------ shared
// What the float32 and bfloat16 expert ops share: their arguments' checks, the (token, choice) pairs grouped by
// expert, the work items per phase with one contiguous run per thread, and each token's choices in expert order.

// x, w13p, w2p, topk_weights, topk_ids as both ops take them (`dt`: x's and the packed weights' dtype).
void check_expert_args(const char* op, const at::Tensor& x, const at::Tensor& w13p, const at::Tensor& w2p,
                       const at::Tensor& topk_weights, const at::Tensor& topk_ids, at::ScalarType dt) {
  check_cpu(x, "x");
  check_cpu(w13p, "w13p");
  check_cpu(w2p, "w2p");
  check_cpu(topk_weights, "topk_weights");
  check_cpu(topk_ids, "topk_ids");
  check_dim(x, 2, "x");
  check_dim(w13p, 4, "w13p");
  check_dim(w2p, 4, "w2p");
  check_dim(topk_weights, 2, "topk_weights");
  check_dim(topk_ids, 2, "topk_ids");
  check_dtype(x, dt, "x");
  check_dtype(w13p, dt, "w13p");
  check_dtype(w2p, dt, "w2p");
  check_dtype(topk_weights, at::kFloat, "topk_weights");
  check_dtype(topk_ids, at::kLong, "topk_ids");
  check_contiguous(w13p, "w13p");
  check_contiguous(w2p, "w2p");
  check_contiguous(topk_weights, "topk_weights");
  check_contiguous(topk_ids, "topk_ids");
  TORCH_CHECK_VALUE(x.stride(1) == 1 || x.size(1) <= 1,
                    msg(op, ": x's rows must be contiguous (got strides ", x.strides(), ")"));
}

// The routing checks after the layouts': topk shapes, k <= 64, every id an expert.
void check_routing(const char* op, const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t t,
                   int64_t e) {
  const int64_t k = topk_ids.size(1);
  TORCH_CHECK_VALUE(topk_ids.size(0) == t && topk_weights.size(0) == t && topk_weights.size(1) == k && k > 0,
                    msg(op, ": topk_ids ", topk_ids.sizes(), " and topk_weights ", topk_weights.sizes(),
                        " must both be [T=", t, ", k >= 1]"));
  TORCH_CHECK_VALUE(k <= 64, msg(op, ": at most 64 experts per token, got k=", k));
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < t * k; ++p)
    TORCH_CHECK_VALUE(ids[p] >= 0 && ids[p] < e, msg(op, ": topk_ids holds ", ids[p], ", outside [0, ", e, ")"));
}

struct ExpertSchedule {
  // Pairs grouped by expert (counting sort): expert x's rows are [start[x], start[x+1]); slot[p] = pair p's row
  // in the act/y buffers, src_tok[row] = its token.
  std::vector<int64_t> start, slot, src_tok;
  // Work items: (expert, column block), each over all of the expert's rows; cost = prefix sums of their rows.
  std::vector<std::pair<int64_t, int64_t>> up_items, down_items;
  std::vector<int64_t> up_cost, down_cost;

  // nb / hb: column blocks of the gate/up and of the down phase.
  ExpertSchedule(const int64_t* ids, int64_t pairs, int64_t k, int64_t e, int64_t nb, int64_t hb)
      : start(e + 1, 0), slot(pairs), src_tok(pairs) {
    for (int64_t p = 0; p < pairs; ++p) ++start[ids[p] + 1];
    for (int64_t x = 0; x < e; ++x) start[x + 1] += start[x];
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t s = fill[ids[p]]++;
      slot[p] = s;
      src_tok[s] = p / k;
    }
    for (int64_t x = 0; x < e; ++x) {
      if (start[x + 1] == start[x]) continue;
      for (int64_t b = 0; b < nb; ++b) up_items.emplace_back(x, b);
      for (int64_t b = 0; b < hb; ++b) down_items.emplace_back(x, b);
    }
    up_cost = costs(up_items);
    down_cost = costs(down_items);
  }

  int64_t rows(int64_t ex) const { return start[ex + 1] - start[ex]; }

  // OpenMP threads for a call of `macs` multiply-adds: one below ~256k, else up to one per gate/up item.
  int threads(int64_t macs) const {
    const int64_t n_up = static_cast<int64_t>(up_items.size());
    return macs < (1 << 18) ? 1
                            : static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_up)));
  }

  // Each phase's items split into one contiguous run per thread, balanced by rows (an item's cost): a thread then
  // streams one contiguous stretch of the packed weights (consecutive items' blocks are adjacent), which the
  // hardware prefetcher follows, where dynamic scheduling had the threads take alternate blocks.
  static std::pair<int64_t, int64_t> run_of(const std::vector<int64_t>& cost, int64_t tid, int64_t nt) {
    const int64_t n = static_cast<int64_t>(cost.size()) - 1, total = cost[n];
    auto at = [&](int64_t j) {
      const int64_t target = (total * j + nt / 2) / nt;
      return static_cast<int64_t>(std::lower_bound(cost.begin(), cost.end(), target) - cost.begin());
    };
    return std::make_pair(std::min(at(tid), n), std::min(at(tid + 1), n));
  }

 private:
  std::vector<int64_t> costs(const std::vector<std::pair<int64_t, int64_t>>& items) const {
    std::vector<int64_t> c(items.size() + 1, 0);
    for (size_t i = 0; i < items.size(); ++i) c[i + 1] = c[i] + rows(items[i].first);
    return c;
  }
};

// Token tok's k choices by ascending expert id (k <= 64 is small: insertion sort): their rows of y and weights.
inline int64_t token_rows_in_expert_order(const int64_t* ids, const float* wts, const std::vector<int64_t>& slot,
                                          const float* y, int64_t hp, int64_t tok, int64_t k, const float** rows,
                                          float* w) {
  int64_t order[64];
  const int64_t kk = std::min<int64_t>(k, 64);
  for (int64_t j = 0; j < kk; ++j) {
    int64_t v = j, i = j;
    while (i > 0 && ids[tok * k + order[i - 1]] > ids[tok * k + v]) {
      order[i] = order[i - 1];
      --i;
    }
    order[i] = v;
  }
  for (int64_t j = 0; j < kk; ++j) {
    rows[j] = y + slot[tok * k + order[j]] * hp;
    w[j] = wts[tok * k + order[j]];
  }
  return kk;
}

int64_t moe_cpu_block_width() { return kW; }

// Whether the expert ops prefetch the next weight block at decode (default on); returns the previous setting.
// For same-process A/B runs (benchmarks/moe_cpu_ab.py --ab prefetch) and tests: results are the same either way.
bool moe_cpu_prefetch(bool enable) { return g_prefetch.exchange(enable); }

std::tuple<at::Tensor, at::Tensor> moe_cpu_pack(const at::Tensor& w13, const at::Tensor& w2) {
  check_cpu(w13, "w13");
  check_cpu(w2, "w2");
  check_dim(w13, 3, "w13");
  check_dim(w2, 3, "w2");
  check_dtype(w13, at::kFloat, "w13");
  check_dtype(w2, at::kFloat, "w2");
  const int64_t e = w13.size(0), h = w13.size(2), inter = w13.size(1) / 2;
  TORCH_CHECK_VALUE(w13.size(1) % 2 == 0 && inter > 0 && h > 0 && e > 0,
                    msg("moe_cpu_pack: w13 must be [E, 2I, H] with E, I, H > 0, got shape ", w13.sizes()));
  TORCH_CHECK_VALUE(w2.size(0) == e && w2.size(1) == h && w2.size(2) == inter,
                    msg("moe_cpu_pack: w2 must be [E, H, I] = [", e, ", ", h, ", ", inter, "], got shape ",
                        w2.sizes()));
  const int64_t nb = (inter + kW - 1) / kW, ip = nb * kW, hb = (h + 2 * kW - 1) / (2 * kW);
  at::Tensor a = w13.contiguous(), b = w2.contiguous();
  at::Tensor p13 = at::zeros({e, nb, h, 2 * kW}, w13.options());
  at::Tensor p2 = at::zeros({e, hb, ip, 2 * kW}, w2.options());
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* p13p = p13.data_ptr<float>();
  float* p2p = p2.data_ptr<float>();
  at::parallel_for(0, e, 1, [&](int64_t e0, int64_t e1) {
    for (int64_t x = e0; x < e1; ++x) {
      const float* src = ap + x * 2 * inter * h;
      for (int64_t j = 0; j < inter; ++j) {  // gate row j and up row j -> block j / W, lane j % W
        float* dst = p13p + ((x * nb + j / kW) * h) * 2 * kW + j % kW;
        const float* gate = src + j * h;
        const float* up = src + (inter + j) * h;
        for (int64_t k = 0; k < h; ++k) {
          dst[k * 2 * kW] = gate[k];
          dst[k * 2 * kW + kW] = up[k];
        }
      }
      const float* src2 = bp + x * h * inter;
      for (int64_t o = 0; o < h; ++o) {  // down row o -> block o / 2W, lane o % 2W
        float* dst = p2p + ((x * hb + o / (2 * kW)) * ip) * 2 * kW + o % (2 * kW);
        const float* row = src2 + o * inter;
        for (int64_t k = 0; k < inter; ++k) dst[k * 2 * kW] = row[k];
      }
    }
  });
  return {p13, p2};
}

at::Tensor moe_cpu_experts(const at::Tensor& x, const at::Tensor& w13p, const at::Tensor& w2p,
                           const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t inter) {
  check_expert_args("moe_cpu_experts", x, w13p, w2p, topk_weights, topk_ids, at::kFloat);
  const int64_t t = x.size(0), h = x.size(1), k = topk_ids.size(1), e = w13p.size(0);
  const int64_t nb = w13p.size(1), ip = nb * kW, hb = w2p.size(1), hp = hb * 2 * kW;
  TORCH_CHECK_VALUE(w13p.size(2) == h && w13p.size(3) == 2 * kW,
                    msg("moe_cpu_experts: w13p must be [E, Ip/", kW, ", H=", h, ", ", 2 * kW, "] (moe_cpu_pack), got ",
                        w13p.sizes()));
  TORCH_CHECK_VALUE(inter > 0 && inter <= ip && ip - inter < kW,
                    msg("moe_cpu_experts: inter=", inter, " does not fit w13p's ", ip, " packed columns"));
  TORCH_CHECK_VALUE(w2p.size(0) == e && w2p.size(2) == ip && w2p.size(3) == 2 * kW && hp >= h && hp - h < 2 * kW,
                    msg("moe_cpu_experts: w2p must be [", e, ", ", (h + 2 * kW - 1) / (2 * kW), ", ", ip, ", ", 2 * kW,
                        "] (moe_cpu_pack), got ", w2p.sizes()));
  check_routing("moe_cpu_experts", topk_weights, topk_ids, t, e);
  at::Tensor out = at::empty({t, h}, x.options());
  if (t == 0 || h == 0) return out;
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const int64_t pairs = t * k;
  const ExpertSchedule sched(ids, pairs, k, e, nb, hb);
  const auto &start = sched.start, &slot = sched.slot, &src_tok = sched.src_tok;
  const auto &up_items = sched.up_items, &down_items = sched.down_items;
  // Scratch without zero-filling (every element read is written first: padding columns included). At a 2048-token
  // prefill the two buffers are ~19 MB that std::vector would memset on every call.
  std::unique_ptr<float[]> act_buf(new float[static_cast<size_t>(pairs * ip)]);
  std::unique_ptr<float[]> y_buf(new float[static_cast<size_t>(pairs * hp)]);
  float* const act = act_buf.get();
  float* const y = y_buf.get();
  std::vector<const float*> xrows(pairs);
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  for (int64_t s = 0; s < pairs; ++s) xrows[s] = xp + src_tok[s] * ldx;
  const float* w13 = w13p.data_ptr<float>();
  const float* w2 = w2p.data_ptr<float>();
  const float* wts = topk_weights.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // torch's SiLU loop runs whole pairs of vectors and its scalar tail (std::exp) on the rest of a row.
  const int64_t vec_end = vector_exp() ? inter - inter % (2 * kW) : 0;
  const int num_threads = sched.threads(pairs * ip * (2 * h + hp));

#pragma omp parallel num_threads(num_threads)
  {
    const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const auto up_run = ExpertSchedule::run_of(sched.up_cost, tid, nt);
    const auto down_run = ExpertSchedule::run_of(sched.down_cost, tid, nt);
    auto up_block = [&](int64_t i) { return w13 + (up_items[i].first * nb + up_items[i].second) * h * 2 * kW; };
    auto down_block = [&](int64_t i) { return w2 + (down_items[i].first * hb + down_items[i].second) * ip * 2 * kW; };
    for (int64_t i = up_run.first; i < up_run.second; ++i) {
      const int64_t ex = up_items[i].first, b = up_items[i].second;
      const int64_t s0 = start[ex], n = start[ex + 1] - s0;
      const int64_t c0 = b * kW;
      const int64_t vec_cols = std::clamp<int64_t>(vec_end - c0, 0, kW);
      const int64_t valid = std::clamp<int64_t>(inter - c0, 0, kW);
      const float* nxt = i + 1 < up_run.second ? up_block(i + 1) : nullptr;
      // The run's last item: this thread's first block of the down phase.
      if (nxt == nullptr && down_run.first < down_run.second) nxt = down_block(down_run.first);
      NextBlock next(nxt, n, kRows, 2 * kW * 4);
      gate_up_rows<kRows>(xrows.data() + s0, w13 + (ex * nb + b) * h * 2 * kW, h, act + s0 * ip + c0, ip,
                          vec_cols, valid, n, next);
    }
#pragma omp barrier
    for (int64_t i = down_run.first; i < down_run.second; ++i) {
      const int64_t ex = down_items[i].first, b = down_items[i].second;
      const int64_t s0 = start[ex], n = start[ex + 1] - s0;
      NextBlock next(i + 1 < down_run.second ? down_block(i + 1) : nullptr, n, kRows, 2 * kW * 4);
      down_rows<kRows>(act + s0 * ip, ip, w2 + (ex * hb + b) * ip * 2 * kW, ip, y + s0 * hp + b * 2 * kW,
                       hp, n, next);
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t tok = 0; tok < t; ++tok) {
      const float* rows[64];
      float w[64];
      const int64_t kk = token_rows_in_expert_order(ids, wts, slot, y, hp, tok, k, rows, w);
      combine_row(rows, w, kk, h, op + tok * h);
    }
  }
  return out;
}

// ------------------------------------------------------------------------------------------------ bfloat16
// The same expert path for bfloat16 layers where the build targets AVX512-BF16 (Zen 4, Sapphire Rapids, ...;
// elsewhere moe_cpu_bf16_built() is false and bfloat16 experts stay on oneDNN, PackedExperts):
//   moe_cpu_pack_bf16(w13 [E, 2I, H], w2 [E, H, I]) -> (w13p [E, Ip/16, H/2, 64], w2p [E, Hp/32, Ip/2, 64])
//       per pair of inputs (k, k+1) one 64-element row: gate then up (w13p) or output columns 0-15 then 16-31 of
//       the block (w2p), each as 16 (column) x 2 (k, k+1) bf16: one VDPBF16PS operand. H must be even.
//   moe_cpu_experts_bf16(x [T, H] bf16, w13p, w2p, topk_weights [T, k] float32, topk_ids, inter) -> out [T, H]
// VDPBF16PS multiplies bf16 pairs exactly and sums in float32 (in pair order, as oneDNN's bf16 matmuls on this
// CPU do, in their own order). Roundings are the torch path's (grouped_experts on bf16): gate and up rounded to
// bf16, SiLU of the rounded gate in float32 rounded to bf16, its product with up rounded; the down projection
// rounded to bf16; each token's contributions weighted in float32, rounded, and summed in bf16 in ascending
// expert id.
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool kMoeBf16 = true;

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }
inline __m512i as_i(__m256bh v) { return _mm512_castsi256_si512(reinterpret_cast<__m256i&>(v)); }
// float32 -> bf16 (round to nearest even, as c10::BFloat16) -> float32.
inline __m512 round_bf16(__m512 v) {
  const __m256bh h = _mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h)), 16));
}
inline __m256i to_bf16(__m512 v) {
  const __m256bh h = _mm512_cvtneps_pbh(v);
  return reinterpret_cast<const __m256i&>(h);
}

// act rows[r][0, 16) = bf16(silu(bf16(x_r . gate)) * bf16(x_r . up)) for R rows; wp: [H/2][64]; xr: rows as pairs.
template <int R>
inline void gate_up_tile_bf16(const uint32_t* const* xr, const uint16_t* wp, int64_t h2, uint16_t* act,
                              int64_t ld_act, int64_t valid_cols, Prefetch pf) {
  __m512 g[R], u[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) g[r] = u[r] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < h2; ++kp) {
    pf.at(kp);
    const __m512i wg = _mm512_loadu_si512(wp + kp * 64), wu = _mm512_loadu_si512(wp + kp * 64 + 32);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(xr[r][kp]));
      g[r] = _mm512_dpbf16_ps(g[r], as_bh(wg), as_bh(xb));
      u[r] = _mm512_dpbf16_ps(u[r], as_bh(wu), as_bh(xb));
    }
  }
  const __mmask16 m = static_cast<__mmask16>(valid_cols >= 16 ? 0xFFFF : (1u << valid_cols) - 1u);
  for (int r = 0; r < R; ++r) {
    const __m512 gr = round_bf16(g[r]), ur = round_bf16(u[r]);
    const __m512 e = vector_exp() ? Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), gr))
                                  : [&] {
                                      alignas(64) float t[16];
                                      _mm512_store_ps(t, gr);
                                      for (float& v : t) v = std::exp(-v);
                                      return _mm512_load_ps(t);
                                    }();
    const __m512 silu = round_bf16(_mm512_div_ps(gr, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    const __m512 a = _mm512_maskz_mov_ps(m, _mm512_mul_ps(silu, ur));  // padding columns: 0
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(act + r * ld_act), to_bf16(a));
  }
}

// y rows[r][0, 32) = bf16(act_r . w2 cols) (as float32) for R rows; wp: [Ip/2][64].
template <int R>
inline void down_tile_bf16(const uint16_t* act, int64_t ld_act, const uint16_t* wp, int64_t ip2, float* y,
                           int64_t ld_y, Prefetch pf) {
  __m512 a[R], b[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) a[r] = b[r] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < ip2; ++kp) {
    pf.at(kp);
    const __m512i w0 = _mm512_loadu_si512(wp + kp * 64), w1 = _mm512_loadu_si512(wp + kp * 64 + 32);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, act + r * ld_act + 2 * kp, sizeof(pair));
      const __m512i ab = _mm512_set1_epi32(static_cast<int>(pair));
      a[r] = _mm512_dpbf16_ps(a[r], as_bh(w0), as_bh(ab));
      b[r] = _mm512_dpbf16_ps(b[r], as_bh(w1), as_bh(ab));
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * ld_y, round_bf16(a[r]));
    _mm512_storeu_ps(y + r * ld_y + 16, round_bf16(b[r]));
  }
}

template <int R>
void gate_up_rows_bf16(const uint32_t* const* xr, const uint16_t* wp, int64_t h2, uint16_t* act, int64_t ld_act,
                       int64_t valid_cols, int64_t n, NextBlock& next) {
  int64_t r = 0;
  for (; r + R <= n; r += R)
    gate_up_tile_bf16<R>(xr + r, wp, h2, act + r * ld_act, ld_act, valid_cols, next.for_tile(h2));
  if (r == n) return;
  if constexpr (R > 1)
    gate_up_rows_bf16<(R + 1) / 2>(xr + r, wp, h2, act + r * ld_act, ld_act, valid_cols, n - r, next);
}

template <int R>
void down_rows_bf16(const uint16_t* act, int64_t ld_act, const uint16_t* wp, int64_t ip2, float* y, int64_t ld_y,
                    int64_t n, NextBlock& next) {
  int64_t r = 0;
  for (; r + R <= n; r += R)
    down_tile_bf16<R>(act + r * ld_act, ld_act, wp, ip2, y + r * ld_y, ld_y, next.for_tile(ip2));
  if (r == n) return;
  if constexpr (R > 1)
    down_rows_bf16<(R + 1) / 2>(act + r * ld_act, ld_act, wp, ip2, y + r * ld_y, ld_y, n - r, next);
}

// out (bf16) = sum over j of bf16(y_j * w_j), added in order with a bf16 rounding after each add. 16 columns at a
// time with the vector conversion (round to nearest even, as c10::BFloat16 for every value but subnormals, which
// it flushes: none of a layer's outputs), the tail as scalars.
void combine_row_bf16(const float* const* y, const float* w, int64_t k, int64_t h, c10::BFloat16* out) {
  int64_t i0 = 0;
  for (; i0 + 16 <= h; i0 += 16) {
    __m512 acc = round_bf16(_mm512_mul_ps(_mm512_loadu_ps(y[0] + i0), _mm512_set1_ps(w[0])));
    for (int64_t j = 1; j < k; ++j)
      acc = round_bf16(_mm512_add_ps(acc, round_bf16(_mm512_mul_ps(_mm512_loadu_ps(y[j] + i0), _mm512_set1_ps(w[j])))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i0), to_bf16(acc));
  }
  for (int64_t i = i0; i < h; ++i) {
    float acc = static_cast<float>(c10::BFloat16(y[0][i] * w[0]));
    for (int64_t j = 1; j < k; ++j) acc = static_cast<float>(c10::BFloat16(acc + static_cast<float>(c10::BFloat16(y[j][i] * w[j]))));
    out[i] = c10::BFloat16(acc);
  }
}
#else
constexpr bool kMoeBf16 = false;
#endif

bool moe_cpu_bf16_built() { return kMoeBf16; }

std::tuple<at::Tensor, at::Tensor> moe_cpu_pack_bf16(const at::Tensor& w13, const at::Tensor& w2) {
  TORCH_CHECK(kMoeBf16, "moe_cpu_pack_bf16: not built here (the compiler does not target AVX512-BF16)");
  check_cpu(w13, "w13");
  check_cpu(w2, "w2");
  check_dim(w13, 3, "w13");
  check_dim(w2, 3, "w2");
  check_dtype(w13, at::kBFloat16, "w13");
  check_dtype(w2, at::kBFloat16, "w2");
  const int64_t e = w13.size(0), h = w13.size(2), inter = w13.size(1) / 2;
  TORCH_CHECK_VALUE(w13.size(1) % 2 == 0 && inter > 0 && h > 0 && e > 0 && h % 2 == 0,
                    msg("moe_cpu_pack_bf16: w13 must be [E, 2I, H] with E, I, H > 0 and H even, got shape ",
                        w13.sizes()));
  TORCH_CHECK_VALUE(w2.size(0) == e && w2.size(1) == h && w2.size(2) == inter,
                    msg("moe_cpu_pack_bf16: w2 must be [E, H, I] = [", e, ", ", h, ", ", inter, "], got shape ",
                        w2.sizes()));
  const int64_t nb = (inter + 15) / 16, ip = nb * 16, hb = (h + 31) / 32, h2 = h / 2;
  at::Tensor a = w13.contiguous(), b = w2.contiguous();
  at::Tensor p13 = at::zeros({e, nb, h2, 64}, w13.options());
  at::Tensor p2 = at::zeros({e, hb, ip / 2, 64}, w2.options());
  const uint16_t* ap = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
  const uint16_t* bp = reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>());
  uint16_t* p13p = reinterpret_cast<uint16_t*>(p13.data_ptr<at::BFloat16>());
  uint16_t* p2p = reinterpret_cast<uint16_t*>(p2.data_ptr<at::BFloat16>());
  at::parallel_for(0, e, 1, [&](int64_t e0, int64_t e1) {
    for (int64_t x = e0; x < e1; ++x) {
      const uint16_t* src = ap + x * 2 * inter * h;
      for (int64_t j = 0; j < inter; ++j) {  // gate row j -> block j / 16, column j % 16; up 32 elements after
        uint16_t* dst = p13p + (x * nb + j / 16) * h2 * 64 + (j % 16) * 2;
        const uint16_t* gate = src + j * h;
        const uint16_t* up = src + (inter + j) * h;
        for (int64_t k = 0; k < h; ++k) {
          dst[(k / 2) * 64 + k % 2] = gate[k];
          dst[(k / 2) * 64 + 32 + k % 2] = up[k];
        }
      }
      const uint16_t* src2 = bp + x * h * inter;
      for (int64_t o = 0; o < h; ++o) {  // down row o -> block o / 32, half (o % 32) / 16, column o % 16
        uint16_t* dst = p2p + (x * hb + o / 32) * (ip / 2) * 64 + ((o % 32) / 16) * 32 + (o % 16) * 2;
        const uint16_t* row = src2 + o * inter;
        for (int64_t k = 0; k < inter; ++k) dst[(k / 2) * 64 + k % 2] = row[k];
      }
    }
  });
  return {p13, p2};
}

at::Tensor moe_cpu_experts_bf16(const at::Tensor& x, const at::Tensor& w13p, const at::Tensor& w2p,
                                const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t inter) {
  TORCH_CHECK(kMoeBf16, "moe_cpu_experts_bf16: not built here (the compiler does not target AVX512-BF16)");
  check_expert_args("moe_cpu_experts_bf16", x, w13p, w2p, topk_weights, topk_ids, at::kBFloat16);
  const int64_t t = x.size(0), h = x.size(1), k = topk_ids.size(1), e = w13p.size(0);
  const int64_t nb = w13p.size(1), ip = nb * 16, hb = w2p.size(1), hp = hb * 32, h2 = h / 2;
  TORCH_CHECK_VALUE(h % 2 == 0 && w13p.size(2) == h2 && w13p.size(3) == 64,
                    msg("moe_cpu_experts_bf16: w13p must be [E, Ip/16, H/2=", h2, ", 64] (moe_cpu_pack_bf16, H even), "
                        "got ", w13p.sizes()));
  TORCH_CHECK_VALUE(inter > 0 && inter <= ip && ip - inter < 16,
                    msg("moe_cpu_experts_bf16: inter=", inter, " does not fit w13p's ", ip, " packed columns"));
  TORCH_CHECK_VALUE(w2p.size(0) == e && w2p.size(2) == ip / 2 && w2p.size(3) == 64 && hp >= h && hp - h < 32,
                    msg("moe_cpu_experts_bf16: w2p must be [", e, ", ", (h + 31) / 32, ", ", ip / 2,
                        ", 64] (moe_cpu_pack_bf16), got ", w2p.sizes()));
  check_routing("moe_cpu_experts_bf16", topk_weights, topk_ids, t, e);
  at::Tensor out = at::empty({t, h}, x.options());
  if (t == 0 || h == 0) return out;
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const int64_t pairs = t * k;
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
  const ExpertSchedule sched(ids, pairs, k, e, nb, hb);
  const auto &start = sched.start, &slot = sched.slot, &src_tok = sched.src_tok;
  const auto &up_items = sched.up_items, &down_items = sched.down_items;
  std::unique_ptr<uint16_t[]> act_buf(new uint16_t[static_cast<size_t>(pairs * ip)]);
  std::unique_ptr<float[]> y_buf(new float[static_cast<size_t>(pairs * hp)]);
  uint16_t* const act = act_buf.get();
  float* const y = y_buf.get();
  std::vector<const uint32_t*> xrows(pairs);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int64_t ldx = x.stride(0);
  for (int64_t s = 0; s < pairs; ++s) xrows[s] = reinterpret_cast<const uint32_t*>(xp + src_tok[s] * ldx);
  const uint16_t* w13 = reinterpret_cast<const uint16_t*>(w13p.data_ptr<at::BFloat16>());
  const uint16_t* w2 = reinterpret_cast<const uint16_t*>(w2p.data_ptr<at::BFloat16>());
  const float* wts = topk_weights.data_ptr<float>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int num_threads = sched.threads(pairs * ip * (2 * h + hp));

#pragma omp parallel num_threads(num_threads)
  {
    const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const auto up_run = ExpertSchedule::run_of(sched.up_cost, tid, nt);
    const auto down_run = ExpertSchedule::run_of(sched.down_cost, tid, nt);
    auto up_block = [&](int64_t i) { return w13 + (up_items[i].first * nb + up_items[i].second) * h2 * 64; };
    auto down_block = [&](int64_t i) { return w2 + (down_items[i].first * hb + down_items[i].second) * (ip / 2) * 64; };
    for (int64_t i = up_run.first; i < up_run.second; ++i) {
      const int64_t ex = up_items[i].first, b = up_items[i].second;
      const int64_t s0 = start[ex], n = start[ex + 1] - s0;
      const int64_t valid = std::clamp<int64_t>(inter - b * 16, 0, 16);
      const uint16_t* nxt = i + 1 < up_run.second ? up_block(i + 1) : nullptr;
      // The run's last item: this thread's first block of the down phase.
      if (nxt == nullptr && down_run.first < down_run.second) nxt = down_block(down_run.first);
      NextBlock next(nxt, n, 8, 128);
      gate_up_rows_bf16<8>(xrows.data() + s0, w13 + (ex * nb + b) * h2 * 64, h2, act + s0 * ip + b * 16, ip, valid,
                           n, next);
    }
#pragma omp barrier
    for (int64_t i = down_run.first; i < down_run.second; ++i) {
      const int64_t ex = down_items[i].first, b = down_items[i].second;
      const int64_t s0 = start[ex], n = start[ex + 1] - s0;
      NextBlock next(i + 1 < down_run.second ? down_block(i + 1) : nullptr, n, 8, 128);
      down_rows_bf16<8>(act + s0 * ip, ip, w2 + (ex * hb + b) * (ip / 2) * 64, ip / 2, y + s0 * hp + b * 32, hp, n,
                        next);
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t tok = 0; tok < t; ++tok) {
      const float* rows[64];
      float w[64];
      const int64_t kk = token_rows_in_expert_order(ids, wts, slot, y, hp, tok, k, rows, w);
      combine_row_bf16(rows, w, kk, h, op + tok * h);
    }
  }
#endif
  return out;
}

// ------------------------------------------------------------------------------------------------ routing
// moe_cpu_route: per token the router's logits (x . router row e, float32 sums: 16 partial sums over h in
// order, added in order, then the h % 16 tail; rounded to x's dtype, as F.linear's output is), softmax over the
// float32 logits (max subtracted, std::exp, one sum in expert order), the top_k largest (ties: the lower expert
// id first; descending), then with `renormalize` each divided by their sum (in that order), with `round_weights`
// rounded to x's dtype (Qwen3-MoE), returned as float32. Why: the router as F.linear plus route()'s six torch
// ops cost 85-160 us a layer at decode (bf16 F.linear with 8 outputs alone ~95 us) for a [64, 256] x [256, 8]
// product; this is ~5 us. Its sums run in another order than MKL's/oneDNN's: logits move by ~1 ulp, the
// weights by ~1e-7 relative, as the expert op's sums already do (float32 greedy tokens still HF's:
// tests/test_moe.py).
template <typename T>
void route_rows(const T* x, int64_t ldx, const T* r, int64_t e, int64_t h, int64_t k, bool renormalize,
                bool round_weights, float* wout, int64_t* iout, int64_t t0, int64_t t1) {
  constexpr bool kBf16 = std::is_same_v<T, c10::BFloat16>;
  std::vector<float> logits(e), xf(h);
  for (int64_t t = t0; t < t1; ++t) {
    const T* xt = x + t * ldx;
    for (int64_t i = 0; i < h; ++i) xf[i] = static_cast<float>(xt[i]);
    for (int64_t ex = 0; ex < e; ++ex) {
      const T* re = r + ex * h;
      float acc[16] = {};
      int64_t i = 0;
      for (; i + 16 <= h; i += 16) {
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) acc[j] += xf[i + j] * static_cast<float>(re[i + j]);
      }
      float sum = 0.0f;
      for (int j = 0; j < 16; ++j) sum += acc[j];
      for (; i < h; ++i) sum += xf[i] * static_cast<float>(re[i]);
      logits[ex] = kBf16 ? static_cast<float>(c10::BFloat16(sum)) : sum;
    }
    float mx = logits[0];
    for (int64_t ex = 1; ex < e; ++ex) mx = std::max(mx, logits[ex]);
    float total = 0.0f;
    for (int64_t ex = 0; ex < e; ++ex) {
      logits[ex] = std::exp(logits[ex] - mx);
      total += logits[ex];
    }
    float* wt = wout + t * k;
    int64_t* it = iout + t * k;
    for (int64_t j = 0; j < k; ++j) {  // selection: k <= E is small
      int64_t best = -1;
      for (int64_t ex = 0; ex < e; ++ex) {
        bool taken = false;
        for (int64_t q = 0; q < j; ++q) taken |= it[q] == ex;
        if (!taken && (best < 0 || logits[ex] > logits[best])) best = ex;
      }
      it[j] = best;
      wt[j] = logits[best] / total;
    }
    if (renormalize) {
      float s = 0.0f;
      for (int64_t j = 0; j < k; ++j) s += wt[j];
      for (int64_t j = 0; j < k; ++j) wt[j] = wt[j] / s;
    }
    if (kBf16 && round_weights) {
      for (int64_t j = 0; j < k; ++j) wt[j] = static_cast<float>(c10::BFloat16(wt[j]));
    }
  }
}

std::tuple<at::Tensor, at::Tensor> moe_cpu_route(const at::Tensor& x, const at::Tensor& router, int64_t top_k,
                                                 bool renormalize, bool round_weights) {
  check_cpu(x, "x");
  check_cpu(router, "router");
  check_dim(x, 2, "x");
  check_dim(router, 2, "router");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                   msg("moe_cpu_route: x must be float32 or bfloat16, got ", x.scalar_type()));
  check_dtype(router, x.scalar_type(), "router");
  check_contiguous(router, "router");
  const int64_t t = x.size(0), h = x.size(1), e = router.size(0);
  TORCH_CHECK_VALUE(router.size(1) == h, msg("moe_cpu_route: router must be [E, ", h, "], got ", router.sizes()));
  TORCH_CHECK_VALUE(top_k > 0 && top_k <= e && top_k <= 64,
                    msg("moe_cpu_route: top_k=", top_k, " must be in [1, min(E=", e, ", 64)]"));
  TORCH_CHECK_VALUE(x.stride(1) == 1 || h <= 1, msg("moe_cpu_route: x's rows must be contiguous"));
  at::Tensor w = at::empty({t, top_k}, x.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({t, top_k}, x.options().dtype(at::kLong));
  if (t == 0) return {w, ids};
  float* wp = w.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t ldx = x.stride(0);
  // Tokens are independent: the same result on any thread count.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, e * h));
  at::parallel_for(0, t, grain, [&](int64_t t0, int64_t t1) {
    if (x.scalar_type() == at::kFloat) {
      route_rows<float>(x.data_ptr<float>(), ldx, router.data_ptr<float>(), e, h, top_k, renormalize, round_weights,
                        wp, ip, t0, t1);
    } else {
      route_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), ldx, router.data_ptr<c10::BFloat16>(), e, h, top_k,
                                renormalize, round_weights, wp, ip, t0, t1);
    }
  });
  return {w, ids};
}

}  // namespace
}  // namespace vllm_lite

TORCH_LIBRARY_FRAGMENT(vllm_lite, m) {
  m.def(
      "moe_cpu_route(Tensor x, Tensor router, int top_k, bool renormalize, bool round_weights) -> (Tensor, Tensor)");
  m.def("moe_cpu_block_width() -> int", &vllm_lite::moe_cpu_block_width);
  m.def("moe_cpu_prefetch(bool enable) -> bool", &vllm_lite::moe_cpu_prefetch);
  m.def("moe_cpu_pack(Tensor w13, Tensor w2) -> (Tensor, Tensor)");
  m.def(
      "moe_cpu_experts(Tensor x, Tensor w13p, Tensor w2p, Tensor topk_weights, Tensor topk_ids, int inter) -> "
      "Tensor");
  m.def("moe_cpu_bf16_built() -> bool", &vllm_lite::moe_cpu_bf16_built);
  m.def("moe_cpu_pack_bf16(Tensor w13, Tensor w2) -> (Tensor, Tensor)");
  m.def(
      "moe_cpu_experts_bf16(Tensor x, Tensor w13p, Tensor w2p, Tensor topk_weights, Tensor topk_ids, int inter) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(vllm_lite, CPU, m) {
  m.impl("moe_cpu_pack", &vllm_lite::moe_cpu_pack);
  m.impl("moe_cpu_experts", &vllm_lite::moe_cpu_experts);
  m.impl("moe_cpu_pack_bf16", &vllm_lite::moe_cpu_pack_bf16);
  m.impl("moe_cpu_experts_bf16", &vllm_lite::moe_cpu_experts_bf16);
  m.impl("moe_cpu_route", &vllm_lite::moe_cpu_route);
}
