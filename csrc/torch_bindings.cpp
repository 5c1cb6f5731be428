// Registers vllm-lite's CPU kernels as torch.ops.vllm_lite.* (schemas here, CPU implementations in ops.h).

#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(vllm_lite, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, float scale, int sliding_window=0, float logits_soft_cap=0.0, str impl=\"auto\") -> ()");
  // No tensor arguments, so no dispatch key: defined with their kernels (catch-all).
  m.def("paged_attention_impl(int head_size, float logits_soft_cap=0.0, str impl=\"auto\") -> str",
        &vllm_lite::paged_attention_impl);
  m.def("attention_impls() -> str[]", &vllm_lite::attention_impls);
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("copy_blocks(Tensor(a!)[] kv_caches, Tensor src_to_dst) -> ()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor src_to_dst) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_lite, CPU, m) {
  m.impl("paged_attention", &vllm_lite::paged_attention);
  m.impl("write_kv", &vllm_lite::write_kv);
  m.impl("swap_blocks", &vllm_lite::swap_blocks);
  m.impl("copy_blocks", &vllm_lite::copy_blocks);
}
