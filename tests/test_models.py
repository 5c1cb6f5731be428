"""Our model code against Hugging Face transformers on the same random-weight checkpoints.

Every architecture runs (a) several prompts packed into one flattened prefill
batch and (b) the same prompts fed in uneven chunks over many steps, mixing
single-token decodes with prefill chunks, over a paged cache with shuffled
block tables and contexts spanning many blocks. Logits must match HF's
full-sequence logits at every position.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from vllm_lite.engine_args import EngineArgs
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.paged import PagedModelDriver
from vllm_lite.worker.attention.layer import Attention
from vllm_lite.worker.attention.torch_ref import TorchRefBackend
from vllm_lite.worker.model_loader import load_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "opt"]
LENGTHS = [37, 5, 23, 61]
TOL = dict(atol=1e-4, rtol=1e-4)


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in LENGTHS]


def _ours(path: str, dtype: str = "float32") -> torch.nn.Module:
    mc = EngineArgs(model=path, dtype=dtype).create_engine_config().model_config
    return load_model(mc, torch.device("cpu"))


def _hf_logits(path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [hf(torch.tensor([p])).logits[0].float() for p in prompts]


def _chunk_plan(lengths: list[int], seed: int) -> list[list[int]]:
    """Per step, tokens each request feeds: staggered starts, prefill chunks of 2..13, many 1-token steps."""
    rng = np.random.default_rng(seed)
    left = list(lengths)
    plan, step = [], 0
    while any(left):
        row = []
        for i, n in enumerate(left):
            if n == 0 or step < i:  # request i joins at step i
                row.append(0)
                continue
            chunk = 1 if rng.random() < 0.4 else int(rng.integers(2, 14))
            row.append(min(chunk, n))
            left[i] -= row[-1]
        plan.append(row)
        step += 1
    return plan


def _compare_chunked(model, prompts, hf, block_size, seed) -> None:
    driver = PagedModelDriver(model, prompts, block_size, TorchRefBackend(), seed=seed)
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    plan = _chunk_plan([len(p) for p in prompts], seed)
    mixed_steps = sum(1 for row in plan if 1 in row and any(n > 1 for n in row))
    assert mixed_steps >= 2, "the plan must mix decodes and prefill chunks in the same step"
    for row in plan:
        for i, logits in enumerate(driver.step(row)):
            got[i].append(logits)
    for i, ref in enumerate(hf):
        torch.testing.assert_close(torch.cat(got[i]), ref, **TOL)


@pytest.mark.parametrize("tiny_checkpoint", ARCHS, indirect=True)
def test_packed_prefill_logits_match_hf(tiny_checkpoint):
    path = tiny_checkpoint
    model = _ours(path)
    prompts = _prompts(model.config.vocab_size)
    hf = _hf_logits(path, prompts)
    driver = PagedModelDriver(model, prompts, block_size=16, backend=TorchRefBackend())
    out = driver.step([len(p) for p in prompts])
    for got, ref in zip(out, hf):
        torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.parametrize("tiny_checkpoint", ARCHS, indirect=True)
@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_mixed_steps_logits_match_hf(block_size, tiny_checkpoint):
    path = tiny_checkpoint
    model = _ours(path)
    prompts = _prompts(model.config.vocab_size, seed=1)
    _compare_chunked(model, prompts, _hf_logits(path, prompts), block_size, seed=block_size)


ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 500000.0,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_rope_scaling_variants_match_hf(variant, checkpoint_factory):
    path = checkpoint_factory("llama", config_overrides={"rope_parameters": ROPE_VARIANTS[variant]})
    model = _ours(path)
    prompts = _prompts(model.config.vocab_size, seed=2)
    _compare_chunked(model, prompts, _hf_logits(path, prompts), block_size=8, seed=3)


def test_rope_from_legacy_rope_scaling_and_theta_keys(checkpoint_factory):
    """Old config.json files carry rope_scaling + rope_theta instead of rope_parameters."""
    import json
    import os

    path = checkpoint_factory("llama", config_overrides={"rope_parameters": ROPE_VARIANTS["linear"]}, seed=5)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    legacy = os.path.join(os.path.dirname(path), "legacy")
    os.makedirs(legacy, exist_ok=True)
    for name in os.listdir(path):
        if name != "config.json":
            os.symlink(os.path.join(path, name), os.path.join(legacy, name))
    with open(os.path.join(legacy, "config.json"), "w") as f:
        json.dump(cfg, f)
    model = _ours(legacy)
    prompts = _prompts(model.config.vocab_size, seed=4)
    out = PagedModelDriver(model, prompts, 16, TorchRefBackend()).step([len(p) for p in prompts])
    for got, ref in zip(out, _hf_logits(path, prompts)):  # same weights, modern config
        torch.testing.assert_close(got, ref, **TOL)


def test_opt_post_layernorm_without_projection_matches_hf(checkpoint_factory):
    """do_layer_norm_before=False (as in opt-350m) drops the final norm and norms after each block."""
    path = checkpoint_factory("opt", config_overrides={"do_layer_norm_before": False, "word_embed_proj_dim": 64})
    model = _ours(path)
    assert model.model.decoder.final_layer_norm is None and model.model.decoder.project_in is None
    prompts = _prompts(model.config.vocab_size, seed=6)
    _compare_chunked(model, prompts, _hf_logits(path, prompts), block_size=8, seed=7)


BF16_EPS = 2.0**-8  # spacing of bfloat16 numbers just above 1 (8 significant bits)


def _rms(x: torch.Tensor) -> float:
    return float(x.double().pow(2).mean().sqrt())


def test_bfloat16_model_is_as_accurate_as_hf_in_bfloat16():
    """bf16 weights/activations, float32 norms and softmax: against HF float32 on the same weights,
    our bf16 error is no larger than HF's own bf16 run makes (a reference for what bf16 costs), stays
    within a bound from bf16's epsilon, and the top token agrees wherever float32's margin exceeds it."""
    path = get_checkpoint("qwen2")
    model = _ours(path, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    prompts = _prompts(model.config.vocab_size, seed=8)
    driver = PagedModelDriver(model, prompts, 16, TorchRefBackend(), dtype=torch.bfloat16)
    got = torch.cat(driver.step([len(p) for p in prompts]))
    assert got.dtype == torch.float32
    ref = torch.cat(_hf_logits(path, prompts))
    hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        hf_got = torch.cat([hf_bf16(torch.tensor([p])).logits[0].float() for p in prompts])

    # 1. No worse than HF in bf16 (25% slack: the two round in a different order).
    assert _rms(got - ref) <= 1.25 * _rms(hf_got - ref), (_rms(got - ref), _rms(hf_got - ref))
    # 2. Each layer rounds its residual stream to bf16 a few times (attention out, MLP out, the adds),
    #    each a relative error up to eps/2 of the activations, and the logits inherit it at their scale:
    #    |error| <= 2 * (num_layers + 1) * eps * max|logit|.
    layers = model.config.num_hidden_layers
    bound = 2 * (layers + 1) * BF16_EPS * float(ref.abs().max())
    assert float((got - ref).abs().max()) <= bound
    # 3. Where float32's top-1 beats its top-2 by more than twice the bound, no rounding can flip it.
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * bound
    assert clear.sum() >= ref.shape[0] // 4  # the premise: enough positions with a clear winner to check
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_model_exposes_attention_layers_in_order():
    model = _ours(get_checkpoint("qwen3"))
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert len(layers) == model.config.num_hidden_layers
    assert all(l.head_size == 32 and l.num_heads == 4 and l.num_kv_heads == 2 for l in layers)
    assert layers[0] is model.model.layers[0].self_attn.attn


def test_unsupported_rope_type_is_a_value_error_naming_supported_types():
    from vllm_lite.worker.models.layers import RotaryEmbedding

    with pytest.raises(ValueError, match=r"rope_type 'longrope' is not supported; supported: 'default'"):
        RotaryEmbedding(16, 64, {"rope_type": "longrope", "rope_theta": 10000.0})
