// bfloat16 linear for the few-row forwards of decode and speculative verification on CPUs with AVX512-BF16
// (Zen 4, Sapphire Rapids):
//   bf16_linear_small_m(x [M, K], weight_blocked, n, bias [N]?) -> y [M, N], bfloat16, M <= kMaxRows (16).
// The weight is laid out once, at load time (vllm_lite/worker/models/cpu_prepack.py), as
// [N/4, K/32, 4, 32]: for each group of 4 output rows (a "tile"), their 32-wide slices of K one after another,
// so a thread streams its share of the weight front to back.
//
// Why: at M = 1 a decode step only streams the weights. On a 2-core Zen 4 (benchmarks/PROFILE.md, "Zen 4")
// oneDNN's prepacked bf16 GEMV read the bench model's weights at 10-13 GB/s on one core and 15-19 on two;
// this loop reads them faster (benchmarks/linear_small_m.py measures both at 1-16 rows).
//
// The loop: for each tile, the rows of x in passes of up to 4 (balanced: 6 rows = 3 + 3, 16 = 4 x 4), each pass
// a 4 rows x 4 columns block of VDPBF16PS accumulators over all of K; the first pass streams the tile from
// memory, later passes find it in cache. While a tile is computed, the next tile is prefetched (into L2, spread
// over the passes), so the memory stream overlaps the compute instead of alternating with it: without that the
// kernel lost to oneDNN at 4+ rows. The 16 accumulators of a block are reduced together by a transpose-add tree
// and the 16 outputs rounded to bfloat16 in one vector.
//
// Numerics: each output is one float32 sum (VDPBF16PS lanes, then the tree), plus the bias in float32, rounded
// once to bfloat16 (round to nearest even, as c10::BFloat16): F.linear's math summed in another order, so an
// output can differ from oneDNN's in the last bfloat16 bit. Each output is computed by one thread in a fixed
// order, so results do not depend on the thread count or on the other rows. Tiles are split over torch's
// intra-op threads. Built only where the compiler targets AVX512-BF16 (-march=native); elsewhere
// bf16_small_m_available() is false and callers keep oneDNN.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VLLM_LITE_BF16_SMALL_M 1
#endif

#include "cpu_common.h"
#include "ops.h"
#include "cpu_vec.h"

namespace vllm_lite {
namespace {

constexpr int64_t kRowsPerGroup = 4;  // output rows interleaved per group (the 4 in [N/4, K/32, 4, 32])
constexpr int64_t kKChunk = 32;       // bf16 lanes of one 512-bit register
constexpr int64_t kMaxRows = 16;      // x rows accepted (decode batches, speculative verification); more: oneDNN
constexpr int64_t kRowsPerPass = 4;   // x rows per register block (4 x 4 accumulators)
constexpr int64_t kVnniBlockN = 32;   // bf16_linear_vnni: outputs per weight block ([N/32, K/2, 32, 2])
constexpr int64_t kGateUpBlock = 16;  // the gate_up ops: gate and up outputs interleaved in blocks of 16

// Where the gate_up ops' results go (see "gate_up with SiLU-and-mul" below).
struct GateUpOut {
  c10::BFloat16* out;
  int64_t ld;       // out's row stride: d with SiLU, else 2d
  int64_t d;        // the true intermediate size
  int64_t vec_end;  // silu_vec_end(d)
  bool silu;        // silu(gate) * up, else both halves
  const float* silu_table = nullptr;  // cpu_vec.h's silu_bf16_table where the vector columns take it
};

// A plain linear's bias as the kernels read it, in place: bfloat16 (the model's dtype, widened exactly as
// bias.to(float32) widens it, a 16-bit shift) or float32; null for none. Read in the loop, so a call converts and
// allocates nothing for it (a per-call bias.to(float32) was one aten::_to_copy per linear, ~18 us for the qkv
// projection's at decode).
struct BiasRef {
  const void* p = nullptr;
  bool bf16 = false;
};

// The VNNI weight the calling thread's next VNNI call will read (set_vnni_next_weight; base null: none).
struct VnniNext {
  const char* base = nullptr;
  int64_t blocks = 0;       // weight blocks of 32 outputs
  int64_t block_bytes = 0;  // 64 K
};
thread_local VnniNext t_vnni_next;

// The first block a thread takes of a grain-1 at::parallel_for over `blocks` blocks on `threads` threads (its
// OpenMP split: min(threads, blocks) threads, thread t from t * ceil(blocks / threads)); `blocks` where it takes
// none. The VNNI ops split their weight blocks so.
int64_t thread_first_block(int64_t blocks, int64_t threads, int64_t thread) {
  const int64_t nt = std::min(threads, blocks);
  if (nt <= 0) return blocks;
  return std::min(blocks, thread * ((blocks + nt - 1) / nt));
}

#ifdef VLLM_LITE_BF16_SMALL_M

static inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// Bias outputs j..j+3 / j..j+15 as float32 (zeros without a bias).
static inline __m128 bias4(const BiasRef& b, int64_t j) {
  if (!b.p) return _mm_setzero_ps();
  if (!b.bf16) return _mm_loadu_ps(static_cast<const float*>(b.p) + j);
  const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(b.p) + j));
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
}

static inline __m512 bias16(const BiasRef& b, int64_t j) {
  if (!b.p) return _mm512_setzero_ps();
  if (!b.bf16) return _mm512_loadu_ps(static_cast<const float*>(b.p) + j);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(b.p) + j));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 4 accumulators -> one register whose 128-bit block i holds 4 partial sums of accumulator i.
static inline __m512 fold4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

// 4 folded registers t_r (block m: partials of row m, column r) -> element 4 * m + r = the sum of row m, column r.
static inline __m512 fold_columns(__m512 t0, __m512 t1, __m512 t2, __m512 t3) {
  const __m512 u01 = _mm512_add_ps(_mm512_unpacklo_ps(t0, t1), _mm512_unpackhi_ps(t0, t1));
  const __m512 u23 = _mm512_add_ps(_mm512_unpacklo_ps(t2, t3), _mm512_unpackhi_ps(t2, t3));
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u01), _mm512_castps_pd(u23))),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u01), _mm512_castps_pd(u23))));
}

// float32 -> bfloat16 bits for 16 lanes, as c10::BFloat16(float): round to nearest even, NaN -> 0x7FC0.
static inline __m256i to_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// out[m][0..3] = x[m] . w[tile rows] + bias4 for MM (<= 4) rows of x, over one tile of 4 weight rows.
// Meanwhile prefetches this pass's share of the next tile (`next`, null for none): pass `pass` of `passes`.
template <int MM>
static inline void block_dots(const uint16_t* __restrict w, int64_t chunks, const uint16_t* __restrict x, int64_t k,
                              __m512 bias4, c10::BFloat16* __restrict out, int64_t n, const char* next, int64_t pass,
                              int64_t passes) {
  constexpr int R = static_cast<int>(kRowsPerGroup);
  __m512 acc[kRowsPerPass][R];
  for (int m = 0; m < kRowsPerPass; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    if (next) {  // the next tile's 4 * chunks cache lines, spread evenly over all passes' iterations
      const int64_t i = pass * chunks + c;
      for (int64_t l = i * R / passes, end = (i + 1) * R / passes; l < end; ++l)
        _mm_prefetch(next + l * 64, _MM_HINT_T1);
    }
    const uint16_t* wc = w + c * R * kKChunk;
    __m512i wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_si512(wc + r * kKChunk);
    for (int m = 0; m < MM; ++m) {
      const __m512i xv = _mm512_loadu_si512(x + m * k + c * kKChunk);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], as_bh(xv), as_bh(wv[r]));
    }
  }
  __m512 t[R];
  for (int r = 0; r < R; ++r) t[r] = fold4(acc[0][r], acc[1][r], acc[2][r], acc[3][r]);
  const __m256i o = to_bf16_bits(_mm512_add_ps(fold_columns(t[0], t[1], t[2], t[3]), bias4));
  alignas(32) uint64_t rows4[4];  // row m's 4 bfloat16 outputs
  _mm256_store_si256(reinterpret_cast<__m256i*>(rows4), o);
  for (int m = 0; m < MM; ++m) std::memcpy(out + m * n, &rows4[m], sizeof(rows4[m]));
}

// One tile of 4 weight rows over all `rows` rows of x, in `passes` balanced passes of <= 4 rows (6 rows = 3 + 3):
// row m's 4 outputs go to out + m * ld. The plain and the gate_up small-m kernels share it.
static inline void tile_passes(const uint16_t* __restrict w, int64_t chunks, const uint16_t* __restrict xp,
                               int64_t rows, int64_t k, __m512 bias4, c10::BFloat16* __restrict out, int64_t ld,
                               const char* next, int64_t passes) {
  int64_t m0 = 0;
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t mm = (rows - m0 + (passes - p) - 1) / (passes - p);
    const uint16_t* xm = xp + m0 * k;
    c10::BFloat16* o = out + m0 * ld;
    switch (mm) {
      case 1: block_dots<1>(w, chunks, xm, k, bias4, o, ld, next, p, passes); break;
      case 2: block_dots<2>(w, chunks, xm, k, bias4, o, ld, next, p, passes); break;
      case 3: block_dots<3>(w, chunks, xm, k, bias4, o, ld, next, p, passes); break;
      default: block_dots<4>(w, chunks, xm, k, bias4, o, ld, next, p, passes); break;
    }
    m0 += mm;
  }
}

// Tiles are computed in groups of kStoreTiles (32 outputs): each tile's 4 x 4 block goes to a buffer in L1, then
// each row's 32 outputs to `out` as one 64-byte store, instead of 8 bytes into each of up to 16 rows a row stride
// apart per tile (as the gate_up kernel below stages its blocks): 10-15% faster at 4-12 rows. A single row
// goes straight to `out` (its tiles' outputs are adjacent anyway).
constexpr int64_t kStoreTiles = 8;
constexpr int64_t kStoreWidth = kStoreTiles * kRowsPerGroup;

void run(const at::Tensor& x, const at::Tensor& wb, int64_t n, const BiasRef& bias, at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), chunks = k / kKChunk;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(wb.data_ptr<c10::BFloat16>());
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t group_elems = chunks * kRowsPerGroup * kKChunk;
  const int64_t passes = (rows + kRowsPerPass - 1) / kRowsPerPass;
  const int64_t tiles = n / kRowsPerGroup, spans = (tiles + kStoreTiles - 1) / kStoreTiles;
  const bool direct = rows == 1;  // one row's tiles are contiguous already: straight to `out`
  const int64_t ld = direct ? n : kStoreWidth;
  at::parallel_for(0, spans, 16 / kStoreTiles, [&](int64_t s0, int64_t s1) {
    alignas(64) c10::BFloat16 buf[kMaxRows * kStoreWidth];  // row m: the span's outputs for row m
    const int64_t g_end = std::min(s1 * kStoreTiles, tiles);
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t t0 = s * kStoreTiles, t1 = std::min(t0 + kStoreTiles, tiles);
      for (int64_t g = t0; g < t1; ++g) {
        const uint16_t* w = wp + g * group_elems;
        const __m512 b4 = _mm512_broadcast_f32x4(bias4(bias, g * kRowsPerGroup));
        const char* next = g + 1 < g_end ? reinterpret_cast<const char*>(w + group_elems) : nullptr;
        c10::BFloat16* o = direct ? op + g * kRowsPerGroup : buf + (g - t0) * kRowsPerGroup;
        tile_passes(w, chunks, xp, rows, k, b4, o, ld, next, passes);
      }
      if (direct) continue;
      c10::BFloat16* o = op + t0 * kRowsPerGroup;
      if (t1 - t0 == kStoreTiles) {
        for (int64_t m = 0; m < rows; ++m)
          _mm512_storeu_si512(o + m * n, _mm512_load_si512(buf + m * kStoreWidth));
      } else {
        for (int64_t m = 0; m < rows; ++m)
          std::memcpy(o + m * n, buf + m * kStoreWidth, (t1 - t0) * kRowsPerGroup * sizeof(c10::BFloat16));
      }
    }
  });
}

// ---- 13-64 rows: a broadcast (VNNI) GEMM over a third layout of the weight, [N/32, K/2, 32, 2] ----
// Each 32-output block's pairs of K one after another: per pair of K, two registers hold the 32 outputs' bf16
// pairs, and every row of x adds its own broadcast pair to 2 accumulators (VDPBF16PS). Rows go in balanced
// register blocks of <= 12 (24 accumulators), each block re-reading the weight block from L1/L2. Every output is
// one float32 sum in K order, rounded once to bf16 (as c10::BFloat16 rounds): a row's result does not depend on
// the other rows or on the thread count.
// While a block is computed, the thread's next block is prefetched into L2, half of its lines in each of the first
// two passes (one line a pair of K), or all in the first where there is one pass (two lines a pair). Prefetching
// it all in the first pass (two lines a pair) cost ~1-2% of the 32-row decode linears and LM head streaming from
// DRAM, and a pass's loop that tested for the prefetch every pair of K ~2-3% more than loops compiled with and
// without it (benchmarks/PROFILE.md, "Fifteenth session, helper KV").
constexpr int64_t kVnniBlock = kVnniBlockN;
constexpr int64_t kVnniMaxPass = 12;  // rows per register block

// A pass's prefetch of the next block: none, two 64-byte lines a pair of K, or one.
enum VnniPrefetch : int { kPrefetchNone = 0, kPrefetchTwo = 1, kPrefetchOne = 2 };

// Stores a row's two accumulators (outputs 0-15 and 16-31 of the block): bf16_linear_vnni's plain rows.
struct VnniRowStore {
  c10::BFloat16* out;
  int64_t n;
  void operator()(int m, __m512 a0, __m512 a1) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * n), to_bf16_bits(a0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * n + 16), to_bf16_bits(a1));
  }
};

template <int MB, int PF, typename Store>
static void vnni_block(const uint16_t* __restrict w, int64_t k2n, const uint16_t* __restrict x, int64_t k,
                       __m512 b0, __m512 b1, const char* pf, const Store& store) {
  __m512 acc[MB][2];
  for (int m = 0; m < MB; ++m) {
    acc[m][0] = b0;
    acc[m][1] = b1;
  }
  for (int64_t k2 = 0; k2 < k2n; ++k2) {
    if (PF == kPrefetchTwo) {
      _mm_prefetch(pf + k2 * 128, _MM_HINT_T1);
      _mm_prefetch(pf + k2 * 128 + 64, _MM_HINT_T1);
    } else if (PF == kPrefetchOne) {
      _mm_prefetch(pf + k2 * 64, _MM_HINT_T1);
    }
    const __m512i w0 = _mm512_loadu_si512(w + k2 * 64);
    const __m512i w1 = _mm512_loadu_si512(w + k2 * 64 + 32);
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * k + 2 * k2, sizeof(pair));
      const __m512i xb = _mm512_set1_epi32(pair);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], as_bh(xb), as_bh(w0));
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], as_bh(xb), as_bh(w1));
    }
  }
  for (int m = 0; m < MB; ++m) store(m, acc[m][0], acc[m][1]);
}

template <typename Store>
using VnniFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, __m512, __m512, const char*,
                        const Store&);

// The kernel for a register block of mb (1 to kVnniMaxPass) rows and a prefetch mode.
template <int PF, typename Store>
static VnniFn<Store> vnni_fn_pf(int64_t mb) {
  static const VnniFn<Store> fns[kVnniMaxPass + 1] = {
      nullptr,
      &vnni_block<1, PF, Store>,
      &vnni_block<2, PF, Store>,
      &vnni_block<3, PF, Store>,
      &vnni_block<4, PF, Store>,
      &vnni_block<5, PF, Store>,
      &vnni_block<6, PF, Store>,
      &vnni_block<7, PF, Store>,
      &vnni_block<8, PF, Store>,
      &vnni_block<9, PF, Store>,
      &vnni_block<10, PF, Store>,
      &vnni_block<11, PF, Store>,
      &vnni_block<12, PF, Store>};
  return fns[mb];
}

template <typename Store>
static VnniFn<Store> vnni_fn(int64_t mb, int pf) {
  switch (pf) {
    case kPrefetchTwo: return vnni_fn_pf<kPrefetchTwo, Store>(mb);
    case kPrefetchOne: return vnni_fn_pf<kPrefetchOne, Store>(mb);
    default: return vnni_fn_pf<kPrefetchNone, Store>(mb);
  }
}

// One weight block (k2n pairs of K, 32 outputs) over all `rows` rows of x in balanced passes of <= kVnniMaxPass
// rows (32 rows = 11 + 11 + 10), prefetching `next` (null: none) as the comment above says. store_for(m0) gives
// the Store of the pass whose first row is m0.
template <typename StoreFor>
static inline void vnni_passes(const uint16_t* w, int64_t k2n, const uint16_t* xp, int64_t rows, int64_t k, __m512 b0,
                               __m512 b1, const char* next, const StoreFor& store_for) {
  const int64_t passes = (rows + kVnniMaxPass - 1) / kVnniMaxPass;
  int64_t m0 = 0;
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t mb = (rows - m0 + (passes - p) - 1) / (passes - p);
    int pf = kPrefetchNone;
    const char* pf_at = nullptr;
    if (next != nullptr && p < 2) {
      pf = passes == 1 ? kPrefetchTwo : kPrefetchOne;
      pf_at = next + p * k2n * 64;  // the block is 2 * k2n lines: the first half, then the second
    }
    const auto store = store_for(m0);
    vnni_fn<std::decay_t<decltype(store)>>(mb, pf)(w, k2n, xp + m0 * k, k, b0, b1, pf_at, store);
    m0 += mb;
  }
}

// Where a thread's last block of this call prefetches (vnni_passes' `next`): the first block the same thread will
// take of the next VNNI call's weight (t_vnni_next, read by the calling thread before the region), by
// at::parallel_for's OpenMP split of that call's blocks at grain 1 (min(threads, blocks) threads, thread t from
// t * ceil(blocks / threads)); null where there is none or `lines` lines from it would leave that weight.
struct NextCall {
  VnniNext w = t_vnni_next;
  int64_t threads = at::get_num_threads();
  const char* first_block(int64_t lines) const {
    if (w.base == nullptr) return nullptr;
    const int64_t off = thread_first_block(w.blocks, threads, at::get_thread_num()) * w.block_bytes;
    return off + lines * 64 <= w.blocks * w.block_bytes ? w.base + off : nullptr;
  }
};

void run_vnni(const at::Tensor& x, const at::Tensor& wv, int64_t n, const BiasRef& bias, at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), k2n = k / 2;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(wv.data_ptr<c10::BFloat16>());
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t block_elems = k * kVnniBlock;
  const NextCall next_call;
  at::parallel_for(0, n / kVnniBlock, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint16_t* w = wp + g * block_elems;
      const __m512 b0 = bias16(bias, g * kVnniBlock), b1 = bias16(bias, g * kVnniBlock + 16);
      const char* next = g + 1 < g1 ? reinterpret_cast<const char*>(w + block_elems) : next_call.first_block(k);
      vnni_passes(w, k2n, xp, rows, k, b0, b1, next,
                  [&](int64_t m0) { return VnniRowStore{op + m0 * n + g * kVnniBlock, n}; });
    }
  });
}

// ---- gate_up with SiLU-and-mul in the epilogue (bf16_gate_up_small_m / bf16_gate_up_vnni) ----
// Both kernels above, over a copy of a gated MLP's gate_up weight [2d, K] whose rows are interleaved by blocks of
// kGateUpBlock (cpu_prepack.interleave_gate_up): gate rows [16b, 16b + 16), then up rows [16b, 16b + 16), for
// b < ceil(d / 16), rows past d zero. So gate output j and up output d + j come out of the same block, 16 of
// each: the epilogue rounds both to bf16 (as the gate_up tensor would hold them) and writes silu(gate) * up
// with cpu_vec.h's element rule (the one fused_silu_and_mul applies, SLEEF's exp for the elements torch's
// vector loop covers, std::exp for the rest), or, without SiLU, both halves where the plain kernel puts them.
// A block's sums are the plain kernel's for those outputs (a sum does not depend on its column's position), so
// the results are bit for bit gate_up through the plain kernel then fused_silu_and_mul, without the [rows, 2d]
// tensor written and read back.
// The first `len` (<= 16) bf16 of v's lanes to p.
static inline void store_bf16(c10::BFloat16* p, __m512 v, int64_t len) {
  const __m256i h = to_bf16_bits(v);
  if (len == kGateUpBlock) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  } else {
    alignas(32) uint16_t tmp[kGateUpBlock];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), h);
    std::memcpy(p, tmp, len * sizeof(uint16_t));
  }
}

// Row m of block b: g and u hold gate outputs 16b.. and up outputs d + 16b.., rounded to bf16.
static inline void gate_up_store(const GateUpOut& o, int64_t m, int64_t b, __m512 g, __m512 u) {
  using T = c10::BFloat16;
  const int64_t j0 = b * kGateUpBlock, len = std::min<int64_t>(kGateUpBlock, o.d - j0);
  T* row = o.out + m * o.ld;
  if (!o.silu) {
    store_bf16(row + j0, g, len);
    store_bf16(row + o.d + j0, u, len);
  } else if (j0 < o.vec_end) {  // vec_end is a multiple of 64: the whole block is in torch's vector loop
    store_bf16(row + j0, o.silu_table != nullptr ? silu_mul_lut(o.silu_table, g, u) : silu_mul_vec<T>(g, u), len);
  } else {
    alignas(64) float gf[kGateUpBlock], uf[kGateUpBlock];
    _mm512_store_ps(gf, g);
    _mm512_store_ps(uf, u);
    for (int64_t i = 0; i < len; ++i) store_f32(silu_mul_scalar<T>(gf[i], uf[i]), row + j0 + i);
  }
}

static inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
}

// <= 12 rows: the small-m kernel's tiles, 8 to a block (4 of gate, 4 of up), each tile's 4 x 4 outputs rounded
// into a block buffer in L1, then the epilogue per row.
void run_gate_up_small_m(const at::Tensor& x, const at::Tensor& wb, const BiasRef& bias, const GateUpOut& o) {
  const int64_t rows = x.size(0), k = x.size(1), chunks = k / kKChunk;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(wb.data_ptr<c10::BFloat16>());
  const int64_t group_elems = chunks * kRowsPerGroup * kKChunk;
  const int64_t passes = (rows + kRowsPerPass - 1) / kRowsPerPass;
  constexpr int64_t kTiles = 2 * kGateUpBlock / kRowsPerGroup, kBuf = 2 * kGateUpBlock;
  at::parallel_for(0, wb.size(0) / kTiles, 16 / kTiles, [&](int64_t b0, int64_t b1) {
    alignas(64) c10::BFloat16 buf[kMaxRows * kBuf];  // row m: 16 gate outputs, then 16 up outputs
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t t = 0; t < kTiles; ++t) {
        const int64_t g = b * kTiles + t;
        const uint16_t* w = wp + g * group_elems;
        const __m512 b4 = _mm512_broadcast_f32x4(bias4(bias, g * kRowsPerGroup));
        const char* next = g + 1 < b1 * kTiles ? reinterpret_cast<const char*>(w + group_elems) : nullptr;
        tile_passes(w, chunks, xp, rows, k, b4, buf + t * kRowsPerGroup, kBuf, next, passes);
      }
      for (int64_t m = 0; m < rows; ++m)
        gate_up_store(o, m, b, Vec::load(buf + m * kBuf), Vec::load(buf + m * kBuf + kGateUpBlock));
    }
  });
}

// A VNNI register block's rows straight from its accumulators (block b: outputs 0-15 gate, 16-31 up).
struct VnniGateUpStore {
  const GateUpOut* o;
  int64_t m0, b;
  void operator()(int m, __m512 a0, __m512 a1) const { gate_up_store(*o, m0 + m, b, round_bf16(a0), round_bf16(a1)); }
};

void run_gate_up_vnni(const at::Tensor& x, const at::Tensor& wv, const BiasRef& bias, const GateUpOut& o) {
  const int64_t rows = x.size(0), k = x.size(1), k2n = k / 2;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(wv.data_ptr<c10::BFloat16>());
  const int64_t block_elems = k * kVnniBlock;
  const NextCall next_call;
  at::parallel_for(0, wv.size(0), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint16_t* w = wp + g * block_elems;
      const __m512 b0 = bias16(bias, g * kVnniBlock), b1 = bias16(bias, g * kVnniBlock + 16);
      const char* next = g + 1 < g1 ? reinterpret_cast<const char*>(w + block_elems) : next_call.first_block(k);
      vnni_passes(w, k2n, xp, rows, k, b0, b1, next, [&](int64_t m0) { return VnniGateUpStore{&o, m0, g}; });
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

// The plain ops' bias: [n] on the CPU, read in place where it is contiguous bfloat16 or float32, else converted to
// float32 into `copy` (another dtype, a strided view).
BiasRef bias_ref(const char* name, const c10::optional<at::Tensor>& bias, int64_t n, at::Tensor& copy) {
  if (!bias.has_value()) return {};
  check_cpu(*bias, "bias");
  TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, msg(name, ": bias must be [", n, "], got ", bias->sizes()));
  const at::ScalarType dt = bias->scalar_type();
  if (bias->is_contiguous() && (dt == at::kBFloat16 || dt == at::kFloat)) {
    return {bias->data_ptr(), dt == at::kBFloat16};
  }
  copy = bias->to(at::kFloat).contiguous();
  return {copy.data_ptr(), false};
}

// A weight copy's layout, [N / n_block, K / k_block, n_block, k_block], and the rows of x its op takes.
struct Layout {
  const char* weight;  // the op's name for it
  int64_t n_block, k_block;
  const char* k_rule;  // "K " + this: what K must be
  int64_t max_rows;    // 0: any
};
constexpr Layout kBlockedLayout{"weight_blocked", kRowsPerGroup, kKChunk, "of 32", kMaxRows};
constexpr Layout kVnniLayout{"weight_vnni", kVnniBlockN, 2, "even", 0};
static_assert(kKChunk == 32, "kBlockedLayout's k_rule");

// Every op's checks of x and the weight copy, run before any data is read and before the parallel loop (whose body
// cannot throw): x [M, K] bf16 on the CPU, the copy contiguous bf16 in `l`'s shape for K, and for `n` outputs
// where n >= 0 (the plain ops; the gate_up ops take N from the copy and check it against d).
void check_args(const char* name, const at::Tensor& x, const at::Tensor& w, const Layout& l, int64_t n) {
  TORCH_CHECK(bf16_small_m_available(), msg(name, ": not built for this CPU (needs AVX512-BF16)"));
  check_cpu(x, "x");
  check_cpu(w, l.weight);
  check_dtype(x, at::kBFloat16, "x");
  check_dtype(w, at::kBFloat16, l.weight);
  check_dim(x, 2, "x");
  check_dim(w, 4, l.weight);
  check_contiguous(w, l.weight);
  const int64_t k = x.size(1), nb = l.n_block, kb = l.k_block;
  const bool k_ok = k > 0 && k % kb == 0;
  if (n >= 0) {
    TORCH_CHECK_VALUE(n > 0 && n % nb == 0 && k_ok, msg(name, ": needs N a positive multiple of ", nb, " and K ",
                                                         l.k_rule, ", got N = ", n, ", K = ", k));
    TORCH_CHECK_VALUE(w.size(0) == n / nb && w.size(1) == k / kb && w.size(2) == nb && w.size(3) == kb,
                      msg(name, ": ", l.weight, " must be [", n / nb, ", ", k / kb, ", ", nb, ", ", kb, "], got ",
                          w.sizes()));
  } else {
    TORCH_CHECK_VALUE(k_ok && w.size(1) == k / kb && w.size(2) == nb && w.size(3) == kb,
                      msg(name, ": ", l.weight, " must be [N/", nb, ", ", k / kb, ", ", nb, ", ", kb, "] for K = ", k,
                          " (K ", l.k_rule, "), got ", w.sizes()));
  }
  if (l.max_rows > 0) {
    TORCH_CHECK_VALUE(x.size(0) <= l.max_rows, msg(name, ": at most ", l.max_rows, " rows of x, got ", x.size(0)));
  }
}

at::Tensor bf16_linear_small_m(const at::Tensor& x, const at::Tensor& weight_blocked, int64_t n,
                               const c10::optional<at::Tensor>& bias) {
  check_args("bf16_linear_small_m", x, weight_blocked, kBlockedLayout, n);
  at::Tensor bias_copy;
  const BiasRef b = bias_ref("bf16_linear_small_m", bias, n, bias_copy);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({xc.size(0), n}, xc.options());
  if (xc.size(0) == 0) return out;
#ifdef VLLM_LITE_BF16_SMALL_M
  run(xc, weight_blocked, n, b, out);
#endif
  return out;
}

at::Tensor bf16_linear_vnni(const at::Tensor& x, const at::Tensor& weight_vnni, int64_t n,
                            const c10::optional<at::Tensor>& bias) {
  check_args("bf16_linear_vnni", x, weight_vnni, kVnniLayout, n);
  at::Tensor bias_copy;
  const BiasRef b = bias_ref("bf16_linear_vnni", bias, n, bias_copy);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({xc.size(0), n}, xc.options());
  if (xc.size(0) == 0) return out;
#ifdef VLLM_LITE_BF16_SMALL_M
  run_vnni(xc, weight_vnni, n, b, out);
#endif
  return out;
}

// The gate_up ops' shared checks and set-up: the interleaved copy's width against d, the bias interleaved like
// the weight (float32, zeros in the padding), the output.
struct GateUpCall {
  at::Tensor x, bias_f, out;
  BiasRef bias;  // bias_f's
  GateUpOut o;
};

GateUpCall gate_up_call(const char* name, const at::Tensor& x, int64_t n_pad, int64_t d,
                        const c10::optional<at::Tensor>& bias, bool silu_and_mul) {
  const int64_t d_pad = (d + kGateUpBlock - 1) / kGateUpBlock * kGateUpBlock;
  TORCH_CHECK_VALUE(d > 0 && n_pad == 2 * d_pad,
                    msg(name, ": the interleaved weight has ", n_pad, " outputs; d = ", d, " needs ", 2 * d_pad));
  GateUpCall c;
  if (bias.has_value()) {
    check_cpu(*bias, "bias");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == 2 * d,
                      msg(name, ": bias must be [", 2 * d, "] (gate, then up), got ", bias->sizes()));
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    c.bias_f = at::zeros({n_pad}, b.options());
    const float* src = b.data_ptr<float>();
    float* dst = c.bias_f.data_ptr<float>();
    for (int64_t j = 0; j < d; ++j) {
      const int64_t pos = j / kGateUpBlock * 2 * kGateUpBlock + j % kGateUpBlock;
      dst[pos] = src[j];
      dst[pos + kGateUpBlock] = src[d + j];
    }
    c.bias = BiasRef{dst, false};
  }
  c.x = x.contiguous();
  c.out = at::empty({c.x.size(0), silu_and_mul ? d : 2 * d}, c.x.options());
  c.o = GateUpOut{c.out.data_ptr<c10::BFloat16>(), c.out.size(1), d, silu_vec_end<c10::BFloat16>(d), silu_and_mul};
#ifdef VLLM_LITE_FUSED_AVX512
  // The table's gathers in place of SLEEF's exp and a divide: ~26 us a 32-row decode call of the bench model's
  // SiLU epilogue (PROFILE.md, "Fourteenth session, helper OV"); the same bits (cpu_vec.h).
  if (silu_and_mul && c.o.vec_end > 0) c.o.silu_table = silu_bf16_table();
#endif
  return c;
}

at::Tensor bf16_gate_up_small_m(const at::Tensor& x, const at::Tensor& weight_blocked, int64_t d,
                                const c10::optional<at::Tensor>& bias, bool silu_and_mul) {
  check_args("bf16_gate_up_small_m", x, weight_blocked, kBlockedLayout, -1);
  GateUpCall c = gate_up_call("bf16_gate_up_small_m", x, weight_blocked.size(0) * kRowsPerGroup, d,
                              bias, silu_and_mul);
  if (c.x.size(0) == 0) return c.out;
#ifdef VLLM_LITE_BF16_SMALL_M
  run_gate_up_small_m(c.x, weight_blocked, c.bias, c.o);
#endif
  return c.out;
}

at::Tensor bf16_gate_up_vnni(const at::Tensor& x, const at::Tensor& weight_vnni, int64_t d,
                             const c10::optional<at::Tensor>& bias, bool silu_and_mul) {
  check_args("bf16_gate_up_vnni", x, weight_vnni, kVnniLayout, -1);
  GateUpCall c =
      gate_up_call("bf16_gate_up_vnni", x, weight_vnni.size(0) * kVnniBlockN, d, bias, silu_and_mul);
  if (c.x.size(0) == 0) return c.out;
#ifdef VLLM_LITE_BF16_SMALL_M
  run_gate_up_vnni(c.x, weight_vnni, c.bias, c.o);
#endif
  return c.out;
}

}  // namespace

void set_vnni_next_weight(const at::Tensor* weight_vnni) {
  if (weight_vnni == nullptr || !weight_vnni->defined() || weight_vnni->dim() != 4) {
    t_vnni_next = VnniNext{};
    return;
  }
  const int64_t blocks = weight_vnni->size(0);
  t_vnni_next = VnniNext{static_cast<const char*>(weight_vnni->data_ptr()), blocks,
                         blocks > 0 ? static_cast<int64_t>(weight_vnni->nbytes()) / blocks : 0};
}


// For tests: per thread t of this process's torch threads, [the first block t took in a grain-1 at::parallel_for
// over `blocks` (blocks: none), the block thread_first_block names], so the split rule the next-call prefetch
// assumes is checked against at::parallel_for itself.
std::vector<int64_t> bf16_vnni_first_blocks(int64_t blocks) {
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> taken(threads, blocks);
  at::parallel_for(0, blocks, 1, [&](int64_t g0, int64_t) { taken[at::get_thread_num()] = g0; });
  std::vector<int64_t> out;
  for (int64_t t = 0; t < threads; ++t) {
    out.push_back(taken[t]);
    out.push_back(thread_first_block(blocks, threads, t));
  }
  return out;
}
}  // namespace vllm_lite

TORCH_LIBRARY_FRAGMENT(vllm_lite, m) {
  // No tensor arguments, so no dispatch key: defined with their kernels (catch-all).
  m.def("bf16_small_m_available() -> bool", &vllm_lite::bf16_small_m_available);
  m.def("bf16_small_m_max_rows() -> int", &vllm_lite::bf16_small_m_max_rows);
  m.def("bf16_vnni_first_blocks(int blocks) -> int[]", &vllm_lite::bf16_vnni_first_blocks);
  m.def("bf16_linear_small_m(Tensor x, Tensor weight_blocked, int n, Tensor? bias) -> Tensor");
  m.def("bf16_linear_vnni(Tensor x, Tensor weight_vnni, int n, Tensor? bias) -> Tensor");
  m.def("bf16_gate_up_small_m(Tensor x, Tensor weight_blocked, int d, Tensor? bias, bool silu_and_mul) -> Tensor");
  m.def("bf16_gate_up_vnni(Tensor x, Tensor weight_vnni, int d, Tensor? bias, bool silu_and_mul) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_lite, CPU, m) {
  m.impl("bf16_linear_small_m", &vllm_lite::bf16_linear_small_m);
  m.impl("bf16_linear_vnni", &vllm_lite::bf16_linear_vnni);
  m.impl("bf16_gate_up_small_m", &vllm_lite::bf16_gate_up_small_m);
  m.impl("bf16_gate_up_vnni", &vllm_lite::bf16_gate_up_vnni);
}
