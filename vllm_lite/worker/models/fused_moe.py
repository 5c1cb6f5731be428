"""One fused mixture-of-experts layer: top-k routing and grouped expert matmuls over stacked weights.

Every expert's gate and up projections live in ONE tensor `w13_weight` [E, 2I, H] ([gate | up] rows per
expert) and its down projection in `w2_weight` [E, H, I], whatever the checkpoint's layout (per-expert
w1/w3/w2 or gate/up/down_proj, or transformers' in-memory fused gate_up_proj/down_proj): `weight_loader`
stacks them at load. Tensor parallel shards the intermediate dim I of every expert (as vLLM does): each
rank computes a partial down projection for its slice and one all-reduce sums them.

The expert matmuls are grouped: token-expert pairs are sorted by expert and each expert that received
tokens runs two matmuls over all of its tokens (a loop over experts, never over tokens); on CPU, float32
layers run the whole expert path as one C++ op on blocked copies of the weights (KernelExperts,
csrc/moe_cpu.cpp), bfloat16 ones too where the build targets AVX512-BF16 (Bf16KernelExperts), else on
oneDNN-packed copies of each expert's weights (PackedExperts); all are made after loading. On CUDA, with
Triton installed, one Triton kernel per projection does the grouped matmuls without a host sync
(fused_moe_triton.py).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite import envs, platform
from vllm_lite.worker.models.loading import StackedMapping, load_hf_weights
from vllm_lite.worker.models.parallel_linear import (
    copy_checked,
    loaded_shape,
    read_shard,
)
from vllm_lite.worker.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_reduce,
)

# Per-expert checkpoint names: Mixtral's w1 (gate) / w3 (up) / w2 (down), Qwen-MoE's gate/up/down_proj.
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
# transformers' fused in-memory layout, should a checkpoint be saved that way.
_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_PROJ = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, round_to_logits_dtype: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids int64 [T, k]): softmax over all experts in float32, then top-k, then
    (Mixtral; Qwen3-MoE with norm_topk_prob) rescaled so each token's k weights sum to 1. Weights stay
    float32 (Mixtral) or are rounded to the logits' dtype (Qwen3-MoE), as each transformers model does."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_to_logits_dtype:
        weights = weights.to(router_logits.dtype)
    return weights, ids


class PackedExperts:
    """Every expert's gate_up and down weights as oneDNN-packed matrices, for the CPU forward.

    Why: MKL's F.linear ran an expert's [8-32, H] x [H, 2I] product at 20-50 GFLOP/s on Zen 4 (it re-reads the
    weight in its own layout each call); oneDNN on packed weights took half the time at those row counts
    (1.3x at 128). Its sums run in another order, so float32 results move by ~1e-6 relative."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, batch_hint: int = 16) -> None:
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self.inter = w2.shape[-1]
        self.w13 = [reorder(w13[e].detach().contiguous(), batch_hint) for e in range(w13.shape[0])]
        self.w2 = [reorder(w2[e].detach().contiguous(), batch_hint) for e in range(w2.shape[0])]

    @staticmethod
    def _mm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")

    def gate_up(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self._mm(x, self.w13[expert])

    def down(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        return self._mm(h, self.w2[expert])


@functools.cache
def _cpu_moe_kernel() -> bool:
    """Whether csrc's moe_cpu_experts op is built and loaded here (False: no compiler, or a failed build)."""
    from vllm_lite.worker.attention.cpu_kernels import cpu_op

    return cpu_op("moe_cpu_experts") is not None


def _huge_pages(*packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The packed expert weights moved into huge-page-advised memory (as they are where that is off or missing)."""
    from vllm_lite.worker.models.cpu_huge_pages import huge_page_contiguous

    return tuple(huge_page_contiguous(t) for t in packed)


class KernelExperts:
    """Float32 experts in csrc/moe_cpu.cpp's blocked layout; one call runs a layer's whole expert path.

    Why: at decode (8-32 rows an expert) the oneDNN path paid two calls per active expert plus a dozen small torch
    ops per layer and re-read each weight per call; the op groups the pairs by expert, streams each weight block
    once over all of its expert's rows with SiLU-and-mul in registers, and sums each token's k contributions in
    transformers' order (2.1-3x PackedExperts on Zen 4 at 1-64 tokens, 1.3x at 2048; benchmarks/PROFILE.md).
    Its matmul sums run in another order than F.linear's: float32 results move by ~1e-6 relative.

    The packed copies live in huge-page-advised memory (cpu_huge_pages): at decode a layer's experts stream from
    DRAM every step (22 MB a layer of the benchmark's model in float32), and in 4 KiB pages every page is a TLB miss
    and a stop for the hardware prefetchers; with them and the op's own prefetch of the next block, a cold decode
    call of 64 tokens went 1.53 -> 1.01 ms on 2 Zen 4 cores (hot: 0.95-1.05 ms; benchmarks/PROFILE.md)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.inter = w2.shape[-1]
        self.w13, self.w2 = _huge_pages(*torch.ops.vllm_lite.moe_cpu_pack(w13.detach(), w2.detach()))

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.vllm_lite.moe_cpu_experts(
            x, self.w13, self.w2, topk_weights.float().contiguous(), topk_ids.contiguous(), self.inter
        )


@functools.cache
def _cpu_moe_bf16_kernel() -> bool:
    """Whether csrc's bfloat16 expert op is built here (the compiler targets AVX512-BF16: Zen 4, Sapphire Rapids)."""
    from vllm_lite.worker.attention.cpu_kernels import cpu_op

    built = cpu_op("moe_cpu_bf16_built")
    return built is not None and bool(built())


class Bf16KernelExperts:
    """Bfloat16 experts in csrc/moe_cpu.cpp's VDPBF16PS layout (moe_cpu_pack_bf16); one call runs a layer's whole
    expert path as KernelExperts does for float32, with the torch path's bf16 roundings (gate/up, SiLU, product,
    down, each weighted contribution and each add). Why: oneDNN took two calls per active expert plus a dozen
    small torch ops per layer, ~1.1 s of a 2.2-s bf16 pass of moe_throughput.py on Zen 4 (benchmarks/PROFILE.md).
    Its matmul sums run in another order than oneDNN's: outputs move by about one bf16 rounding. Packed copies in
    huge-page-advised memory, as KernelExperts' (a cold decode call of 64 tokens 0.70 -> 0.50 ms with the prefetch)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.inter = w2.shape[-1]
        self.w13, self.w2 = _huge_pages(*torch.ops.vllm_lite.moe_cpu_pack_bf16(w13.detach(), w2.detach()))

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.vllm_lite.moe_cpu_experts_bf16(
            x, self.w13, self.w2, topk_weights.float().contiguous(), topk_ids.contiguous(), self.inter
        )


CpuExperts = PackedExperts | KernelExperts | Bf16KernelExperts


@functools.cache
def _cpu_route_op() -> Optional[Callable[..., tuple[torch.Tensor, torch.Tensor]]]:
    """csrc's moe_cpu_route (the router's product and route() in one call) where it is built here, else None."""
    from vllm_lite.worker.attention.cpu_kernels import cpu_op

    return cpu_op("moe_cpu_route")


def pack_experts_for_cpu(w13: torch.Tensor, w2: torch.Tensor) -> tuple[Optional[CpuExperts], str]:
    """(packed experts, "") where one of the CPU expert paths takes this dtype here: the C++ op for float32
    when built (VLLM_LITE_CPU_MOE_KERNEL), and for bfloat16 where the build targets AVX512-BF16 (and the hidden
    size is even), else oneDNN packing where it agrees with F.linear; else (None, why)."""
    if not envs.VLLM_LITE_CPU_MOE_PACK:
        return None, "VLLM_LITE_CPU_MOE_PACK=0"
    if w13.device.type != "cpu" or w13.dtype not in (torch.float32, torch.bfloat16):
        return None, f"{w13.dtype} on {w13.device.type}"
    if w13.dtype == torch.float32 and envs.VLLM_LITE_CPU_MOE_KERNEL and _cpu_moe_kernel():
        return KernelExperts(w13, w2), ""
    if (
        w13.dtype == torch.bfloat16
        and envs.VLLM_LITE_CPU_MOE_KERNEL
        and w13.shape[-1] % 2 == 0
        and _cpu_moe_kernel()
        and _cpu_moe_bf16_kernel()
    ):
        return Bf16KernelExperts(w13, w2), ""
    if not torch.backends.mkldnn.is_available():
        return None, "torch was built without oneDNN"
    if w13.dtype == torch.bfloat16:
        support = platform.onednn_bf16_prepack()
        if not support.ok:
            return None, support.reason
    try:
        packed = PackedExperts(w13, w2)
        x = torch.randn(8, w13.shape[-1], generator=torch.Generator().manual_seed(0)).to(w13.dtype)
        got, want = packed.gate_up(x, 0).float(), F.linear(x, w13[0]).float()
    except (RuntimeError, AttributeError) as e:
        return None, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    tol = 1e-4 if w13.dtype == torch.float32 else 2e-2
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())):
        return None, "oneDNN's packed product disagrees with F.linear here"
    return packed, ""


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    packed: Optional[CpuExperts] = None,
) -> torch.Tensor:
    """sum_k weight[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) for e = ids[t, k]; out [T, H] in x's dtype.

    Pairs sorted by expert; each expert with tokens does one [n, H] x [H, 2I] and one [n, I] x [I, H] matmul
    into its rows of one [T*k, H] buffer. The k weighted contributions of a token are then summed in
    ascending expert id, the order transformers' per-expert `index_add_` gives (so float32 stays exact),
    as k whole-tensor adds rather than a scatter per expert (which cost more than the matmuls at decode).
    With `packed` (CPU), the two matmuls run on oneDNN-packed copies of each expert's weights instead, or the
    whole path in csrc/moe_cpu.cpp's op (KernelExperts, float32) with the same order of the final sums.
    """
    if isinstance(packed, (KernelExperts, Bf16KernelExperts)):
        return packed(x, topk_weights, topk_ids)
    t, k = topk_ids.shape
    if t == 0:
        return torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    xs = x.index_select(0, order // k)  # every pair's input row, grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # one host sync per layer
    inter = packed.inter if packed is not None else w2.shape[-1]
    ys = torch.empty(t * k, x.shape[-1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = xs[start : start + n]
        h = packed.gate_up(rows, expert) if packed is not None else F.linear(rows, w13[expert])
        h = F.silu(h[:, :inter]) * h[:, inter:]
        ys[start : start + n] = packed.down(h, expert) if packed is not None else F.linear(h, w2[expert])
        start += n
    pair_out = torch.empty_like(ys)
    pair_out[order] = ys  # back to pair order (token t's j-th choice at t*k + j)
    # Each token's choices by ascending expert id; the product in float32 when the weights are (Mixtral),
    # cast back after, as transformers does.
    by_expert = torch.argsort(topk_ids, dim=-1)
    contrib = pair_out.view(t, k, -1).gather(1, by_expert[:, :, None].expand(-1, -1, x.shape[-1]))
    w = topk_weights.gather(1, by_expert)
    out = (contrib[:, 0] * w[:, 0, None]).to(x.dtype)
    for j in range(1, k):  # k is the routing's top-k (2-8): a loop over choices, not tokens
        out = out + (contrib[:, j] * w[:, j, None]).to(x.dtype)
    return out


@functools.cache
def _cuda_kernel() -> Callable[..., torch.Tensor] | None:
    """The Triton grouped-expert kernel, imported on first CUDA use (CPU engines never import Triton)."""
    from vllm_lite.worker.models.fused_moe_triton import (
        HAS_TRITON,
        triton_grouped_experts,
    )

    return triton_grouped_experts if HAS_TRITON else None


class FusedMoE(nn.Module):
    """The experts of one MoE layer: stacked weights, this rank's slice of every expert's intermediate dim."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        act: str = "silu",
        round_weights: bool = False,
    ) -> None:
        super().__init__()
        self.round_weights = round_weights
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported by the fused MoE layer; expected 'silu'.")
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if intermediate_size % self.tp_size:
            raise ValueError(
                f"moe intermediate_size={intermediate_size} is not divisible by tensor_parallel_size={self.tp_size}."
            )
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate = intermediate_size // self.tp_size  # per rank
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate))
        # Which (expert, projection) shards have arrived, so a half-loaded expert set is reported missing.
        self._shards_seen: set[tuple[int | None, str]] = set()
        self.cpu_packed: Optional[CpuExperts] = None

    def process_weights_after_loading(self) -> str:
        """On CPU, move the experts onto oneDNN-packed weights (the plain ones are released); "" or why not."""
        packed, why = pack_experts_for_cpu(self.w13_weight.data, self.w2_weight.data)
        if packed is not None:
            self.cpu_packed = packed
            h = self.w13_weight.shape[-1]
            self.w13_weight.data = torch.empty((0, 0, h), dtype=self.w13_weight.dtype)
            self.w2_weight.data = torch.empty((0, h, 0), dtype=self.w2_weight.dtype)
        return why

    def forward(
        self,
        x: torch.Tensor,
        router_logits: Optional[torch.Tensor],
        routing: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> torch.Tensor:
        """`routing`: (weights, ids) already computed (SparseMoeBlock's C++ routing on CPU); else route the logits."""
        if routing is not None:
            weights, ids = routing
        else:
            weights, ids = route(router_logits, self.top_k, self.renormalize, self.round_weights)
        if x.is_cuda and _cuda_kernel() is not None:
            out = _cuda_kernel()(x.contiguous(), self.w13_weight, self.w2_weight, weights, ids)
        else:
            out = grouped_experts(x, self.w13_weight, self.w2_weight, weights, ids, self.cpu_packed)
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out

    # ------------------------------------------------------------------ loading

    def _rank_rows(self, loaded: Any, dim: int) -> torch.Tensor:
        """This rank's [rank*I/tp, (rank+1)*I/tp) slice of a checkpoint tensor along its intermediate dim."""
        n = self.intermediate
        return read_shard(loaded, dim, self.tp_rank * n, n)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: tuple[int | None, str]) -> None:
        """shard_id = (expert, "gate"|"up"|"down") for one expert's tensor, or (None, "gate_up"|"down") for all."""
        expert, proj = shard_id
        n = self.intermediate
        with torch.no_grad():
            if expert is None and proj == "gate_up":  # [E, 2I_total, H]: gate rows then up rows
                total = loaded_shape(loaded)[1] // 2
                full = read_shard(loaded)
                gate = full[:, self.tp_rank * n : (self.tp_rank + 1) * n]
                up = full[:, total + self.tp_rank * n : total + (self.tp_rank + 1) * n]
                copy_checked(param.data, torch.cat([gate, up], dim=1), "experts.gate_up_proj")
            elif expert is None and proj == "down":  # [E, H, I_total]
                copy_checked(param.data, self._rank_rows(loaded, 2), "experts.down_proj")
            elif proj in ("gate", "up"):
                off = 0 if proj == "gate" else n
                copy_checked(param.data[expert, off : off + n], self._rank_rows(loaded, 0), f"expert {expert} {proj}")
            elif proj == "down":
                copy_checked(param.data[expert], self._rank_rows(loaded, 1), f"expert {expert} down")
            else:
                raise ValueError(f"unknown expert shard {shard_id!r}.")
        self._shards_seen.add(shard_id)

    def loaded_params(self) -> set[str]:
        """Local names of the parameters every expert's shards have reached."""
        done = set()
        all_experts = range(self.num_experts)
        if (None, "gate_up") in self._shards_seen or all(
            (e, p) in self._shards_seen for e in all_experts for p in ("gate", "up")
        ):
            done.add("w13_weight")
        if (None, "down") in self._shards_seen or all((e, "down") in self._shards_seen for e in all_experts):
            done.add("w2_weight")
        return done


def expert_shard(name: str) -> tuple[str, str, tuple[int | None, str]] | None:
    """For a checkpoint expert tensor name: (FusedMoE module path, its parameter, shard id); else None."""
    m = _PER_EXPERT.match(name)
    if m:
        proj = _PROJ[m["proj"]]
        return m["prefix"], "w2_weight" if proj == "down" else "w13_weight", (int(m["expert"]), proj)
    m = _FUSED.match(name)
    if m:
        fused = m["proj"] == "gate_up_proj"
        return m["prefix"], "w13_weight" if fused else "w2_weight", (None, "gate_up" if fused else "down")
    return None


class SparseMoeBlock(nn.Module):
    """Router (`gate`, replicated) + `experts` (FusedMoE), named as Mixtral's and Qwen-MoE's checkpoints name them."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        act: str = "silu",
        round_weights: bool = False,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize, act, round_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self.experts
        if isinstance(experts.cpu_packed, (KernelExperts, Bf16KernelExperts)) and x.dim() == 2 and x.is_cpu:
            # The C++ experts take the C++ routing too (csrc/moe_cpu.cpp, moe_cpu_route): the router's product and
            # route() in one call, ~5 us where F.linear + route() cost 85-160 us a layer at decode. Its sums run in
            # another order than F.linear's (logits within ~1 ulp), as the expert op's do; the one-call CPU decoder
            # stack (cpu_decoder_stack.py) runs the same two ops, so the same bits.
            route_op = _cpu_route_op()
            if route_op is not None and self.gate.bias is None:
                routing = route_op(
                    x.contiguous(), self.gate.weight, experts.top_k, experts.renormalize, experts.round_weights
                )
                return experts(x, None, routing)
        return experts(x, F.linear(x, self.gate.weight))


def load_moe_weights(
    model: nn.Module, weights: Any, stacked: StackedMapping, tied_names: tuple[str, ...] = ()
) -> set[str]:
    """load_hf_weights for a model with FusedMoE layers: expert tensors are stacked into their layer's fused
    parameters (before the generic name mapping, whose ".gate_proj." rules would otherwise claim them)."""
    moe_layers: dict[str, FusedMoE] = {}

    def non_expert() -> Any:
        for name, tensor in weights:
            shard = expert_shard(name)
            if shard is None:
                yield name, tensor
                continue
            prefix, param, shard_id = shard
            try:
                layer = model.get_submodule(prefix)
            except AttributeError:
                layer = None
            if not isinstance(layer, FusedMoE):
                raise ValueError(f"unexpected checkpoint weight {name!r}: the model has no expert layer {prefix!r}.")
            layer.weight_loader(getattr(layer, param), tensor, shard_id)
            moe_layers[prefix] = layer

    loaded = load_hf_weights(model, non_expert(), stacked, tied_names=tied_names)
    for prefix, layer in moe_layers.items():
        loaded |= {f"{prefix}.{p}" for p in layer.loaded_params()}
    return loaded
