// Paged attention on CPU for vllm-lite's mixed batch (prefill chunks and decodes in one call).
//
// Work is split into items (request, KV head, tile of query tokens). An item packs the
// query heads that share its KV head (GQA) and a few query tokens into up to kRowsPerItem
// float32 rows, then streams the request's keys in small tiles gathered through the block
// table, keeping a running max/sum per row (online softmax): nothing of size [query, context]
// is ever materialised. Each key tile is converted to float32 once and reused by every row of
// the item, stored transposed so scores for a tile of keys are vector FMA chains per row.
// Three implementations of the key loop ("impl"), the fastest one this build and head size allow
// chosen by default: AVX-512 intrinsics (attention_avx512.h; head sizes 32/64/128/256, no
// soft-capping), AVX2 + FMA (attention_avx2.h; head sizes that are multiples of 8 listed in
// avx2_head_size, soft-capping included), and a portable loop for anything else.
// Which instruction sets are built follows the compiler's target (-march=native on the host that
// runs them, see cpu_kernels.py), so a path is never compiled for a CPU that lacks it.
// Decode items (one query token) of a bfloat16 cache take attention_decode_bf16.h's VDPBF16PS path instead
// wherever the AVX-512 loop would run and the build targets AVX512-BF16 (2.4-3x faster on Zen 4): there a decode
// request is one work unit with all its KV heads, and each thread runs a contiguous share of the batch's decodes
// (split by keys, inside a request where whole requests would leave a thread well over its share) as one prefetched
// stream, before the rest of the batch's items are shared out dynamically.
// Prompt items of a bfloat16 cache without a sliding window take attention_prefill_bf16.h (VDPBF16PS over query
// rows x key tiles per 256-key chunk; each token's bits are those of the decode path at its position).
// A sliding window W (query at p sees keys in (p - W, p]) starts the key stream at the first key
// any row of the item can see, so blocks before the window are never read (they may be freed).

#include "attention_avx2.h"
#include "attention_avx512.h"
#include "attention_common.h"
#include "attention_decode_bf16.h"
#include "attention_prefill_bf16.h"
#include "cpu_common.h"
#include "ops.h"

#include <ATen/Parallel.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace vllm_lite {
namespace {

using attn::ItemView;
using attn::kKeyTile;
using attn::kRowsPerItem;
using attn::Scratch;

struct WorkItem {
  int32_t req;
  int32_t q_begin;  // first query token of the tile, relative to the request
  int32_t q_end;    // one past the last
  int64_t cost;     // rough flops, to start big items first (the key loops' items)
};

// Validates the batch on the host and lists the work items into `items` (cleared first), in request order.
void plan_items(std::vector<WorkItem>& items, const at::Tensor& block_table, const at::Tensor& seq_lens,
                const at::Tensor& query_start_loc, int64_t num_tokens, int64_t block_size, int64_t num_blocks,
                int64_t tokens_per_item, int64_t window) {
  const int64_t num_reqs = seq_lens.size(0);
  const int64_t max_blocks = block_table.size(1);
  // The caller checked dims, dtypes, contiguity and that these arrays hold num_reqs (+ 1) entries, so the
  // reads below stay inside them; every value that later indexes memory is checked here, before any kernel.
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(qsl[0] >= 0, msg("query_start_loc[0] must be >= 0, got ", qsl[0]));
  TORCH_CHECK_VALUE(qsl[num_reqs] <= num_tokens, msg("query_start_loc[-1] = ", qsl[num_reqs],
                                                     " exceeds the number of query rows ", num_tokens));
  items.clear();
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t q_len = static_cast<int64_t>(qsl[b + 1]) - qsl[b];
    const int64_t s_len = sl[b];
    TORCH_CHECK_VALUE(q_len >= 0, msg("query_start_loc must be non-decreasing (request ", b, ")"));
    TORCH_CHECK_VALUE(s_len >= q_len, msg("seq_lens[", b, "] = ", s_len, " is shorter than its query length ",
                                          q_len));
    if (q_len == 0) continue;
    const int64_t need = (s_len + block_size - 1) / block_size;
    TORCH_CHECK_VALUE(need <= max_blocks, msg("seq_lens[", b, "] = ", s_len, " needs ", need,
                                              " blocks but block_table has ", max_blocks, " columns"));
    const int64_t ctx = s_len - q_len;
    // A window wider than the context reaches key 0 (window <= ctx here, so nothing below overflows).
    const int64_t win = window > ctx + q_len ? 0 : window;
    const int64_t first = win > 0 ? std::max<int64_t>(0, ctx - win + 1) / block_size : 0;
    for (int64_t j = first; j < need; ++j) {
      const int32_t blk = bt[b * max_blocks + j];
      TORCH_CHECK_VALUE(blk >= 0 && blk < num_blocks, msg("block_table[", b, ", ", j, "] = ", blk,
                                                          " is outside the cache's ", num_blocks, " blocks"));
    }
    for (int64_t s = 0; s < q_len; s += tokens_per_item) {
      const int64_t e = std::min(q_len, s + tokens_per_item);
      items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(s), static_cast<int32_t>(e),
                       (e - s) * (win > 0 ? std::min<int64_t>(ctx + e, win + e - s) : ctx + e)});
    }
  }
}

// Portable path: any head size, loops left to the compiler's auto-vectoriser.
template <typename T>
void key_loop_generic(const ItemView<T>& it, int64_t D, Scratch& s) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t k0 = it.key_begin; k0 < it.num_keys; k0 += kKeyTile) {
    const int64_t kn = std::min(kKeyTile, it.num_keys - k0);
    // Gather the key tile (transposed: k_t[d][j]) and the value tile (v[j][d]) as float32.
    int64_t offs[kKeyTile];
    it.tile_offsets(k0, kn, offs);
    for (int64_t j = 0; j < kn; ++j) {
      const T* ksrc = it.k_cache + offs[j];
      const T* vsrc = it.v_cache + offs[j];
      float* vdst = s.v.data() + j * D;
      for (int64_t d = 0; d < D; ++d) s.k_t[d * kKeyTile + j] = to_f32(ksrc[d]);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) vdst[d] = to_f32(vsrc[d]);
    }
    if (kn < kKeyTile) {
      for (int64_t d = 0; d < D; ++d) std::fill_n(s.k_t.data() + d * kKeyTile + kn, kKeyTile - kn, 0.0f);
    }
    for (int64_t r = 0; r < it.rows; ++r) {
      const int64_t valid = it.visible(r, k0, kn);
      const int64_t lo = it.first_visible(r, k0, kn);
      if (valid <= lo) continue;
      float scores[kKeyTile];
      for (int64_t j = 0; j < kKeyTile; ++j) scores[j] = 0.0f;
      const float* qr = s.q.data() + r * D;
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qr[d];
        const float* kd = s.k_t.data() + d * kKeyTile;
#pragma omp simd
        for (int64_t j = 0; j < kKeyTile; ++j) scores[j] += qd * kd[j];
      }
      if (it.soft_cap > 0.0f) {
        for (int64_t j = lo; j < valid; ++j) scores[j] = it.soft_cap * std::tanh(scores[j] / it.soft_cap);
      }
      float tile_max = neg_inf;
      for (int64_t j = lo; j < valid; ++j) tile_max = std::max(tile_max, scores[j]);
      const float new_max = std::max(s.row_max[r], tile_max);
      const float alpha = std::exp(s.row_max[r] - new_max);  // 0 on the first tile
      float tile_sum = 0.0f;
#pragma omp simd reduction(+ : tile_sum)
      for (int64_t j = 0; j < kKeyTile; ++j) {
        const float p = (j >= lo && j < valid) ? fast_exp(scores[j] - new_max) : 0.0f;
        scores[j] = p;
        tile_sum += p;
      }
      s.row_max[r] = new_max;
      s.row_sum[r] = s.row_sum[r] * alpha + tile_sum;
      float* acc = s.acc.data() + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
      for (int64_t j = lo; j < valid; ++j) {
        const float p = scores[j];
        const float* vj = s.v.data() + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += p * vj[d];
      }
    }
  }
}

enum class Impl { kAuto, kPortable, kAvx2, kAvx512 };

constexpr bool kHaveAvx512 =
#if defined(__AVX512F__)
    true;
#else
    false;
#endif
constexpr bool kHaveAvx2 =
#if defined(__AVX2__) && defined(__FMA__)
    true;
#else
    false;
#endif

Impl parse_impl(c10::string_view name) {
  if (name == "auto") return Impl::kAuto;
  if (name == "portable") return Impl::kPortable;
  if (name == "avx2") {
    TORCH_CHECK_VALUE(kHaveAvx2, "impl='avx2' is not built here: this CPU (or compiler target) lacks AVX2+FMA");
    return Impl::kAvx2;
  }
  if (name == "avx512") {
    TORCH_CHECK_VALUE(kHaveAvx512, "impl='avx512' is not built here: this CPU (or compiler target) lacks AVX-512");
    return Impl::kAvx512;
  }
  TORCH_CHECK_VALUE(false, msg("impl must be one of auto, portable, avx2, avx512; got '", name, "'"));
  return Impl::kAuto;
}

bool avx512_head_size(int64_t d) { return d == 32 || d == 64 || d == 128 || d == 256; }
bool avx2_head_size(int64_t d) {
  switch (d) {
    case 16: case 32: case 48: case 64: case 80: case 96: case 128: case 256: return true;
    default: return false;
  }
}

// The key loop that a request for `want` runs at this head size: the requested path where it
// applies (auto: the fastest built), else the next one down, ending at the portable loop.
Impl resolve_impl(Impl want, int64_t d, bool soft_cap) {
  if ((want == Impl::kAuto || want == Impl::kAvx512) && kHaveAvx512 && avx512_head_size(d) && !soft_cap) {
    return Impl::kAvx512;
  }
  if (want != Impl::kPortable && kHaveAvx2 && avx2_head_size(d)) return Impl::kAvx2;
  return Impl::kPortable;
}

const char* impl_name(Impl impl) {
  switch (impl) {
    case Impl::kAvx512: return "avx512";
    case Impl::kAvx2: return "avx2";
    case Impl::kPortable: return "portable";
    default: return "auto";
  }
}

#if defined(__AVX2__) && defined(__FMA__)
template <typename T>
void key_loop_avx2(const ItemView<T>& it, int64_t D, Scratch& s) {
  switch (D) {
    case 16: return attn::key_loop_avx2<T, 2>(it, s);
    case 32: return attn::key_loop_avx2<T, 4>(it, s);
    case 48: return attn::key_loop_avx2<T, 6>(it, s);
    case 64: return attn::key_loop_avx2<T, 8>(it, s);
    case 80: return attn::key_loop_avx2<T, 10>(it, s);
    case 96: return attn::key_loop_avx2<T, 12>(it, s);
    case 128: return attn::key_loop_avx2<T, 16>(it, s);
    case 256: return attn::key_loop_avx2<T, 32>(it, s);
    default: return key_loop_generic<T>(it, D, s);  // unreachable: resolve_impl checked avx2_head_size
  }
}
#endif

#if defined(__AVX512F__)
template <typename T>
void key_loop_avx512(const ItemView<T>& it, int64_t D, Scratch& s) {
  if constexpr (std::is_same_v<T, float>) {
    if (it.rows == it.group) {  // one query token (a decode): attention_avx512.h's chunked decode path
      switch (D) {
        case 32: return attn::decode_f32<2>(it, s);
        case 64: return attn::decode_f32<4>(it, s);
        case 128: return attn::decode_f32<8>(it, s);
        case 256: return attn::decode_f32<16>(it, s);
        default: break;
      }
    }
  }
  switch (D) {
    case 32: return attn::key_loop_avx512<T, 2>(it, s);
    case 64: return attn::key_loop_avx512<T, 4>(it, s);
    case 128: return attn::key_loop_avx512<T, 8>(it, s);
    case 256: return attn::key_loop_avx512<T, 16>(it, s);
    default: return key_loop_generic<T>(it, D, s);  // unreachable: resolve_impl checked avx512_head_size
  }
}
#endif

// Runs the key loop chosen by resolve_impl.
template <typename T>
void key_loop(const ItemView<T>& it, int64_t D, Scratch& s, Impl impl) {
#if defined(__AVX512F__)
  if (impl == Impl::kAvx512) return key_loop_avx512<T>(it, D, s);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (impl == Impl::kAvx2) return key_loop_avx2<T>(it, D, s);
#endif
  key_loop_generic<T>(it, D, s);
}

// The per-thread scratch of one call. A decode step calls with the same small shape every layer and every step,
// and allocating and zero-filling each thread's buffers each call cost ~0.15 ms a 32-row decode step
// (benchmarks/PROFILE.md, "Fourteenth session, helper OV"), so the calling thread keeps small ones between calls
// (thread_local: concurrent callers never share one). Reuse changes no result: a thread already reuses its scratch
// for every item it takes within a call, so no path reads a buffer before writing what it uses. Larger scratch
// (long prefill chunks) stays the call's own (`own`) and is freed with it.
inline std::vector<Scratch>& call_scratch(std::vector<Scratch>& own, int num_threads, int64_t rows, int64_t d,
                                          bool chunk) {
  constexpr int64_t kKeepMaxRows = 256;
  struct Kept {
    std::vector<Scratch> scratch;
    int64_t rows = -1, d = -1;
    bool chunk = false;
  };
  thread_local Kept kept;
  std::vector<Scratch>& out = rows <= kKeepMaxRows ? kept.scratch : own;
  if (&out == &kept.scratch && (kept.rows != rows || kept.d != d || kept.chunk != chunk)) {
    kept.scratch.clear();  // another shape: rebuilt below (on failure `kept` is left empty, as for a first call)
    kept.rows = -1;
  }
  out.reserve(num_threads);
  while (static_cast<int>(out.size()) < num_threads) out.emplace_back(rows, d, chunk);
  if (&out == &kept.scratch) {
    kept.rows = rows;
    kept.d = d;
    kept.chunk = chunk;
  }
  return out;
}

template <typename T>
void attention_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                      const at::Tensor& block_table, const at::Tensor& seq_lens,
                      const at::Tensor& query_start_loc, float scale, int64_t window, float soft_cap,
                      Impl impl) {
  const int64_t num_tokens = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t num_blocks = kv_cache.size(1);
  const int64_t block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tokens_per_item = std::max<int64_t>(1, kRowsPerItem / group);
  const int64_t max_rows = tokens_per_item * group;

  // The call's host-side lists, kept by the calling thread between calls (thread_local; each call clears and refills
  // them): a decode step makes 12 calls of one shape, and allocating them every call was most of its setup.
  struct Lists {
    std::vector<WorkItem> items;
    std::vector<int64_t> rest;
#ifdef VLLM_LITE_ATTN_DECODE_BF16
    std::vector<attn::DecodeReq> decodes;
    std::vector<int64_t> decode_end;
#endif
  };
  thread_local Lists lists;
  std::vector<WorkItem>& items = lists.items;
  plan_items(items, block_table, seq_lens, query_start_loc, num_tokens, block_size, num_blocks, tokens_per_item,
             window);
  if (items.empty()) return;

  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t max_blocks = block_table.size(1);
  const T* q_ptr = query.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  const int64_t q_tok_stride = query.stride(0), q_head_stride = query.stride(1);
  const int64_t o_tok_stride = out.stride(0), o_head_stride = out.stride(1);
  const T* k_cache = kv_cache.data_ptr<T>();
  const int64_t tok_stride = num_kv_heads * head_size;
  const int64_t blk_stride = block_size * tok_stride;
  const int64_t D = head_size;
#ifdef VLLM_LITE_ATTN_DECODE_BF16
  // Decode items of a bf16 cache take the VDPBF16PS path where the AVX-512 key loop would run.
  const bool decode_fast = impl == Impl::kAvx512 && attn::decode_bf16_head_size(D);
  // Prefill items (several query tokens) of a bf16 cache without a sliding window: attention_prefill_bf16.h.
  const bool prefill_fast = std::is_same_v<T, c10::BFloat16> && decode_fast && window == 0;
#else
  const bool prefill_fast = false;
#endif
  // Items the bf16 decode path takes (one query token), in request order (a thread's run of them then walks the
  // cache roughly in allocation order), and the rest (the key loops), largest first.
  std::vector<int64_t>& rest = lists.rest;
  rest.clear();
#ifdef VLLM_LITE_ATTN_DECODE_BF16
  std::vector<attn::DecodeReq>& decodes = lists.decodes;
  decodes.clear();
#endif
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
#ifdef VLLM_LITE_ATTN_DECODE_BF16
    const WorkItem& item = items[i];
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (decode_fast && item.q_end - item.q_begin == 1) {
        const int64_t b = item.req;
        const int64_t q_len = qsl[b + 1] - qsl[b];
        const int64_t ctx = sl[b] - q_len;
        const int64_t tok = qsl[b] + item.q_begin;
        decodes.push_back({ItemView<T>{k_cache, k_cache + num_blocks * blk_stride, bt + b * max_blocks, block_size,
                                       blk_stride, tok_stride, 0, ctx + item.q_begin, group, group,
                                       ctx + item.q_end, window,
                                       window > 0 ? std::max<int64_t>(0, ctx + item.q_begin - window + 1) : 0,
                                       soft_cap},
                           q_ptr + tok * q_tok_stride, o_ptr + tok * o_tok_stride});
        continue;
      }
    }
#endif
    rest.push_back(i);
  }
  if (rest.size() > 1) {
    std::stable_sort(rest.begin(), rest.end(),
                     [&](int64_t x, int64_t y) { return items[x].cost > items[y].cost; });
  }
#ifdef VLLM_LITE_ATTN_DECODE_BF16
  // The decodes are shared out by (request, KV head) units: a request's KV heads are independent (each row's
  // arithmetic reads only its own head's keys and values), so a request may be split between two threads without
  // changing a bit, and the threads' shares differ by at most half a head's keys instead of half a request's. A unit
  // costs its request's keys + 16 (one tile for the per-request work); decode_end[b] is twice the midpoint of
  // request b's last unit in the running sum of the units' costs (non-decreasing).
  std::vector<int64_t>& decode_end = lists.decode_end;
  decode_end.clear();
  int64_t decode_total = 0;
  for (const attn::DecodeReq& d : decodes) {
    const int64_t c = d.it.num_keys - d.it.key_begin + 16;
    decode_end.push_back(2 * decode_total + (2 * num_kv_heads - 1) * c);
    decode_total += num_kv_heads * c;
  }
  const int64_t num_decodes = static_cast<int64_t>(decodes.size());
#else
  const int64_t num_decodes = 0;
#endif
  const int64_t num_rest_work = static_cast<int64_t>(rest.size()) * num_kv_heads;
  const int num_threads = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_rest_work + num_decodes * num_kv_heads)));
  // Per-thread scratch is allocated here, not inside the parallel region: nothing in the region may throw
  // (an exception leaving an OpenMP region ends the process), and an allocation failure must raise.
  // A decode request holds all its heads' rows at once.
  const int64_t scratch_rows = num_decodes > 0 ? std::max<int64_t>(max_rows, num_heads) : max_rows;
  std::vector<Scratch> own_scratch;
  std::vector<Scratch>& scratch =
      call_scratch(own_scratch, num_threads, scratch_rows, D, prefill_fast && !rest.empty());

#pragma omp parallel num_threads(num_threads)
  {
#ifdef _OPENMP
    const int tid = omp_get_thread_num();
    const int nt = omp_get_num_threads();
#else
    const int tid = 0;
    const int nt = 1;
#endif
    Scratch& s = scratch[tid];
#ifndef VLLM_LITE_ATTN_DECODE_BF16
    (void)nt;
#else
    if (num_decodes > 0) {
      // Decodes first, each thread a contiguous run of (request, KV head) units with an equal share of the keys,
      // streamed as one (attention_decode_bf16.h's DecodeStream); the rest of the batch is shared out dynamically
      // after them, which also evens out what the static split leaves. Thread t's run starts where the running cost
      // reaches t / nt of the total: at the request whose midpoint is the first at or past that point, or inside a
      // request, at the first of its units whose midpoint is, when that is nearer the point by more than 1/16 of a
      // thread's share. A request's KV heads are independent, so splitting one keeps every bit; but each of the two
      // threads then streams part of the same token rows, and at 8 and 32 decodes (whole-request splits 4.5% and
      // 1.9% off) splitting measured no better, while at 1, 3, 4 and 16 decodes (off by 100%, 23%, 17%, 8%) it
      // measured 6-35% faster (benchmarks/PROFILE.md, "Fifteenth session, helper AS"). One decode: both threads
      // share its heads.
      const auto boundary = [&](int64_t t) {
        const int64_t x = 2 * decode_total * t / nt;  // the point, as twice a running cost
        const int64_t b = std::lower_bound(decode_end.begin(), decode_end.end(), x) - decode_end.begin();
        if (b == num_decodes) return num_decodes * num_kv_heads;
        const int64_t c = decodes[b].it.num_keys - decodes[b].it.key_begin + 16;  // one unit's cost
        const int64_t start2 = decode_end[b] - (2 * num_kv_heads - 1) * c;       // twice the cost before b
        // Whole requests: b starts the run if its midpoint (start2 + num_kv_heads * c) is at or past x.
        const bool at_b = start2 + num_kv_heads * c >= x;
        const int64_t req_miss = std::abs((at_b ? start2 : start2 + 2 * num_kv_heads * c) - x);
        // Units: the first head h of b with 2 * (start + h * c) + c >= x (h < num_kv_heads as decode_end[b] >= x).
        const int64_t h = std::max<int64_t>(0, (x - start2 + c - 1) / (2 * c));
        const int64_t unit_miss = std::abs(start2 + 2 * h * c - x);
        if (h > 0 && req_miss - unit_miss > 2 * decode_total / nt / 16) return b * num_kv_heads + h;
        return (at_b ? b : b + 1) * num_kv_heads;
      };
      // Runs must not overlap: each thread's start is the largest boundary up to it.
      const auto first_unit = [&](int64_t t) {
        int64_t u = 0;
        for (int64_t i = 1; i <= t; ++i) u = std::max(u, boundary(i));
        return u;
      };
      const int64_t u_lo = first_unit(tid);
      const int64_t u_hi = tid + 1 == nt ? num_decodes * num_kv_heads : first_unit(tid + 1);
      if (u_lo < u_hi) {
        const int64_t lo = u_lo / num_kv_heads, hi = (u_hi - 1) / num_kv_heads + 1;
        const int64_t first_head = u_lo % num_kv_heads, last_head_end = (u_hi - 1) % num_kv_heads + 1;
        attn::DecodeStream stream(decodes.data() + lo, hi - lo, num_kv_heads, D, first_head, last_head_end);
        for (int64_t i = lo; i < hi; ++i) {
          attn::decode_bf16_dispatch(D, decodes[i], i - lo, i == lo ? first_head : 0,
                                     i + 1 == hi ? last_head_end : num_kv_heads, q_head_stride, o_head_stride,
                                     scale, s, stream);
        }
      }
    }
#endif
    // A request's KV heads go to one thread together: they share the cache's token rows.
#pragma omp for schedule(dynamic, num_kv_heads) nowait
    for (int64_t w = 0; w < num_rest_work; ++w) {
      const WorkItem& item = items[rest[w / num_kv_heads]];
      const int64_t kvh = w % num_kv_heads;
      const int64_t b = item.req;
      const int64_t q_len = qsl[b + 1] - qsl[b];
      const int64_t ctx = sl[b] - q_len;  // position of the request's first query token
      ItemView<T> it{k_cache, k_cache + num_blocks * blk_stride, bt + b * max_blocks, block_size, blk_stride,
                     tok_stride, kvh * D, ctx + item.q_begin, (item.q_end - item.q_begin) * group, group,
                     ctx + item.q_end, window,
                     window > 0 ? std::max<int64_t>(0, ctx + item.q_begin - window + 1) : 0, soft_cap};
#ifdef VLLM_LITE_ATTN_PREFILL_BF16
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (prefill_fast) {
          const int64_t tok = qsl[b] + item.q_begin;
          attn::prefill_bf16_dispatch(D, it, q_ptr + tok * q_tok_stride + kvh * group * q_head_stride, q_tok_stride,
                                      q_head_stride, o_ptr + tok * o_tok_stride + kvh * group * o_head_stride,
                                      o_tok_stride, o_head_stride, scale, s);
          continue;
        }
      }
#endif

      // Load this item's query rows (row = token * group + head-in-group), pre-scaled, as float32.
      for (int64_t r = 0; r < it.rows; ++r) {
        const int64_t tok = qsl[b] + item.q_begin + r / group;
        const int64_t head = kvh * group + r % group;
        const T* src = q_ptr + tok * q_tok_stride + head * q_head_stride;
        float* dst = s.q.data() + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = to_f32(src[d]) * scale;
        s.row_max[r] = -std::numeric_limits<float>::infinity();
        s.row_sum[r] = 0.0f;
        std::fill_n(s.acc.data() + r * D, D, 0.0f);
      }

      key_loop<T>(it, D, s, impl);

      for (int64_t r = 0; r < it.rows; ++r) {
        const int64_t tok = qsl[b] + item.q_begin + r / group;
        const int64_t head = kvh * group + r % group;
        T* dst = o_ptr + tok * o_tok_stride + head * o_head_stride;
        const float inv = 1.0f / s.row_sum[r];
        const float* acc = s.acc.data() + r * D;
        for (int64_t d = 0; d < D; ++d) store_f32(acc[d] * inv, dst + d);
      }
    }
  }
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_table, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
                     double logits_soft_cap, c10::string_view impl) {
  // Every check runs before any tensor's data is read and before the parallel region, in this order: device,
  // dims, dtypes, layout, shapes (metadata only), then the index values (plan_items), then the kernel.
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&out, "out"}, {&query, "query"},
                         {&kv_cache, "kv_cache"}, {&block_table, "block_table"}, {&seq_lens, "seq_lens"},
                         {&query_start_loc, "query_start_loc"}}) {
    check_cpu(*t, name);
  }
  check_dim(query, 3, "query");
  check_dim(out, 3, "out");
  check_dim(kv_cache, 5, "kv_cache");
  check_dim(block_table, 2, "block_table");
  check_dim(seq_lens, 1, "seq_lens");
  check_dim(query_start_loc, 1, "query_start_loc");
  check_dtype(block_table, at::kInt, "block_table");
  check_dtype(seq_lens, at::kInt, "seq_lens");
  check_dtype(query_start_loc, at::kInt, "query_start_loc");
  TORCH_CHECK_TYPE(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
                   msg("paged_attention supports float32 and bfloat16, got ", query.scalar_type()));
  TORCH_CHECK_TYPE(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
                   msg("query, out and kv_cache must share a dtype, got ", query.scalar_type(), ", ",
                       out.scalar_type(), " and ", kv_cache.scalar_type()));
  check_contiguous(kv_cache, "kv_cache");
  check_contiguous(block_table, "block_table");
  check_contiguous(seq_lens, "seq_lens");
  check_contiguous(query_start_loc, "query_start_loc");
  TORCH_CHECK_VALUE(out.sizes() == query.sizes(),
                    msg("out shape ", out.sizes(), " must equal query shape ", query.sizes()));
  TORCH_CHECK_VALUE(query.stride(2) == 1 && out.stride(2) == 1, "query and out must be contiguous along head_size");
  TORCH_CHECK_VALUE(kv_cache.size(0) == 2, msg("kv_cache.size(0) must be 2 (keys, values), got ", kv_cache.size(0)));
  TORCH_CHECK_VALUE(query.size(2) > 0 && kv_cache.size(4) == query.size(2),
                    msg("kv_cache head_size ", kv_cache.size(4), " != query head_size ", query.size(2),
                        " (both must be > 0)"));
  TORCH_CHECK_VALUE(kv_cache.size(3) > 0 && query.size(1) > 0 && query.size(1) % kv_cache.size(3) == 0,
                    msg("num_heads ", query.size(1), " must be a positive multiple of num_kv_heads ",
                        kv_cache.size(3)));
  TORCH_CHECK_VALUE(kv_cache.size(2) > 0, msg("kv_cache block_size must be > 0, got ", kv_cache.size(2)));
  TORCH_CHECK_VALUE(query_start_loc.size(0) == seq_lens.size(0) + 1,
                    msg("query_start_loc must have num_reqs + 1 = ", seq_lens.size(0) + 1, " entries, got ",
                        query_start_loc.size(0)));
  TORCH_CHECK_VALUE(block_table.size(0) >= seq_lens.size(0),
                    msg("block_table has ", block_table.size(0), " rows for ", seq_lens.size(0), " requests"));
  TORCH_CHECK_VALUE(sliding_window >= 0, msg("sliding_window must be >= 0 (0 = none), got ", sliding_window));
  TORCH_CHECK_VALUE(logits_soft_cap >= 0.0,
                    msg("logits_soft_cap must be >= 0 (0 = none), got ", logits_soft_cap));
  const Impl chosen = resolve_impl(parse_impl(impl), query.size(2), logits_soft_cap > 0.0);
  const float s = static_cast<float>(scale);
  const float cap = static_cast<float>(logits_soft_cap);
  if (query.scalar_type() == at::kFloat) {
    attention_kernel<float>(out, query, kv_cache, block_table, seq_lens, query_start_loc, s, sliding_window, cap,
                            chosen);
  } else {
    attention_kernel<c10::BFloat16>(out, query, kv_cache, block_table, seq_lens, query_start_loc, s,
                                    sliding_window, cap, chosen);
  }
}

std::string paged_attention_impl(int64_t head_size, double logits_soft_cap, c10::string_view impl) {
  return impl_name(resolve_impl(parse_impl(impl), head_size, logits_soft_cap > 0.0));
}

std::vector<std::string> attention_impls() {
  std::vector<std::string> names;
  if (kHaveAvx512) names.emplace_back("avx512");
  if (kHaveAvx2) names.emplace_back("avx2");
  names.emplace_back("portable");
  return names;
}

}  // namespace vllm_lite
