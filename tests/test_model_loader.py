"""load_model: sharded and single-file checkpoints, tied embeddings, dtype, and clear errors on bad checkpoints."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_lite.engine_args import EngineArgs
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.worker.model_loader import iterate_weights, load_model, safetensors_files
from vllm_lite.worker.models.registry import get_model_class, supported_architectures


def _config(path: str, dtype: str = "float32"):
    return EngineArgs(model=path, dtype=dtype).create_engine_config().model_config


def _copy(src: str, dst) -> str:
    dst = str(dst / "ckpt")
    shutil.copytree(src, dst)
    return dst


def _state(path: str) -> dict[str, torch.Tensor]:
    return dict(iterate_weights(path))


def _rewrite_weights(path: str, edit) -> None:
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_sharded_checkpoint_loads_every_shard(checkpoint_factory):
    path = checkpoint_factory("llama", max_shard_size="100KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert len(safetensors_files(path)) > 3
    model = load_model(_config(path), torch.device("cpu"))
    ckpt = _state(path)
    layer = model.model.layers[1]
    q = ckpt["model.layers.1.self_attn.q_proj.weight"]
    k = ckpt["model.layers.1.self_attn.k_proj.weight"]
    v = ckpt["model.layers.1.self_attn.v_proj.weight"]
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, torch.cat([q, k, v]), rtol=0, atol=0)
    gate, up = ckpt["model.layers.1.mlp.gate_proj.weight"], ckpt["model.layers.1.mlp.up_proj.weight"]
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, torch.cat([gate, up]), rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head.weight, ckpt["lm_head.weight"], rtol=0, atol=0)


def test_qkv_biases_land_in_their_slices():
    path = get_checkpoint("qwen2")
    model = load_model(_config(path), torch.device("cpu"))
    ckpt = _state(path)
    bias = model.model.layers[0].self_attn.qkv_proj.bias
    expected = torch.cat([ckpt[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv"])
    torch.testing.assert_close(bias, expected, rtol=0, atol=0)


def test_tied_embeddings_share_the_embedding_weight():
    path = get_checkpoint("qwen2")
    assert "lm_head.weight" not in _state(path)
    model = load_model(_config(path), torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    h = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(h), h @ model.model.embed_tokens.weight.T)


def test_tied_checkpoint_that_also_stores_lm_head_loads(tmp_path):
    path = _copy(get_checkpoint("qwen2"), tmp_path)
    _rewrite_weights(path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    model = load_model(_config(path), torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_loads_in_requested_dtype_with_float32_rope_table():
    model = load_model(_config(get_checkpoint("llama"), "bfloat16"), torch.device("cpu"))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    rope = model.model.layers[0].self_attn.rotary_emb
    assert rope.cos_sin_cache.dtype == torch.float32
    assert torch.isfinite(rope.cos_sin_cache).all() and rope.cos_sin_cache[0, 0] == 1.0  # cos(0), not garbage


def test_missing_weight_names_the_parameter(tmp_path):
    path = _copy(get_checkpoint("llama"), tmp_path)
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks parameters: model\.layers\.1\.mlp\.gate_up_proj\.weight"):
        load_model(_config(path), torch.device("cpu"))


def test_unexpected_weight_name_is_rejected(tmp_path):
    path = _copy(get_checkpoint("llama"), tmp_path)
    _rewrite_weights(path, lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.ones(2)))
    with pytest.raises(ValueError, match=r"unexpected checkpoint weight 'model\.layers\.0\.mystery\.weight'"):
        load_model(_config(path), torch.device("cpu"))


def test_wrong_weight_shape_is_rejected(tmp_path):
    path = _copy(get_checkpoint("llama"), tmp_path)
    _rewrite_weights(path, lambda t: t.__setitem__("model.norm.weight", torch.ones(7)))
    with pytest.raises(ValueError, match=r"checkpoint shape \(7,\) does not match model shape \(64,\)"):
        load_model(_config(path), torch.device("cpu"))


def test_unknown_architecture_lists_supported_ones(tmp_path):
    path = _copy(get_checkpoint("llama"), tmp_path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["FancyNetForCausalLM"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="FancyNetForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(_config(path), torch.device("cpu"))
    with pytest.raises(ValueError, match="supported architectures"):
        get_model_class("BloomForCausalLM")
    assert "MistralForCausalLM" in supported_architectures()


def test_no_safetensors_files_is_a_clear_error(tmp_path):
    path = _copy(get_checkpoint("llama"), tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights in"):
        load_model(_config(path), torch.device("cpu"))


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        safetensors_files(str(tmp_path / "nope"))


def test_100m_checkpoint_is_built_on_meta_then_filled_from_the_checkpoint(monkeypatch):
    """What keeps loading fast, checked as behaviour (speed itself is measured in benchmarks/latency.py):
    the module is constructed on the meta device (no storage, no random init), and every tensor that
    comes back is real and holds the checkpoint's values."""
    import vllm_lite.worker.model_loader as loader

    path = get_checkpoint("qwen2", size="100m")
    cfg = _config(path, "bfloat16")  # the checkpoint's own dtype (auto computes it in float32 on AVX2-only CPUs)
    assert cfg.dtype == torch.bfloat16
    built: list[torch.nn.Module] = []
    real_get_model_class = loader.get_model_class

    def spying_get_model_class(archs):
        cls = real_get_model_class(archs)

        class Spy(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                built.append(self)
                # Right after construction: nothing allocated, nothing initialised.
                self._spy_devices = {t.device.type for t in [*self.parameters(), *self.buffers()]}

        return Spy

    monkeypatch.setattr(loader, "get_model_class", spying_get_model_class)
    model = load_model(cfg, torch.device("cpu"))
    assert built == [model] and model._spy_devices == {"meta"}
    tensors = list(model.parameters()) + list(model.buffers())
    assert {t.device.type for t in tensors} == {"cpu"}
    assert sum(p.numel() for p in model.parameters()) > 100_000_000
    params = dict(model.named_parameters())
    checked = 0
    for name, value in iterate_weights(path):
        if name in params:  # names the model keeps as they are (fused projections are renamed)
            assert torch.equal(params[name], value.to(cfg.dtype)), name
            checked += 1
    assert checked >= 3  # at least the embedding, a norm and the final norm
