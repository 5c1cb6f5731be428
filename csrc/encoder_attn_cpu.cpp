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
// largest first, dynamic. Per item, for each block of kW query rows (one query per vector lane): the block's
// queries transposed in registers into qt [D, kW]; scores key-major, st[j, lane] = q[lane] . k[j], kKeys keys
// at a time (one accumulator per key, the key's element broadcast from its row in place: K needs no transposed
// copy); a lane-wise softmax along the keys (max kept while the scores are stored, vector exp, float32 sums;
// no reduction across lanes); then P @ V along D (rows x D/W vectors per tile) scaled by 1/sum once.
// Every output element is computed by one work item in a fixed order: results do not depend on the thread
// count. GCC vector extensions of the native width (16 floats with AVX-512F, else 8), so AVX-512 and AVX2 hosts
// build the same source; AVX-512 only adds two intrinsics to the exp (rounding and vscalefps).
// History (HE, 2026-11-27): the first layout (scores query-major over a transposed K, row-wise softmax with
// horizontal max/sum) ran the benchmark's attention at 0.27 s a pass; key-major scores over queries
// transposed in registers: 0.225 s (micro, 2 Zen 4 threads; AVX2 build 0.41 -> 0.35 s).

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
constexpr int64_t kW = 16;  // float32 lanes of one native vector = query rows of a block
constexpr int kKeys = 12;   // keys of a score tile (12 accumulators, one query vector each)
constexpr int kAcc = 16;    // accumulators of a P @ V tile
#else
constexpr int64_t kW = 8;
constexpr int kKeys = 8;
constexpr int kAcc = 8;
#endif
typedef float vf __attribute__((vector_size(kW * 4)));

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

// Scores of one block of kW query rows, transposed: st[j * kW + lane] = qt[:, lane] . k[j] for keys j in
// [j0, j0 + KJ) (qt: [D, kW], the block's queries transposed; key row j at kb + j * ldk), times scale,, and
// the lane-wise running max in mx.
template <int KJ>
inline void score_keys(const float* __restrict qt, const float* __restrict kb, int64_t ldk, int64_t d_len,
                       int64_t j0, float scale, float* __restrict st, vf& mx) {
  vf acc[KJ];
  const float* kr[KJ];
  _Pragma("GCC unroll 16") for (int c = 0; c < KJ; ++c) {
    acc[c] = vf{};
    kr[c] = kb + (j0 + c) * ldk;
  }
  for (int64_t d = 0; d < d_len; ++d) {
    const vf q = loadv(qt + d * kW);
    _Pragma("GCC unroll 16") for (int c = 0; c < KJ; ++c) acc[c] += kr[c][d] * q;
  }
  _Pragma("GCC unroll 16") for (int c = 0; c < KJ; ++c) {
    const vf x = acc[c] * scale;
    mx = x > mx ? x : mx;
    storev(x, st + (j0 + c) * kW);
  }
}

typedef int32_t vi __attribute__((vector_size(kW * 4)));

// In-register transpose of a kW x kW block (m[r] = row r -> m[d] = column d): log2(kW) rounds, each swapping
// the off-diagonal h x h sub-blocks of every row pair (r, r + h) by two-source lane shuffles.
#if defined(__AVX512F__)
#define VLITE_TMASKS \
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}, \
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}, \
    {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}, \
    {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}, \
    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}, \
    {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}, \
    {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}, \
    {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}
constexpr int kTRounds = 4;
#else
#define VLITE_TMASKS {0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}, \
    {0, 1, 8, 9, 4, 5, 12, 13}, {2, 3, 10, 11, 6, 7, 14, 15}, \
    {0, 8, 2, 10, 4, 12, 6, 14}, {1, 9, 3, 11, 5, 13, 7, 15}
constexpr int kTRounds = 3;
#endif
inline void transpose_block(vf* m) {
  const vi masks[2 * kTRounds] = {VLITE_TMASKS};
  _Pragma("GCC unroll 4") for (int s = 0; s < kTRounds; ++s) {
    const int h = static_cast<int>(kW) >> (s + 1);
    _Pragma("GCC unroll 16") for (int r = 0; r < kW; ++r) {
      if (r & h) continue;
      const vf a = m[r], b = m[r + h];
      m[r] = __builtin_shuffle(a, b, masks[2 * s]);
      m[r + h] = __builtin_shuffle(a, b, masks[2 * s + 1]);
    }
  }
}

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

// out rows r0 .. r0 + R - 1 of the block (DV vectors each) = inv[r] * sum_j st[j * kW + r] * v[j]: v row j at
// vbase + j * ldv; rows whose out pointer is null are skipped at the store.
template <int DV, int R>
inline void pv_tile(const float* __restrict st, const float* __restrict vbase, int64_t ldv, int64_t len,
                    const float* inv, float* const* out) {
  vf acc[R][DV];
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 16") for (int dv = 0; dv < DV; ++dv) acc[r][dv] = vf{};
  for (int64_t j = 0; j < len; ++j) {
    const float* vr = vbase + j * ldv;
    const float* pj = st + j * kW;
    vf vv[DV];
    _Pragma("GCC unroll 16") for (int dv = 0; dv < DV; ++dv) vv[dv] = loadv(vr + dv * kW);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
      const float p = pj[r];
      _Pragma("GCC unroll 16") for (int dv = 0; dv < DV; ++dv) acc[r][dv] += p * vv[dv];
    }
  }
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
    if (out[r] != nullptr)
      _Pragma("GCC unroll 16") for (int dv = 0; dv < DV; ++dv) storev(acc[r][dv] * inv[r], out[r] + dv * kW);
}

// Rows of a P @ V tile: the largest divisor of kW whose tile keeps within kAcc accumulators (at least 1).
constexpr int tile_rows(int dv) {
  int r = static_cast<int>(kW);
  while (r > 1 && (r * dv > kAcc || kW % r != 0)) --r;
  return r;
}

template <int DV>
inline void pv_block(const float* st, const float* vbase, int64_t ldv, int64_t len, const float* inv,
                     float* const* out) {
  constexpr int RR = tile_rows(DV);
  for (int64_t r0 = 0; r0 < kW; r0 += RR) pv_tile<DV, RR>(st + r0, vbase, ldv, len, inv + r0, out + r0);
}

// Any head_dim: plain loops (the compiler vectorises along D).
inline void pv_generic(const float* st, const float* vbase, int64_t ldv, int64_t len, int64_t d_len,
                       const float* inv, float* const* out) {
  for (int64_t r = 0; r < kW; ++r) {
    float* o = out[r];
    if (o == nullptr) continue;
    for (int64_t d = 0; d < d_len; ++d) o[d] = 0.0f;
    for (int64_t j = 0; j < len; ++j) {
      const float pj = st[j * kW + r];
      const float* vr = vbase + j * ldv;
#pragma omp simd
      for (int64_t d = 0; d < d_len; ++d) o[d] += pj * vr[d];
    }
    for (int64_t d = 0; d < d_len; ++d) o[d] *= inv[r];
  }
}

// One work item: for each block of kW query rows, the block's queries transposed into qt, its
// scores against every key of the prompt stored key-major (st[j, lane]: the softmax runs lane-wise, one query
// per lane, with no reduction across lanes), then P @ V.
void run_item(const Item& it, const float* qp, const float* kp, const float* vp, float* op, int64_t qs0, int64_t qs1,
              int64_t ks0, int64_t ks1, int64_t vs0, int64_t vs1, int64_t heads, int64_t d_len, float scale,
              float* qt, float* st) {
  const int64_t len = it.len;
  // This item's rows of q (its chunk), k and v (the whole prompt), this head's slice: requested up front so the
  // cache misses overlap (the rows lie a fused-qkv row apart; their first touch is the step's memory cost).
  for (int64_t j = 0; j < len; ++j)
    for (int64_t d = 0; d < d_len; d += 16) {
      __builtin_prefetch(kp + (it.start + j) * ks0 + it.head * ks1 + d);
      __builtin_prefetch(vp + (it.start + j) * vs0 + it.head * vs1 + d);
    }
  for (int64_t j = it.q0; j < it.q1; ++j)
    for (int64_t d = 0; d < d_len; d += 16) __builtin_prefetch(qp + (it.start + j) * qs0 + it.head * qs1 + d);
  const float* kb = kp + it.start * ks0 + it.head * ks1;
  const float* vbase = vp + it.start * vs0 + it.head * vs1;
  const int64_t dv = d_len % kW == 0 ? d_len / kW : 0;
  for (int64_t i0 = it.q0; i0 < it.q1; i0 += kW) {
    const int64_t rows = std::min<int64_t>(kW, it.q1 - i0);
    float* orow[kW];
    for (int64_t r = 0; r < kW; ++r)
      orow[r] = r < rows ? op + ((it.start + i0 + r) * heads + it.head) * d_len : nullptr;
    // qt[d, r] = q[row r of the block, d]; lanes past the block's rows 0.
    const float* qb = qp + (it.start + i0) * qs0 + it.head * qs1;
    if (d_len % kW == 0) {  // kW x kW blocks transposed in registers
      for (int64_t d0 = 0; d0 < d_len; d0 += kW) {
        vf m[kW];
        _Pragma("GCC unroll 16") for (int r = 0; r < kW; ++r) m[r] = r < rows ? loadv(qb + r * qs0 + d0) : vf{};
        transpose_block(m);
        _Pragma("GCC unroll 16") for (int d = 0; d < kW; ++d) storev(m[d], qt + (d0 + d) * kW);
      }
    } else {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < d_len; ++d) qt[d * kW + r] = qb[r * qs0 + d];
      for (int64_t r = rows; r < kW; ++r)
        for (int64_t d = 0; d < d_len; ++d) qt[d * kW + r] = 0.0f;
    }
    vf mx = vf{} - __builtin_inff();
    int64_t j = 0;
    for (; j + kKeys <= len; j += kKeys) score_keys<kKeys>(qt, kb, ks0, d_len, j, scale, st, mx);
    if (len - j >= 8) { score_keys<8>(qt, kb, ks0, d_len, j, scale, st, mx); j += 8; }
    if (len - j >= 4) { score_keys<4>(qt, kb, ks0, d_len, j, scale, st, mx); j += 4; }
    if (len - j >= 2) { score_keys<2>(qt, kb, ks0, d_len, j, scale, st, mx); j += 2; }
    if (len - j >= 1) { score_keys<1>(qt, kb, ks0, d_len, j, scale, st, mx); j += 1; }
    // Lane-wise softmax along the keys: p = exp(s - max) in place, 1 / sum per lane.
    vf sum{};
    for (int64_t jj = 0; jj < len; ++jj) {
      const vf e = exp_v(loadv(st + jj * kW) - mx);
      storev(e, st + jj * kW);
      sum += e;
    }
    alignas(64) float inv[kW];
    storev(1.0f / sum, inv);
    switch (dv) {
      case 1: pv_block<1>(st, vbase, vs0, len, inv, orow); break;
      case 2: pv_block<2>(st, vbase, vs0, len, inv, orow); break;
      case 3: pv_block<3>(st, vbase, vs0, len, inv, orow); break;
      case 4: pv_block<4>(st, vbase, vs0, len, inv, orow); break;
      case 6: pv_block<6>(st, vbase, vs0, len, inv, orow); break;
      case 8: pv_block<8>(st, vbase, vs0, len, inv, orow); break;
      default: pv_generic(st, vbase, vs0, len, d_len, inv, orow); break;
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
  const int64_t per_thread = (d_len + lmax) * kW;
  // Scratch before any parallel region (an allocation failure must raise, not leave a region).
  std::vector<float> scratch(static_cast<size_t>(per_thread * num_threads));
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
    float* qt = scratch.data() + tid * per_thread;
    float* st = qt + d_len * kW;
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < n_items; ++w)
      run_item(items[w], qp, kp, vp, op, qs0, qs1, ks0, ks1, vs0, vs1, heads, d_len, sc, qt, st);
  }
  return out;
}

}  // namespace
}  // namespace vllm_lite

TORCH_LIBRARY_FRAGMENT(vllm_lite, m) {
  m.def("encoder_attention_cpu(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_lite, CPU, m) { m.impl("encoder_attention_cpu", &vllm_lite::encoder_attention_cpu); }
