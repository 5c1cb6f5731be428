// Paged attention on CPU for vllm-lite's mixed batch (prefill chunks and decodes in one call).
//
// Work is split into items (request, KV head, tile of query tokens). An item packs the
// query heads that share its KV head (GQA) and a few query tokens into up to kRowsPerItem
// float32 rows, then streams the request's keys in small tiles gathered through the block
// table, keeping a running max/sum per row (online softmax): nothing of size [query, context]
// is ever materialised. Each key tile is converted to float32 once and reused by every row of
// the item, stored transposed so scores for 16 keys are one vector FMA chain per row.
// Two implementations of the key loop: AVX-512 intrinsics for head sizes 32/64/128/256
// (registers hold scores and accumulators), and a portable loop for anything else.
// A sliding window W (query at p sees keys in (p - W, p]) starts the key stream at the first key
// any row of the item can see, so blocks before the window are never read (they may be freed);
// logit soft-capping (Gemma 2) runs on the portable loop.

#include "cpu_common.h"
#include "ops.h"

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <limits>
#include <vector>

namespace vllm_lite {
namespace {

constexpr int64_t kKeyTile = 32;      // keys per softmax step (two AVX-512 registers of scores)
constexpr int64_t kRowsPerItem = 64;  // target query rows (tokens x heads) per work item

struct WorkItem {
  int32_t req;
  int32_t q_begin;  // first query token of the tile, relative to the request
  int32_t q_end;    // one past the last
  int64_t cost;     // rough flops, to start big items first
};

// Per-thread scratch, sized once per call.
struct Scratch {
  std::vector<float> q, acc, row_max, row_sum, k_t, v;
  // q is padded to a multiple of 4 rows (zeros) so the AVX-512 path can score rows four at a time.
  Scratch(int64_t rows, int64_t d)
      : q(((rows + 3) / 4) * 4 * d, 0.0f), acc(rows * d), row_max(rows), row_sum(rows), k_t(d * kKeyTile),
        v(kKeyTile * d) {}
};

// Validates the batch on the host and lists the work items, largest first.
std::vector<WorkItem> plan_items(const at::Tensor& block_table, const at::Tensor& seq_lens,
                                 const at::Tensor& query_start_loc, int64_t num_tokens,
                                 int64_t block_size, int64_t num_blocks, int64_t tokens_per_item,
                                 int64_t window) {
  const int64_t num_reqs = seq_lens.size(0);
  const int64_t max_blocks = block_table.size(1);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(qsl[0] >= 0, "query_start_loc[0] must be >= 0, got ", qsl[0]);
  TORCH_CHECK_VALUE(qsl[num_reqs] <= num_tokens, "query_start_loc[-1] = ", qsl[num_reqs],
                    " exceeds the number of query rows ", num_tokens);
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    const int64_t s_len = sl[b];
    TORCH_CHECK_VALUE(q_len >= 0, "query_start_loc must be non-decreasing (request ", b, ")");
    TORCH_CHECK_VALUE(s_len >= q_len, "seq_lens[", b, "] = ", s_len, " is shorter than its query length ",
                      q_len);
    if (q_len == 0) continue;
    const int64_t need = (s_len + block_size - 1) / block_size;
    TORCH_CHECK_VALUE(need <= max_blocks, "seq_lens[", b, "] = ", s_len, " needs ", need,
                      " blocks but block_table has ", max_blocks, " columns");
    const int64_t first = window > 0 ? std::max<int64_t>(0, s_len - q_len - window + 1) / block_size : 0;
    for (int64_t j = first; j < need; ++j) {
      const int32_t blk = bt[b * max_blocks + j];
      TORCH_CHECK_VALUE(blk >= 0 && blk < num_blocks, "block_table[", b, ", ", j, "] = ", blk,
                        " is outside the cache's ", num_blocks, " blocks");
    }
    const int64_t ctx = s_len - q_len;
    for (int64_t s = 0; s < q_len; s += tokens_per_item) {
      const int64_t e = std::min(q_len, s + tokens_per_item);
      items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(s), static_cast<int32_t>(e),
                       (e - s) * (window > 0 ? std::min<int64_t>(ctx + e, window + e - s) : ctx + e)});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

// What one work item needs to stream its keys: where they live and which rows it owns.
template <typename T>
struct ItemView {
  const T* k_cache;
  const T* v_cache;
  const int32_t* table;  // the request's block table row
  int64_t block_size, blk_stride, tok_stride, kv_off;  // kv_off: this KV head's offset in a token row
  int64_t ctx;           // position of the item's first query token
  int64_t rows, group;   // rows = tokens * group; row r is token r / group
  int64_t num_keys;      // keys key_begin..num_keys-1 are visible to some row
  int64_t window;        // sliding window, 0 = none
  int64_t key_begin;     // first key any row sees (0 without a window)
  float soft_cap;        // 0 = none

  // Cache offsets of keys k0..k0+n-1, walking the block table without a division per key.
  void tile_offsets(int64_t k0, int64_t n, int64_t* offs) const {
    int64_t blk = k0 / block_size, in_blk = k0 % block_size;
    int64_t base = static_cast<int64_t>(table[blk]) * blk_stride + kv_off;
    for (int64_t j = 0; j < n; ++j) {
      offs[j] = base + in_blk * tok_stride;
      if (++in_blk == block_size && j + 1 < n) {
        in_blk = 0;
        base = static_cast<int64_t>(table[++blk]) * blk_stride + kv_off;
      }
    }
  }
  // Keys of the tile starting at k0 that row r may see (causal), clamped to [0, kn].
  int64_t visible(int64_t r, int64_t k0, int64_t kn) const {
    return std::max<int64_t>(0, std::min(kn, ctx + r / group + 1 - k0));
  }
  // First key of that tile row r may see (the window's lower edge), clamped to [0, kn].
  int64_t first_visible(int64_t r, int64_t k0, int64_t kn) const {
    if (window <= 0) return 0;
    return std::max<int64_t>(0, std::min(kn, ctx + r / group - window + 1 - k0));
  }
};

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

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16-lane version of fast_exp; 2^n is applied with scalef.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// In-place transpose of a 16x16 float tile held in 16 registers (three shuffle stages).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int h = 0; h < 16; h += 8) {
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

constexpr int64_t kTile16 = 16;  // keys per step on the AVX-512 path: one register of scores
constexpr int kRowBlock = 4;     // query rows whose scores are computed together

// AVX-512 path for head_size = 16 * NC: registers hold scores and the accumulator of a row.
template <typename T, int NC>
void key_loop_avx512(const ItemView<T>& it, Scratch& s) {
  constexpr int64_t D = 16 * NC;
  float* vbuf = s.v.data();                 // [16][D] value rows converted to float32
  float* kt = s.k_t.data();                 // [D][16] transposed keys
  alignas(64) float probs[kTile16];
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t k0 = it.key_begin; k0 < it.num_keys; k0 += kTile16) {
    const int64_t kn = std::min(kTile16, it.num_keys - k0);
    int64_t offs[kTile16];
    it.tile_offsets(k0, kn, offs);
    // Decode is bound by cache misses on the scattered KV rows: start fetching the next tile now.
    if (k0 + kTile16 < it.num_keys) {
      int64_t next[kTile16];
      const int64_t nn = std::min(kTile16, it.num_keys - k0 - kTile16);
      it.tile_offsets(k0 + kTile16, nn, next);
      for (int64_t j = 0; j < nn; ++j) {
        for (int64_t byte = 0; byte < D * static_cast<int64_t>(sizeof(T)); byte += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(it.k_cache + next[j]) + byte, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(it.v_cache + next[j]) + byte, _MM_HINT_T0);
        }
      }
    }
    const float* vrow[kTile16];  // value rows as float32: the cache itself, or converted copies
    for (int64_t j = 0; j < kn; ++j) {
      const T* vsrc = it.v_cache + offs[j];
      if constexpr (std::is_same_v<T, float>) {
        vrow[j] = vsrc;
      } else {
        float* vdst = vbuf + j * D;
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(vdst + 16 * c, load16(vsrc + 16 * c));
        vrow[j] = vdst;
      }
    }
    for (int c = 0; c < NC; ++c) {
      __m512 blk[16];
      for (int64_t j = 0; j < 16; ++j) blk[j] = j < kn ? load16(it.k_cache + offs[j] + 16 * c) : _mm512_setzero_ps();
      transpose16(blk);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (16 * c + i) * kTile16, blk[i]);
    }
    for (int64_t r0 = 0; r0 < it.rows; r0 += kRowBlock) {
      // s.q has rows padded to a multiple of kRowBlock, so all four rows are safe to read.
      __m512 sc[kRowBlock];
      for (int i = 0; i < kRowBlock; ++i) sc[i] = _mm512_setzero_ps();
      const float* q0 = s.q.data() + r0 * D;
      for (int64_t d = 0; d < D; ++d) {
        const __m512 kd = _mm512_loadu_ps(kt + d * kTile16);
        for (int i = 0; i < kRowBlock; ++i) sc[i] = _mm512_fmadd_ps(_mm512_set1_ps(q0[i * D + d]), kd, sc[i]);
      }
      const int64_t nr = std::min<int64_t>(kRowBlock, it.rows - r0);
      for (int64_t i = 0; i < nr; ++i) {
        const int64_t r = r0 + i;
        const int64_t valid = it.visible(r, k0, kn);
        const int64_t lo = it.first_visible(r, k0, kn);
        if (valid <= lo) continue;
        const __mmask16 m = static_cast<__mmask16>(((1u << valid) - 1u) & ~((1u << lo) - 1u));
        const __m512 sv = _mm512_mask_blend_ps(m, neg_inf, sc[i]);
        const float new_max = std::max(s.row_max[r], _mm512_reduce_max_ps(sv));
        const float alpha = std::exp(s.row_max[r] - new_max);  // 0 on the first tile
        const __m512 p = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(new_max))));
        s.row_max[r] = new_max;
        s.row_sum[r] = s.row_sum[r] * alpha + _mm512_reduce_add_ps(p);
        _mm512_store_ps(probs, p);
        float* acc = s.acc.data() + r * D;
        __m512 a[NC];
        const __m512 av = _mm512_set1_ps(alpha);
        for (int c = 0; c < NC; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), av);
        for (int64_t j = lo; j < valid; ++j) {
          const __m512 pj = _mm512_set1_ps(probs[j]);
          const float* vj = vrow[j];
          for (int c = 0; c < NC; ++c) a[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + 16 * c), a[c]);
        }
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
      }
    }
  }
}
#endif

// Runs the key loop with the fastest path available for this head size.
template <typename T>
void key_loop(const ItemView<T>& it, int64_t D, Scratch& s) {
#if defined(__AVX512F__)
  if (it.soft_cap <= 0.0f) switch (D) {
    case 32: return key_loop_avx512<T, 2>(it, s);
    case 64: return key_loop_avx512<T, 4>(it, s);
    case 128: return key_loop_avx512<T, 8>(it, s);
    case 256: return key_loop_avx512<T, 16>(it, s);
    default: break;
  }
#endif
  key_loop_generic<T>(it, D, s);
}

template <typename T>
void attention_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                      const at::Tensor& block_table, const at::Tensor& seq_lens,
                      const at::Tensor& query_start_loc, float scale, int64_t window, float soft_cap) {
  const int64_t num_tokens = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t num_blocks = kv_cache.size(1);
  const int64_t block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tokens_per_item = std::max<int64_t>(1, kRowsPerItem / group);
  const int64_t max_rows = tokens_per_item * group;

  const std::vector<WorkItem> items = plan_items(block_table, seq_lens, query_start_loc, num_tokens,
                                                 block_size, num_blocks, tokens_per_item, window);
  const int64_t num_work = static_cast<int64_t>(items.size()) * num_kv_heads;
  if (num_work == 0) return;

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
  const int num_threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), num_work));

#pragma omp parallel num_threads(num_threads)
  {
    Scratch s(max_rows, D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < num_work; ++w) {
      const WorkItem& item = items[w / num_kv_heads];
      const int64_t kvh = w % num_kv_heads;
      const int64_t b = item.req;
      const int64_t q_len = qsl[b + 1] - qsl[b];
      const int64_t ctx = sl[b] - q_len;  // position of the request's first query token
      ItemView<T> it{k_cache, k_cache + num_blocks * blk_stride, bt + b * max_blocks, block_size, blk_stride,
                     tok_stride, kvh * D, ctx + item.q_begin, (item.q_end - item.q_begin) * group, group,
                     ctx + item.q_end, window,
                     window > 0 ? std::max<int64_t>(0, ctx + item.q_begin - window + 1) : 0, soft_cap};

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

      key_loop<T>(it, D, s);

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
                     double logits_soft_cap) {
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
  check_contiguous(kv_cache, "kv_cache");
  check_contiguous(block_table, "block_table");
  check_contiguous(seq_lens, "seq_lens");
  check_contiguous(query_start_loc, "query_start_loc");
  TORCH_CHECK_TYPE(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
                   "query, out and kv_cache must share a dtype, got ", query.scalar_type(), ", ",
                   out.scalar_type(), " and ", kv_cache.scalar_type());
  TORCH_CHECK_VALUE(out.sizes() == query.sizes(), "out shape ", out.sizes(), " must equal query shape ",
                    query.sizes());
  TORCH_CHECK_VALUE(query.stride(2) == 1 && out.stride(2) == 1,
                    "query and out must be contiguous along head_size");
  TORCH_CHECK_VALUE(kv_cache.size(0) == 2, "kv_cache.size(0) must be 2 (keys, values), got ", kv_cache.size(0));
  TORCH_CHECK_VALUE(kv_cache.size(4) == query.size(2), "kv_cache head_size ", kv_cache.size(4),
                    " != query head_size ", query.size(2));
  TORCH_CHECK_VALUE(kv_cache.size(3) > 0 && query.size(1) % kv_cache.size(3) == 0, "num_heads ", query.size(1),
                    " must be a multiple of num_kv_heads ", kv_cache.size(3));
  TORCH_CHECK_VALUE(query_start_loc.size(0) == seq_lens.size(0) + 1, "query_start_loc must have num_reqs + 1 = ",
                    seq_lens.size(0) + 1, " entries, got ", query_start_loc.size(0));
  TORCH_CHECK_VALUE(block_table.size(0) >= seq_lens.size(0), "block_table has ", block_table.size(0),
                    " rows for ", seq_lens.size(0), " requests");
  TORCH_CHECK_VALUE(sliding_window >= 0, "sliding_window must be >= 0 (0 = none), got ", sliding_window);
  TORCH_CHECK_VALUE(logits_soft_cap >= 0.0, "logits_soft_cap must be >= 0 (0 = none), got ", logits_soft_cap);
  const float s = static_cast<float>(scale);
  const float cap = static_cast<float>(logits_soft_cap);
  switch (query.scalar_type()) {
    case at::kFloat:
      attention_kernel<float>(out, query, kv_cache, block_table, seq_lens, query_start_loc, s, sliding_window, cap);
      break;
    case at::kBFloat16:
      attention_kernel<c10::BFloat16>(out, query, kv_cache, block_table, seq_lens, query_start_loc, s, sliding_window, cap);
      break;
    default:
      TORCH_CHECK_TYPE(false, "paged_attention supports float32 and bfloat16, got ", query.scalar_type());
  }
}

}  // namespace vllm_lite
