// int4 (AWQ/GPTQ) weight dequantization for CPU linear layers: torch.ops.vllm_lite.int4_dequant_nk.
//
// The layer's CPU layout (vllm_lite/quantization/int4_linear.py): qweight [N, K/8] int32 packed along K in
// order (nibble j of word c is input k = 8c + j), zeros [N, G] uint8, scales [N, G] float16/bfloat16/float32,
// and either plain groups (k / (K/G)) or a g_idx [K] int64 (GPTQ act order). One pass writes
// out[n, k] = float(q - z) * float(s) (plain groups: looked up in the group's 16 values), in float32 (exact for half-precision scales: the reference's values) or
// rounded once to bfloat16, into the caller's reusable [N, K] buffer; F.linear then reads it. Rows are
// split over torch's intra-op threads. Plain C++ the compiler vectorises (-O3 -march=native), no intrinsics,
// so it builds on every host the other kernels build on.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "cpu_common.h"
#include "int4_small_m.h"

namespace vllm_lite {
namespace {

template <typename S, typename O>
void dequant_plain(const int32_t* __restrict qw, const uint8_t* __restrict zeros, const S* __restrict scales,
                   O* __restrict out, int64_t n_rows, int64_t k, int64_t groups) {
  const int64_t words_per_group = k / groups / 8;
  at::parallel_for(0, n_rows, 1, [&](int64_t n0, int64_t n1) {
    O lut[16];  // the group's 16 possible values, computed once per group as (q - z) * s
    for (int64_t n = n0; n < n1; ++n) {
      const int32_t* q_row = qw + n * (k / 8);
      O* o_row = out + n * k;
      for (int64_t g = 0; g < groups; ++g) {
        const int32_t z = zeros[n * groups + g];
        const float s = static_cast<float>(scales[n * groups + g]);
        for (int32_t q = 0; q < 16; ++q) lut[q] = static_cast<O>(static_cast<float>(q - z) * s);
        const int64_t c0 = g * words_per_group;
        for (int64_t c = c0; c < c0 + words_per_group; ++c) {
          const uint32_t word = static_cast<uint32_t>(q_row[c]);
          O* o = o_row + c * 8;
          o[0] = lut[word & 0xFu];
          o[1] = lut[(word >> 4) & 0xFu];
          o[2] = lut[(word >> 8) & 0xFu];
          o[3] = lut[(word >> 12) & 0xFu];
          o[4] = lut[(word >> 16) & 0xFu];
          o[5] = lut[(word >> 20) & 0xFu];
          o[6] = lut[(word >> 24) & 0xFu];
          o[7] = lut[word >> 28];
        }
      }
    }
  });
}

template <typename S, typename O>
void dequant_gidx(const int32_t* qw, const uint8_t* zeros, const S* scales, const int64_t* g_idx, O* out,
                  int64_t n_rows, int64_t k, int64_t groups) {
  at::parallel_for(0, n_rows, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int32_t* q_row = qw + n * (k / 8);
      const uint8_t* z_row = zeros + n * groups;
      const S* s_row = scales + n * groups;
      O* o_row = out + n * k;
      for (int64_t i = 0; i < k; ++i) {
        const int32_t q = static_cast<int32_t>((static_cast<uint32_t>(q_row[i / 8]) >> (4 * (i % 8))) & 0xFu);
        const int64_t g = g_idx[i];
        o_row[i] = static_cast<O>(static_cast<float>(q - static_cast<int32_t>(z_row[g])) * static_cast<float>(s_row[g]));
      }
    }
  });
}

template <typename S, typename O>
void dispatch_groups(const at::Tensor& qweight, const at::Tensor& zeros, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& g_idx, at::Tensor& out) {
  const int64_t n = qweight.size(0), k = qweight.size(1) * 8, groups = zeros.size(1);
  const auto* qw = qweight.data_ptr<int32_t>();
  const auto* z = zeros.data_ptr<uint8_t>();
  const auto* s = scales.data_ptr<S>();
  auto* o = out.data_ptr<O>();
  if (g_idx.has_value()) {
    dequant_gidx<S, O>(qw, z, s, g_idx->data_ptr<int64_t>(), o, n, k, groups);
  } else {
    dequant_plain<S, O>(qw, z, s, o, n, k, groups);
  }
}

template <typename O>
void dispatch_scales(const at::Tensor& qweight, const at::Tensor& zeros, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& g_idx, at::Tensor& out) {
  switch (scales.scalar_type()) {
    case at::kHalf:
      return dispatch_groups<c10::Half, O>(qweight, zeros, scales, g_idx, out);
    case at::kBFloat16:
      return dispatch_groups<c10::BFloat16, O>(qweight, zeros, scales, g_idx, out);
    case at::kFloat:
      return dispatch_groups<float, O>(qweight, zeros, scales, g_idx, out);
    default:
      TORCH_CHECK(false, msg("int4_dequant_nk: scales must be float16, bfloat16 or float32, got ",
                             scales.scalar_type()));
  }
}

bool scales_dtype_ok(const at::Tensor& scales) {
  const auto t = scales.scalar_type();
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat;
}

// Metadata checks shared by both ops, in the order device, dtype, dims, layout, shape; no data is read.
// Returns K (inputs). `op` prefixes the messages.
int64_t check_packed_weight(const char* op, const at::Tensor& qweight, const at::Tensor& zeros,
                            const at::Tensor& scales) {
  check_cpu(qweight, "qweight");
  check_cpu(zeros, "zeros");
  check_cpu(scales, "scales");
  TORCH_CHECK(qweight.scalar_type() == at::kInt && qweight.dim() == 2 && qweight.is_contiguous(),
              msg(op, ": qweight must be a contiguous [N, K/8] int32 tensor, got ", qweight.scalar_type(), " ",
                  qweight.sizes()));
  const int64_t n = qweight.size(0), k = qweight.size(1) * 8;
  TORCH_CHECK(zeros.scalar_type() == at::kByte && zeros.dim() == 2 && zeros.size(0) == n && zeros.is_contiguous(),
              msg(op, ": zeros must be a contiguous [N, G] uint8 tensor with N = ", n, ", got ", zeros.scalar_type(),
                  " ", zeros.sizes()));
  const int64_t groups = zeros.size(1);
  TORCH_CHECK(scales_dtype_ok(scales),
              msg(op, ": scales must be float16, bfloat16 or float32, got ", scales.scalar_type()));
  TORCH_CHECK(groups > 0 && scales.dim() == 2 && scales.size(0) == n && scales.size(1) == groups &&
                  scales.is_contiguous(),
              msg(op, ": scales must be a contiguous [N, G] tensor with [N, G] = [", n, ", ", groups, "] (G > 0), got ",
                  scales.sizes()));
  return k;
}

void int4_dequant_nk(at::Tensor& out, const at::Tensor& qweight, const at::Tensor& zeros, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& g_idx) {
  // Every check runs before any data is read and before the parallel loops (whose bodies cannot throw).
  check_cpu(out, "out");
  if (g_idx.has_value()) check_cpu(*g_idx, "g_idx");
  const int64_t k = check_packed_weight("int4_dequant_nk", qweight, zeros, scales);
  const int64_t n = qweight.size(0), groups = zeros.size(1);
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              msg("int4_dequant_nk: out must be float32 or bfloat16, got ", out.scalar_type()));
  TORCH_CHECK(out.dim() == 2 && out.size(0) == n && out.size(1) == k && out.is_contiguous(),
              msg("int4_dequant_nk: out must be a contiguous [N, K] = [", n, ", ", k, "] tensor, got ", out.sizes()));
  if (g_idx.has_value()) {
    TORCH_CHECK(g_idx->scalar_type() == at::kLong && g_idx->dim() == 1 && g_idx->size(0) == k &&
                    g_idx->is_contiguous(),
                msg("int4_dequant_nk: g_idx must be a contiguous [K] = [", k, "] int64 tensor, got ",
                    g_idx->scalar_type(), " ", g_idx->sizes()));
    if (k > 0) {
      const int64_t* gi = g_idx->data_ptr<int64_t>();  // a checked CPU int64 [K] tensor
      const auto [lo, hi] = std::minmax_element(gi, gi + k);
      TORCH_CHECK(*lo >= 0 && *hi < groups,
                  msg("int4_dequant_nk: g_idx values must lie in [0, G = ", groups, "), got [", *lo, ", ", *hi, "]"));
    }
  } else {
    TORCH_CHECK(k % groups == 0 && (k / groups) % 8 == 0,
                msg("int4_dequant_nk: plain groups must be whole words (K/G a multiple of 8), got K = ", k,
                    ", G = ", groups));
  }
  if (out.scalar_type() == at::kFloat) {
    dispatch_scales<float>(qweight, zeros, scales, g_idx, out);
  } else {
    dispatch_scales<c10::BFloat16>(qweight, zeros, scales, g_idx, out);
  }
}

template <typename S, typename O>
void small_m_typed(const at::Tensor& xp, const at::Tensor& qweight, const at::Tensor& zeros, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  int4::small_m_matmul<S, O>(xp.data_ptr<float>(), qweight.data_ptr<int32_t>(), zeros.data_ptr<uint8_t>(),
                             scales.data_ptr<S>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
                             out.data_ptr<O>(), xp.size(0), qweight.size(0), xp.size(1), zeros.size(1));
}

template <typename O>
void small_m_scales(const at::Tensor& xp, const at::Tensor& qweight, const at::Tensor& zeros, const at::Tensor& scales,
                    const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  switch (scales.scalar_type()) {
    case at::kHalf:
      return small_m_typed<c10::Half, O>(xp, qweight, zeros, scales, bias, out);
    case at::kBFloat16:
      return small_m_typed<c10::BFloat16, O>(xp, qweight, zeros, scales, bias, out);
    case at::kFloat:
      return small_m_typed<float, O>(xp, qweight, zeros, scales, bias, out);
    default:
      TORCH_CHECK(false, msg("int4_linear_small_m: scales must be float16, bfloat16 or float32, got ",
                             scales.scalar_type()));
  }
}

// y = x W^T (+ bias) straight from the packed weight (int4_small_m.h), for the few-row forwards of decode.
// x [M, K] float32 or bfloat16 (y in x's dtype); plain groups only (act-order layers dequantize instead).
at::Tensor int4_linear_small_m(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& zeros,
                               const at::Tensor& scales, const c10::optional<at::Tensor>& bias) {
  // Every check runs before any data is read and before the parallel loop (whose body cannot throw).
  check_cpu(x, "x");
  if (bias.has_value()) check_cpu(*bias, "bias");
  const int64_t k = check_packed_weight("int4_linear_small_m", qweight, zeros, scales);
  const int64_t n = qweight.size(0), groups = zeros.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              msg("int4_linear_small_m: x must be float32 or bfloat16, got ", x.scalar_type()));
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, msg("int4_linear_small_m: x must be [M, ", k, "], got ", x.sizes()));
  // K = 0 would make the group size 0 (a division by zero in the kernel): refused, as are partial words.
  TORCH_CHECK(k > 0 && k % groups == 0 && (k / groups) % 8 == 0,
              msg("int4_linear_small_m: plain groups must be whole words (K > 0, K/G a multiple of 8), got K = ", k,
                  ", G = ", groups));
  c10::optional<at::Tensor> bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n,
                msg("int4_linear_small_m: bias must be [", n, "], got ", bias->sizes()));
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0);
  at::Tensor out = at::empty({m, n}, xc.options());
  if (m == 0 || n == 0) return out;
  at::Tensor xp = at::empty({m, k}, xc.options().dtype(at::kFloat));
  if (xc.scalar_type() == at::kFloat) {
    int4::permute_x<float>(xc.data_ptr<float>(), m, k, xp.data_ptr<float>());
  } else {
    int4::permute_x<c10::BFloat16>(xc.data_ptr<c10::BFloat16>(), m, k, xp.data_ptr<float>());
  }
  if (out.scalar_type() == at::kFloat) {
    small_m_scales<float>(xp, qweight, zeros, scales, bias_f, out);
  } else {
    small_m_scales<c10::BFloat16>(xp, qweight, zeros, scales, bias_f, out);
  }
  return out;
}

}  // namespace
}  // namespace vllm_lite

TORCH_LIBRARY_FRAGMENT(vllm_lite, m) {
  m.def("int4_dequant_nk(Tensor(a!) out, Tensor qweight, Tensor zeros, Tensor scales, Tensor? g_idx) -> ()");
  m.def("int4_linear_small_m(Tensor x, Tensor qweight, Tensor zeros, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_lite, CPU, m) {
  m.impl("int4_dequant_nk", &vllm_lite::int4_dequant_nk);
  m.impl("int4_linear_small_m", &vllm_lite::int4_linear_small_m);
}
