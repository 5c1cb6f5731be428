"""The fused-MoE layer against a per-token reference, and Mixtral / Qwen3-MoE against Hugging Face.

Layer: shared experts among tokens, experts that get no token, renormalised or not, tensor-parallel
shards summing to the whole, every checkpoint layout stacking into the same fused tensors.
Models: float32 greedy tokens identical to HF (logprobs within 1e-4), prefix caching on, in-process
and in a separate engine process.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from vllm_lite import LLM, platform
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.hf_match import (
    assert_matches_hf_twice_with_prefix_caching,
    assert_multiprocess_matches_hf,
)
from vllm_lite.testing.triton_interpreter import compile_for_sm90, run_interpreter_driver
from vllm_lite.worker import parallel_state
from vllm_lite.worker.models.fused_moe import (
    FusedMoE,
    expert_shard,
    grouped_experts,
    route,
)

NEW_TOKENS = 10
E, H, I, K = 6, 16, 12, 2


@pytest.fixture(autouse=True)
def _reset_tp_state():
    yield
    parallel_state.set_tp_state_for_testing(0, 1)


def _naive_moe(x, logits, w1, w3, w2, k, renormalize):
    """One token at a time, one chosen expert at a time, in float64: the definition, not the layout."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].double(), -1)
        top = sorted(range(len(probs)), key=lambda e: -float(probs[e]))[:k]
        weights = [float(probs[e]) for e in top]
        if renormalize:
            weights = [w / sum(weights) for w in weights]
        for e, w in zip(top, weights):
            h = F.silu(w1[e].double() @ x[t].double()) * (w3[e].double() @ x[t].double())
            out[t] += w * (w2[e].double() @ h)
    return out


def _weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w1, w3 = torch.randn(E, I, H, generator=g) * 0.3, torch.randn(E, I, H, generator=g) * 0.3
    w2 = torch.randn(E, H, I, generator=g) * 0.3
    gate_w = torch.randn(E, H, generator=g)
    return gate_w, w1, w3, w2


def _load_per_expert(layer: FusedMoE, w1, w3, w2) -> None:
    for e in range(E):
        layer.weight_loader(layer.w13_weight, w1[e], (e, "gate"))
        layer.weight_loader(layer.w13_weight, w3[e], (e, "up"))
        layer.weight_loader(layer.w2_weight, w2[e], (e, "down"))


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_equals_the_per_token_reference(renormalize: bool) -> None:
    gate_w, w1, w3, w2 = _weights()
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(1))
    # Logits pushed away from experts 3-5: several tokens share each of 0-2, and 3-5 get none.
    logits = x @ gate_w.T
    logits[:, 3:] -= 100.0
    layer = FusedMoE(E, K, H, I, renormalize)
    _load_per_expert(layer, w1, w3, w2)
    assert layer.loaded_params() == {"w13_weight", "w2_weight"}
    _, ids = route(logits, K, renormalize)
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    assert counts[:3].max() > 1 and counts[3:].sum() == 0, counts
    out = layer(x, logits)
    torch.testing.assert_close(out.double(), _naive_moe(x, logits, w1, w3, w2, K, renormalize), atol=1e-5, rtol=1e-5)


def _transformers_order_moe(x, w13, w2, weights, ids):
    """transformers' loop: expert by expert in ascending id, each adding its weighted rows with index_add_."""
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    for e in range(w13.shape[0]):
        tok, slot = torch.where(ids == e)
        h = F.linear(x[tok], w13[e])
        y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], w2[e])
        out.index_add_(0, tok, (y * weights[tok, slot, None]).to(x.dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [2, 4, 8])
def test_grouped_experts_sum_in_transformers_order_bit_for_bit(dtype: torch.dtype, k: int) -> None:
    """With k > 2 the order of a token's k adds changes float sums: ours must be transformers' (ascending expert)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 32, generator=g).to(dtype)
    w13 = torch.randn(8, 2 * 24, 32, generator=g).to(dtype)
    w2 = torch.randn(8, 32, 24, generator=g).to(dtype)
    weights, ids = route(torch.randn(37, 8, generator=g), k, renormalize=False)
    assert torch.equal(grouped_experts(x, w13, w2, weights, ids), _transformers_order_moe(x, w13, w2, weights, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_cpu_experts_equal_the_plain_ones_and_release_them(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not platform.onednn_bf16_prepack().ok:
        pytest.skip(f"oneDNN cannot pack bf16 on this CPU: {platform.onednn_bf16_prepack().reason}")
    gate_w, w1, w3, w2 = _weights(4)
    layer = FusedMoE(E, K, H, I, True).to(dtype)
    _load_per_expert(layer, w1, w3, w2)
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(5)).to(dtype)
    logits = x.float() @ gate_w.T
    plain = layer(x, logits)
    assert layer.process_weights_after_loading() == ""
    assert layer.cpu_packed is not None and layer.w13_weight.numel() == 0 and layer.w2_weight.numel() == 0
    packed = layer(x, logits)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(packed.float(), plain.float(), rtol=tol, atol=tol)
    assert layer(x[:1], logits[:1]).shape == (1, H) and layer(x[:0], logits[:0]).shape == (0, H)


def test_moe_packing_off_keeps_the_plain_weights(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_LITE_CPU_MOE_PACK", "0")
    layer = FusedMoE(E, K, H, I, True)
    _load_per_expert(layer, *_weights(4)[1:])
    assert layer.process_weights_after_loading() == "VLLM_LITE_CPU_MOE_PACK=0"
    assert layer.cpu_packed is None and layer.w13_weight.shape == (E, 2 * I, H)


def test_routing_renormalises_only_when_asked() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = route(logits, 2, renormalize=True)
    assert ids.tolist() == [[0, 1]] and torch.allclose(w.sum(-1), torch.ones(1))
    w_raw, _ = route(logits, 2, renormalize=False)
    torch.testing.assert_close(w_raw, torch.softmax(logits, -1)[:, :2])
    # Mixtral keeps the weights float32 on bf16 activations; Qwen3-MoE rounds them to bf16, as HF does.
    assert route(logits.bfloat16(), 2, True)[0].dtype == torch.float32
    assert route(logits.bfloat16(), 2, True, round_to_logits_dtype=True)[0].dtype == torch.bfloat16


def test_no_tokens_and_one_token_batches() -> None:
    gate_w, w1, w3, w2 = _weights(2)
    layer = FusedMoE(E, K, H, I, True)
    _load_per_expert(layer, w1, w3, w2)
    assert layer(torch.empty(0, H), torch.empty(0, E)).shape == (0, H)
    x = torch.randn(1, H)
    torch.testing.assert_close(
        layer(x, x @ gate_w.T).double(), _naive_moe(x, x @ gate_w.T, w1, w3, w2, K, True), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("tp", [2, 3])
def test_tensor_parallel_shards_of_every_expert_sum_to_the_whole(tp: int) -> None:
    """Each rank holds I/tp rows of every expert; the partial outputs add up (what the all-reduce does)."""
    gate_w, w1, w3, w2 = _weights(3)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(4))
    full = FusedMoE(E, K, H, I, True)
    _load_per_expert(full, w1, w3, w2)
    expected = full(x, x @ gate_w.T)
    total = torch.zeros_like(expected)
    for rank in range(tp):
        parallel_state.set_tp_state_for_testing(rank, tp)
        part = FusedMoE(E, K, H, I, True)
        assert part.w13_weight.shape == (E, 2 * I // tp, H) and part.w2_weight.shape == (E, H, I // tp)
        _load_per_expert(part, w1, w3, w2)
        weights, ids = route(x @ gate_w.T, K, True)
        total += grouped_experts(x, part.w13_weight, part.w2_weight, weights, ids)
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)


def test_checkpoint_layouts_stack_into_the_same_fused_tensors() -> None:
    """Mixtral's w1/w3/w2, Qwen's gate/up/down_proj and transformers' fused gate_up_proj/down_proj."""
    _, w1, w3, w2 = _weights(5)
    assert expert_shard("model.layers.2.block_sparse_moe.experts.3.w3.weight") == (
        "model.layers.2.block_sparse_moe.experts",
        "w13_weight",
        (3, "up"),
    )
    assert expert_shard("model.layers.0.mlp.experts.1.down_proj.weight") == (
        "model.layers.0.mlp.experts",
        "w2_weight",
        (1, "down"),
    )
    assert expert_shard("model.layers.0.mlp.gate_proj.weight") is None  # a dense MLP, not an expert
    per_expert = FusedMoE(E, K, H, I, True)
    _load_per_expert(per_expert, w1, w3, w2)
    fused = FusedMoE(E, K, H, I, True)
    fused.weight_loader(fused.w13_weight, torch.cat([w1, w3], dim=1), (None, "gate_up"))
    fused.weight_loader(fused.w2_weight, w2, (None, "down"))
    assert fused.loaded_params() == {"w13_weight", "w2_weight"}
    assert torch.equal(fused.w13_weight, per_expert.w13_weight) and torch.equal(fused.w2_weight, per_expert.w2_weight)
    half = FusedMoE(E, K, H, I, True)
    half.weight_loader(half.w13_weight, w1[0], (0, "gate"))
    assert half.loaded_params() == set(), "one expert's gate is not a loaded w13_weight"


needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="package 'triton' is not installed"
)


@needs_triton
def test_triton_grouped_kernel_in_the_interpreter_matches_the_torch_path() -> None:
    """The CUDA kernel's logic on CPU: TRITON_INTERPRET=1 only in a subprocess's environment."""
    results = run_interpreter_driver("vllm_lite.testing.moe_triton_check")["results"]
    assert results and all(v is None for v in results.values()), results


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton kernel)")
def test_compiled_triton_grouped_kernel_on_cuda_matches_the_torch_path() -> None:
    from vllm_lite.testing.moe_triton_check import CASES, run_case

    for _, *case in CASES:
        run_case("cuda", *case)


@needs_triton
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_triton_grouped_kernel_compiles_for_sm90_ahead_of_time(dtype: str) -> None:
    """Without a GPU, compile the CUDA path to a cubin: catches Triton that only the interpreter accepts."""

    from vllm_lite.worker.models import fused_moe_triton

    sig = {
        "a_ptr": "*" + dtype,
        "w_ptr": "*" + dtype,
        "c_ptr": "*fp32",
        "sorted_pairs_ptr": "*i64",
        "block_expert_ptr": "*i64",
        "pair_weight_ptr": "*fp32",
    }
    sig.update(
        {
            n: "i32"
            for n in (
                "num_pairs",
                "n_out",
                "k_in",
                "top_k",
                "stride_am",
                "stride_we",
                "stride_wn",
                "stride_wk",
                "stride_cm",
            )
        }
    )
    consts = dict(A_BY_TOKEN=True, SCALE=True, IEEE=dtype == "fp32", BLOCK_M=16, BLOCK_N=64, BLOCK_K=32)
    kernel = compile_for_sm90(fused_moe_triton._expert_gemm, sig, consts)
    assert kernel.asm["cubin"]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_greedy_float32_matches_hf_with_prefix_caching(arch: str, monkeypatch) -> None:
    def experts_packed(llm: LLM) -> None:
        model = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
        moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
        assert moe and all(m.cpu_packed is not None for m in moe), "CPU experts should run on packed weights"

    # device: the packed CPU experts are what this checks (a CUDA machine would default to cuda)
    assert_matches_hf_twice_with_prefix_caching(
        get_checkpoint(arch), (9, 40, 70), NEW_TOKENS, monkeypatch, check_engine=experts_packed, device="cpu"
    )


def test_qwen3_moe_dense_and_sparse_layers_follow_the_config() -> None:
    from transformers import AutoConfig

    from vllm_lite.worker.models.qwen3_moe import is_sparse_layer

    config = AutoConfig.from_pretrained(get_checkpoint("qwen3_moe"))
    assert [is_sparse_layer(config, i) for i in range(3)] == [True, False, True]
    config.decoder_sparse_step, config.mlp_only_layers = 2, []
    assert [is_sparse_layer(config, i) for i in range(4)] == [False, True, False, True]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_multiprocess_matches_hf(arch: str) -> None:
    """The engine core in its own process (the msgpack wire) gives the same exact tokens through the fused MoE."""
    assert_multiprocess_matches_hf(get_checkpoint(arch), (17, 48), NEW_TOKENS)
