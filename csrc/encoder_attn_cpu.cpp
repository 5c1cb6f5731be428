// Bidirectional (encoder) attention over a packed batch of whole prompts, float32, CPU:
//   encoder_attention_cpu(q [T, H, D], k [T, H, D], v [T, H, D], cu_seqlens [B+1], scale) -> out [T, H, D]
// Prompt b owns rows cu_seqlens[b] .. cu_seqlens[b+1]-1 and attends to exactly those rows (no mask, no padding,
// no causality): out[t, h] = softmax(scale * q[t, h] . k[rows of t's prompt, h]) @ v[same rows, h].
// q/k/v may be strided views (e.g. the three column blocks of a fused qkv projection): any row and head stride,
// unit stride along D. out is a new contiguous tensor.
//
// Why (benchmarks/PROFILE.md, "Embeddings vs sentence-transformers"): BERT-style embedding models (MiniLM:
// 12 heads x 32) spent ~16% of a pass in attention, one torch bmm/softmax/bmm or SDPA call per prompt and layer
// (a few op dispatches and OpenMP regions each, and SDPA's flash kernel ran ~40-50 GFLOP/s at head_dim 32).
// Here one OpenMP region covers the whole batch: work item = (prompt, head, block of <= kChunk query rows),
// largest first, dynamic. Per item: K transposed into scratch (so scores run along keys, vector FMAs with a
// broadcast q element: kQRows query rows x 2 vectors of keys per tile), a row-wise softmax (max-subtracted,
// fast_exp, float32 sums), then P @ V along D (kPvRows rows x D/W vectors per tile) scaled by 1/sum once.
// Every output element is computed by one work item in a fixed order: results do not depend on the thread
// count. GCC vector extensions of the native width (16 floats with AVX-512F, else 8), so AVX-512 and AVX2 hosts
// build the same source; AVX-512 only adds two intrinsics to the exp (rounding and vscalefps).
// Softmax cost (HE, 2026-11-27): each row's max is kept lane-wise while its scores are stored (the padding
// past the prompt's keys gets -inf through a bias row, not a second pass), the max and the sum finish by a
// butterfly of lane swaps instead of a scalar loop over the lanes, and an item covers up to 256 query rows (one
// K transpose per prompt and head instead of one per 64 rows): the benchmark's attention 0.35 -> 0.27 s a pass.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"

namespace vllm_lite {
namespace {

#ifdef __AVX512F__
constexpr int64_t kW = 16;  // float32 lanes of one native vector
constexpr int kQRows = 8;   // query rows of a score tile (x 2 key vectors: 16 accumulators of 32 registers)
constexpr int kAcc = 16;    // accumulators of a P @ V tile
#else
constexpr int64_t kW = 8;
constexpr int kQRows = 4;  // 8 accumulators of AVX2's 16 registers
constexpr int kAcc = 8;
#endif
typedef float vf __attribute__((vector_size(kW * 4)));

constexpr int64_t kBlock = 8;    // query rows per softmax block (scores scratch rows); a multiple of both tiles
constexpr int64_t kChunk = 256;  // query rows per work item (more items than threads for one long prompt)
constexpr int64_t kMaxDv = 8;    // head_dim up to 8 vectors on the tiled P @ V path; other sizes: generic loop
// Below this many multiply-adds a call runs on one thread (waking the pool costs more than it saves).
constexpr int64_t kSerialMacs = 1 << 16;

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storev(vf v, float* p) { std::memcpy(p, &v, sizeof(v)); }

struct Item {
  int64_t start, len, head, q0, q1;  // prompt rows [start, start + len), head, query rows [q0, q1) of it
};

// scores[r, j:j + KV*W) = scale * qrow[r] . kt[:, j:j + KV*W) + bias[j:j + KV*W) for kQRows query rows
// (kt: [D, lpad]; bias 0 on keys, -inf on the padding past them), and rmax[r] = lane-wise max of them so far.
template <int KV>
inline void score_cols(const float* const* qrow, const float* __restrict kt, int64_t d_len, int64_t lpad,
                       int64_t j, float scale, const float* __restrict bias, float* __restrict scores, vf* rmax) {
  vf acc[kQRows][KV];
  _Pragma("GCC unroll 16") for (int r = 0; r < kQRows; ++r)
    _Pragma("GCC unroll 2") for (int c = 0; c < KV; ++c) acc[r][c] = vf{};
  for (int64_t d = 0; d < d_len; ++d) {
    const float* kd = kt + d * lpad + j;
    vf kv[KV];
    _Pragma("GCC unroll 2") for (int c = 0; c < KV; ++c) kv[c] = loadv(kd + c * kW);
    _Pragma("GCC unroll 16") for (int r = 0; r < kQRows; ++r) {
      const float qd = qrow[r][d];
      _Pragma("GCC unroll 2") for (int c = 0; c < KV; ++c) acc[r][c] += qd * kv[c];
    }
  }
  vf b[KV];
  _Pragma("GCC unroll 2") for (int c = 0; c < KV; ++c) b[c] = loadv(bias + j + c * kW);
  _Pragma("GCC unroll 16") for (int r = 0; r < kQRows; ++r)
    _Pragma("GCC unroll 2") for (int c = 0; c < KV; ++c) {
      const vf x = acc[r][c] * scale + b[c];
      rmax[r] = x > rmax[r] ? x : rmax[r];
      storev(x, scores + r * lpad + j + c * kW);
    }
}

// scores[r, 0:lpad) for kQRows rows; lpad a multiple of W.
inline void score_tile(const float* const* qrow, const float* kt, int64_t d_len, int64_t lpad, float scale,
                       const float* bias, float* scores, vf* rmax) {
  int64_t j = 0;
  for (; j + 2 * kW <= lpad; j += 2 * kW) score_cols<2>(qrow, kt, d_len, lpad, j, scale, bias, scores, rmax);
  if (j < lpad) score_cols<1>(qrow, kt, d_len, lpad, j, scale, bias, scores, rmax);
}

typedef int32_t vi __attribute__((vector_size(kW * 4)));

// exp(x) lane-wise: fast_exp's range reduction and polynomial (cpu_common.h); lanes below -87.3 (where float32
// exp leaves the normal range; -inf included) give 0. AVX-512: n by one rounding and 2^n by vscalefps; else n by
// truncation and a fix-up, 2^n built in the exponent bits.
inline vf exp_v(vf x) {
  const vf xc = x < -87.0f ? vf{} - 87.0f : x;
#ifdef __AVX512F__
  const vf nf =
      (vf)_mm512_roundscale_ps((__m512)(xc * 1.44269504088896341f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const vf t = xc * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(t, vi);
  n += __builtin_convertvector(n, vf) > t;  // truncation rounded a negative t up: one down (true is -1)
  const vf nf = __builtin_convertvector(n, vf);
#endif
  const vf p = exp_reduced(xc, nf);
#ifdef __AVX512F__
  const vf e = (vf)_mm512_scalef_ps((__m512)p, (__m512)nf);
#else
  const vi bits = (n + 127) << 23;
  vf e;
  std::memcpy(&e, &bits, sizeof(e));
  e *= p;
#endif
  return x < -87.3f ? vf{} : e;
}

// Every lane of the result holds the max (sum) of v's lanes: a butterfly of log2(W) lane swaps.
#if defined(__AVX512F__)
#define VLITE_SWAPS {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}, {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}, \
    {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}, {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}
constexpr int kSwaps = 4;
#else
#define VLITE_SWAPS {4, 5, 6, 7, 0, 1, 2, 3}, {2, 3, 0, 1, 6, 7, 4, 5}, {1, 0, 3, 2, 5, 4, 7, 6}
constexpr int kSwaps = 3;
#endif
inline vf all_max(vf v) {
  const vi swaps[kSwaps] = {VLITE_SWAPS};
  _Pragma("GCC unroll 4") for (int i = 0; i < kSwaps; ++i) {
    const vf o = __builtin_shuffle(v, swaps[i]);
    v = o > v ? o : v;
  }
  return v;
}
inline vf all_sum(vf v) {
  const vi swaps[kSwaps] = {VLITE_SWAPS};
  _Pragma("GCC unroll 4") for (int i = 0; i < kSwaps; ++i) v += __builtin_shuffle(v, swaps[i]);
  return v;
}

// In place over a row of lpad (a multiple of kW) scores whose entries past len are -inf and whose lane-wise max
// is mx: p = exp(p - max(p)) (0 in the padding); returns their sum.
inline float softmax_row(float* __restrict p, int64_t lpad, vf mx) {
  const vf m = all_max(mx);
  vf sum{};
  for (int64_t j = 0; j < lpad; j += kW) {
    const vf e = exp_v(loadv(p + j) - m);
    storev(e, p + j);
    sum += e;
  }
  return all_sum(sum)[0];
}

// out rows (R of them, DV vectors each) = inv[r] * sum_j p[r, j] * v[j]: v row j at vbase + j * ldv.
template <int DV, int R>
inline void pv_tile(const float* __restrict p, int64_t lpad, const float* __restrict vbase, int64_t ldv,
                    int64_t len, const float* inv, float* const* out) {
  vf acc[R][DV];
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 16") for (int dv = 0; dv < DV; ++dv) acc[r][dv] = vf{};
  for (int64_t j = 0; j < len; ++j) {
    const float* vr = vbase + j * ldv;
    vf vv[DV];
    _Pragma("GCC unroll 16") for (int dv = 0; dv < DV; ++dv) vv[dv] = loadv(vr + dv * kW);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
      const float pj = p[r * lpad + j];
      _Pragma("GCC unroll 16") for (int dv = 0; dv < DV; ++dv) acc[r][dv] += pj * vv[dv];
    }
  }
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
    if (out[r] != nullptr)
      _Pragma("GCC unroll 16") for (int dv = 0; dv < DV; ++dv) storev(acc[r][dv] * inv[r], out[r] + dv * kW);
}

// Rows of a P @ V tile: the largest divisor of kBlock whose tile keeps within kAcc accumulators (at least 1).
constexpr int tile_rows(int dv) {
  int r = static_cast<int>(kBlock);
  while (r > 1 && (r * dv > kAcc || kBlock % r != 0)) --r;
  return r;
}

template <int DV>
inline void pv_block(const float* p, int64_t lpad, const float* vbase, int64_t ldv, int64_t len, const float* inv,
                     float* const* out) {
  constexpr int RR = tile_rows(DV);
  for (int64_t r0 = 0; r0 < kBlock; r0 += RR) pv_tile<DV, RR>(p + r0 * lpad, lpad, vbase, ldv, len, inv + r0, out + r0);
}

// Any head_dim: plain loops (the compiler vectorises along D).
inline void pv_generic(const float* p, int64_t lpad, const float* vbase, int64_t ldv, int64_t len, int64_t d_len,
                       const float* inv, float* const* out) {
  for (int64_t r = 0; r < kBlock; ++r) {
    float* o = out[r];
    if (o == nullptr) continue;
    for (int64_t d = 0; d < d_len; ++d) o[d] = 0.0f;
    for (int64_t j = 0; j < len; ++j) {
      const float pj = p[r * lpad + j];
      const float* vr = vbase + j * ldv;
#pragma omp simd
      for (int64_t d = 0; d < d_len; ++d) o[d] += pj * vr[d];
    }
    for (int64_t d = 0; d < d_len; ++d) o[d] *= inv[r];
  }
}

void run_item(const Item& it, const float* qp, const float* kp, const float* vp, float* op, int64_t qs0, int64_t qs1,
              int64_t ks0, int64_t ks1, int64_t vs0, int64_t vs1, int64_t heads, int64_t d_len, float scale,
              float* kt, float* scores, const float* zeros) {
  const int64_t len = it.len, lpad = (len + kW - 1) / kW * kW;
  // This item's rows of q (its chunk), k and v (the whole prompt), this head's slice: requested up front so the
  // cache misses overlap (the rows lie a fused-qkv row apart; their first touch is the step's memory cost).
  for (int64_t j = 0; j < len; ++j)
    for (int64_t d = 0; d < d_len; d += 16) {
      __builtin_prefetch(kp + (it.start + j) * ks0 + it.head * ks1 + d);
      __builtin_prefetch(vp + (it.start + j) * vs0 + it.head * vs1 + d);
    }
  for (int64_t j = it.q0; j < it.q1; ++j)
    for (int64_t d = 0; d < d_len; d += 16) __builtin_prefetch(qp + (it.start + j) * qs0 + it.head * qs1 + d);
  // K^T of this prompt and head: kt[d, j] = k[start + j, head, d]; padding columns 0.
  const float* kb = kp + it.start * ks0 + it.head * ks1;
  for (int64_t d = 0; d < d_len; ++d) {
    float* row = kt + d * lpad;
    for (int64_t j = 0; j < len; ++j) row[j] = kb[j * ks0 + d];
  }
  for (int64_t d = 0; d < d_len; ++d)
    for (int64_t j = len; j < lpad; ++j) kt[d * lpad + j] = 0.0f;
  float* bias = kt + d_len * lpad;  // 0 on the prompt's keys, -inf on the padding to a whole vector
  for (int64_t j = 0; j < lpad; ++j) bias[j] = j < len ? 0.0f : -__builtin_inff();
  const float* vbase = vp + it.start * vs0 + it.head * vs1;
  const int64_t dv = d_len % kW == 0 ? d_len / kW : 0;
  for (int64_t i0 = it.q0; i0 < it.q1; i0 += kBlock) {
    const float* qrow[kBlock];
    float* orow[kBlock];
    float inv[kBlock];
    for (int64_t r = 0; r < kBlock; ++r) {
      const bool valid = i0 + r < it.q1;
      qrow[r] = valid ? qp + (it.start + i0 + r) * qs0 + it.head * qs1 : zeros;
      orow[r] = valid ? op + ((it.start + i0 + r) * heads + it.head) * d_len : nullptr;
    }
    vf rmax[kBlock];
    for (int64_t r = 0; r < kBlock; ++r) rmax[r] = vf{} - __builtin_inff();
    for (int64_t r0 = 0; r0 < kBlock; r0 += kQRows)
      score_tile(qrow + r0, kt, d_len, lpad, scale, bias, scores + r0 * lpad, rmax + r0);
    for (int64_t r = 0; r < kBlock; ++r) inv[r] = 1.0f / softmax_row(scores + r * lpad, lpad, rmax[r]);
    switch (dv) {
      case 1: pv_block<1>(scores, lpad, vbase, vs0, len, inv, orow); break;
      case 2: pv_block<2>(scores, lpad, vbase, vs0, len, inv, orow); break;
      case 3: pv_block<3>(scores, lpad, vbase, vs0, len, inv, orow); break;
      case 4: pv_block<4>(scores, lpad, vbase, vs0, len, inv, orow); break;
      case 6: pv_block<6>(scores, lpad, vbase, vs0, len, inv, orow); break;
      case 8: pv_block<8>(scores, lpad, vbase, vs0, len, inv, orow); break;
      default: pv_generic(scores, lpad, vbase, vs0, len, d_len, inv, orow); break;
    }
  }
}

at::Tensor encoder_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& cu_seqlens, double scale) {
  // Every check runs before any data is read and before the parallel region (whose body cannot throw).
  auto check_qkv = [&q](const at::Tensor& t, const char* name) {
    check_cpu(t, name);
    check_dtype(t, at::kFloat, name);
    check_dim(t, 3, name);
    TORCH_CHECK_VALUE(t.stride(2) == 1, msg("encoder_attention_cpu: ", name, " needs unit stride along head_dim, got strides ",
                                            t.strides()));
    TORCH_CHECK_VALUE(t.sizes() == q.sizes(), msg("encoder_attention_cpu: q ", q.sizes(), " and ", name, " ",
                                                  t.sizes(), " must have the same shape"));
  };
  check_qkv(q, "q");
  check_qkv(k, "k");
  check_qkv(v, "v");
  check_cpu(cu_seqlens, "cu_seqlens");
  check_dim(cu_seqlens, 1, "cu_seqlens");
  check_contiguous(cu_seqlens, "cu_seqlens");
  const auto st = cu_seqlens.scalar_type();
  TORCH_CHECK_TYPE(st == at::kInt || st == at::kLong,
                   msg("encoder_attention_cpu: cu_seqlens must be int32 or int64, got ", st));
  const int64_t t_len = q.size(0), heads = q.size(1), d_len = q.size(2);
  const int64_t nb = cu_seqlens.size(0) - 1;
  TORCH_CHECK_VALUE(nb >= 0, "encoder_attention_cpu: cu_seqlens must hold at least one offset");
  TORCH_CHECK_VALUE(d_len > 0 && heads > 0, msg("encoder_attention_cpu: empty heads in q ", q.sizes()));
  std::vector<int64_t> cu(static_cast<size_t>(nb + 1));
  for (int64_t i = 0; i <= nb; ++i)
    cu[i] = st == at::kInt ? static_cast<int64_t>(cu_seqlens.data_ptr<int32_t>()[i]) : cu_seqlens.data_ptr<int64_t>()[i];
  TORCH_CHECK_VALUE(nb == 0 || cu[0] == 0, msg("encoder_attention_cpu: cu_seqlens[0] = ", cu[0], ", not 0"));
  for (int64_t i = 0; i < nb; ++i)
    TORCH_CHECK_VALUE(cu[i + 1] >= cu[i], msg("encoder_attention_cpu: cu_seqlens decreases at ", i + 1, " (", cu[i],
                                              " -> ", cu[i + 1], ")"));
  TORCH_CHECK_VALUE(nb == 0 ? t_len == 0 : cu[nb] == t_len,
                    msg("encoder_attention_cpu: cu_seqlens ends at ", cu[nb], " but q has ", t_len, " rows"));
  at::Tensor out = at::empty({t_len, heads, d_len}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (t_len == 0) return out;

  std::vector<Item> items;
  int64_t lmax = 0, macs = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t len = cu[b + 1] - cu[b];
    if (len == 0) continue;
    lmax = std::max(lmax, len);
    macs += 2 * len * len * d_len * heads;
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t q0 = 0; q0 < len; q0 += kChunk) items.push_back({cu[b], len, h, q0, std::min(len, q0 + kChunk)});
  }
  // Largest first: the dynamic schedule then ends with small items (balanced finish).
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.len * (a.q1 - a.q0) > b.len * (b.q1 - b.q0); });
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int num_threads = macs < kSerialMacs ? 1
                                             : static_cast<int>(std::max<int64_t>(
                                                   1, std::min<int64_t>(at::get_num_threads(), n_items)));
  const int64_t lpad_max = (lmax + kW - 1) / kW * kW;
  const int64_t per_thread = (d_len + 1) * lpad_max + kBlock * lpad_max;
  // Scratch before any parallel region (an allocation failure must raise, not leave a region).
  std::vector<float> scratch(static_cast<size_t>(per_thread * num_threads));
  std::vector<float> zeros(static_cast<size_t>(d_len), 0.0f);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1);
  const float sc = static_cast<float>(scale);

#pragma omp parallel num_threads(num_threads)
  {
#ifdef _OPENMP
    const int tid = omp_get_thread_num();
#else
    const int tid = 0;
#endif
    float* kt = scratch.data() + tid * per_thread;
    float* scores = kt + (d_len + 1) * lpad_max;
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < n_items; ++w)
      run_item(items[w], qp, kp, vp, op, qs0, qs1, ks0, ks1, vs0, vs1, heads, d_len, sc, kt, scores, zeros.data());
  }
  return out;
}

}  // namespace
}  // namespace vllm_lite

TORCH_LIBRARY_FRAGMENT(vllm_lite, m) {
  m.def("encoder_attention_cpu(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_lite, CPU, m) { m.impl("encoder_attention_cpu", &vllm_lite::encoder_attention_cpu); }
