// KV-cache maintenance on CPU: scatter new keys/values into slots, copy and swap whole blocks.
// All three are byte copies (dtype-agnostic), parallel over rows/blocks; shapes and indices are checked
// first, before any copy and outside the parallel bodies (which only copy memory and cannot throw).

#include "cpu_common.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

namespace vllm_lite {
namespace {

void check_kv_cache(const at::Tensor& c, const char* name) {
  check_cpu(c, name);
  check_dim(c, 5, name);
  check_contiguous(c, name);
  TORCH_CHECK_VALUE(c.size(0) == 2, msg(name, ".size(0) must be 2 (keys, values), got ", c.size(0)));
}

void check_pairs(const at::Tensor& src_to_dst) {
  check_cpu(src_to_dst, "src_to_dst");
  check_dtype(src_to_dst, at::kLong, "src_to_dst");
  TORCH_CHECK_VALUE(src_to_dst.numel() == 0 || (src_to_dst.dim() == 2 && src_to_dst.size(1) == 2),
                    msg("src_to_dst must have shape [N, 2], got ", src_to_dst.sizes()));
  check_contiguous(src_to_dst, "src_to_dst");
}

// Copies block src of cache a to block dst of cache b, keys and values.
inline void copy_block(const char* a, char* b, int64_t a_half, int64_t b_half, int64_t block_bytes, int64_t src,
                       int64_t dst) {
  std::memcpy(b + dst * block_bytes, a + src * block_bytes, block_bytes);
  std::memcpy(b + b_half + dst * block_bytes, a + a_half + src * block_bytes, block_bytes);
}

}  // namespace

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
              const at::Tensor& slot_mapping) {
  // Metadata checks first (device, dims, dtypes, layout, shapes), then the slot values, then the copy.
  check_cpu(key, "key");
  check_cpu(value, "value");
  check_cpu(slot_mapping, "slot_mapping");
  check_kv_cache(kv_cache, "kv_cache");
  check_dim(key, 3, "key");
  check_dim(value, 3, "value");
  check_dim(slot_mapping, 1, "slot_mapping");
  check_dtype(slot_mapping, at::kLong, "slot_mapping");
  check_contiguous(slot_mapping, "slot_mapping");
  TORCH_CHECK_TYPE(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
                   msg("key/value dtype (", key.scalar_type(), "/", value.scalar_type(),
                       ") must equal kv_cache dtype ", kv_cache.scalar_type()));
  const int64_t n = key.size(0);
  const int64_t kvh = kv_cache.size(3), d = kv_cache.size(4);
  TORCH_CHECK_VALUE(key.size(1) == kvh && key.size(2) == d && value.sizes() == key.sizes(),
                    msg("key/value must have shape [T, ", kvh, ", ", d, "], got ", key.sizes(), " and ",
                        value.sizes()));
  TORCH_CHECK_VALUE(slot_mapping.size(0) >= n,
                    msg("slot_mapping has ", slot_mapping.size(0), " entries for ", n, " tokens"));
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK_VALUE(t->stride(2) == 1 && t->stride(1) == d,
                      msg("key/value rows must be contiguous [KVH, D] (strides ", t->strides(), ")"));
  }
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK_VALUE(slots[t] < num_slots, msg("slot_mapping[", t, "] = ", slots[t], " is outside the cache's ",
                                                num_slots, " slots"));
  }
  if (n == 0) return;
  const int64_t elt = kv_cache.element_size();
  const int64_t row_bytes = kvh * d * elt;
  char* k_dst = static_cast<char*>(kv_cache.data_ptr());
  char* v_dst = k_dst + num_slots * row_bytes;
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * elt, v_stride = value.stride(0) * elt;
  // The body only copies memory: nothing in it throws.
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding token
      std::memcpy(k_dst + slot * row_bytes, k_src + t * k_stride, row_bytes);
      std::memcpy(v_dst + slot * row_bytes, v_src + t * v_stride, row_bytes);
    }
  });
}

void copy_blocks(const std::vector<at::Tensor>& kv_caches, const at::Tensor& src_to_dst) {
  check_pairs(src_to_dst);
  for (const at::Tensor& c : kv_caches) check_kv_cache(c, "kv_caches[i]");
  const int64_t n = src_to_dst.numel() / 2;
  if (n == 0 || kv_caches.empty()) return;
  const int64_t* pairs = src_to_dst.data_ptr<int64_t>();
  const int64_t num_caches = static_cast<int64_t>(kv_caches.size());
  // Everything the copies need, read here: the parallel body below touches no tensor and cannot throw.
  std::vector<char*> bases(num_caches);
  std::vector<int64_t> halves(num_caches), block_bytes(num_caches);
  for (int64_t i = 0; i < num_caches; ++i) {
    const at::Tensor& c = kv_caches[i];
    const int64_t nb = c.size(1);
    for (int64_t p = 0; p < 2 * n; ++p) {
      TORCH_CHECK_VALUE(pairs[p] >= 0 && pairs[p] < nb, msg("src_to_dst[", p / 2, "] = ", pairs[p],
                                                            " is outside cache ", i, "'s ", nb, " blocks"));
    }
    bases[i] = static_cast<char*>(c.data_ptr());
    halves[i] = c.stride(0) * c.element_size();
    block_bytes[i] = c.stride(1) * c.element_size();
  }
  at::parallel_for(0, num_caches * n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / n, p = w % n;
      copy_block(bases[i], bases[i], halves[i], halves[i], block_bytes[i], pairs[2 * p], pairs[2 * p + 1]);
    }
  });
}

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& src_to_dst) {
  check_kv_cache(src, "src");
  check_kv_cache(dst, "dst");
  check_pairs(src_to_dst);
  TORCH_CHECK_TYPE(src.scalar_type() == dst.scalar_type(),
                   msg("src dtype ", src.scalar_type(), " != dst dtype ", dst.scalar_type()));
  TORCH_CHECK_VALUE(src.sizes().slice(2) == dst.sizes().slice(2),
                    msg("src and dst blocks differ in shape: ", src.sizes(), " vs ", dst.sizes()));
  const int64_t n = src_to_dst.numel() / 2;
  const int64_t* pairs = src_to_dst.data_ptr<int64_t>();
  for (int64_t p = 0; p < n; ++p) {
    TORCH_CHECK_VALUE(pairs[2 * p] >= 0 && pairs[2 * p] < src.size(1),
                      msg("src_to_dst[", p, ", 0] = ", pairs[2 * p], " is outside src's ", src.size(1), " blocks"));
    TORCH_CHECK_VALUE(pairs[2 * p + 1] >= 0 && pairs[2 * p + 1] < dst.size(1),
                      msg("src_to_dst[", p, ", 1] = ", pairs[2 * p + 1], " is outside dst's ", dst.size(1),
                          " blocks"));
  }
  const int64_t block_bytes = src.stride(1) * src.element_size();
  const char* a = static_cast<const char*>(src.data_ptr());
  char* b = static_cast<char*>(dst.data_ptr());
  const int64_t a_half = src.stride(0) * src.element_size(), b_half = dst.stride(0) * dst.element_size();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) copy_block(a, b, a_half, b_half, block_bytes, pairs[2 * p], pairs[2 * p + 1]);
  });
}

}  // namespace vllm_lite
