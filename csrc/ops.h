// Declarations of vllm-lite's CPU kernels; registered as torch.ops.vllm_lite.* in torch_bindings.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace vllm_lite {

// Causal paged attention over a mixed batch of prefill chunks and decodes.
// out/query: [T, H, D]; kv_cache: [2, num_blocks, block_size, KVH, D];
// block_table int32 [B, M]; seq_lens int32 [B]; query_start_loc int32 [B+1].
// sliding_window W > 0: a query at position p sees keys in (p - W, p]; blocks before that are not read.
// logits_soft_cap c > 0: scores become c * tanh(score / c). 0 turns either off.
// impl: "auto" (the fastest key loop built here for this head size), or "avx512" / "avx2" /
// "portable" to ask for one (benchmarks, tests); a path that does not apply falls to the next.
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_table, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
                     double logits_soft_cap, c10::string_view impl);

// The key loop paged_attention runs for this head size, soft-capping and impl request.
std::string paged_attention_impl(int64_t head_size, double logits_soft_cap, c10::string_view impl);

// The key loops built into this library, fastest first ("avx512", "avx2", "portable").
std::vector<std::string> attention_impls();

// Scatter key/value rows [T, KVH, D] into the cache at slot_mapping (int64 [T]; negative = skip).
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
              const at::Tensor& slot_mapping);

// Duplicate whole blocks (keys and values) inside each cache: src_to_dst int64 [N, 2].
void copy_blocks(const std::vector<at::Tensor>& kv_caches, const at::Tensor& src_to_dst);

// Copy whole blocks from one cache to another of the same block shape: src_to_dst int64 [N, 2].
void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& src_to_dst);

// The VNNI-layout weight ([N/32, K/2, 32, 2] bf16) the calling thread's next bf16_linear_vnni /
// bf16_gate_up_vnni call will read (nullptr: none), for the calling thread until changed: each VNNI call's threads
// prefetch (into L2) the start of the first block each will take of it while they work on their own last block
// (csrc/bf16_small_m.cpp; addresses only, no result changes). The decoder stack sets it before each linear.
void set_vnni_next_weight(const at::Tensor* weight_vnni);

}  // namespace vllm_lite
