"""Start-up paths: the transformers config snapshot and the tokenizer loading while the core starts."""

from __future__ import annotations

import json
import threading

import pytest
import transformers

from vllm_lite.client.startup import load_while_starting
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.pooling_checkpoints import get_pooling_checkpoint
from vllm_lite.worker import hf_config_cache


def _public_values(config) -> dict:
    import torch

    names = {n for n in dir(config) if not n.startswith("_")} | set(config.attribute_map)
    out = {}
    for name in names - hf_config_cache._DEPRECATED_ALIASES:
        try:
            value = getattr(config, name)
        except Exception:  # noqa: BLE001 -- absent on this config
            continue
        if callable(value) and not isinstance(value, torch.dtype):
            continue
        if hf_config_cache._encode(value, torch) is not hf_config_cache._UNREPRESENTABLE:
            out[name] = value.to_dict() if hasattr(value, "to_dict") else value
    return out


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(lambda: get_checkpoint("gpt2"), id="gpt2-attribute-map"),
        pytest.param(lambda: get_checkpoint("qwen2_sw"), id="qwen2-sliding-layer-types"),
        pytest.param(lambda: get_checkpoint("phi3_longrope"), id="phi3-longrope"),
        pytest.param(lambda: get_checkpoint("gemma3"), id="gemma3"),
        pytest.param(lambda: get_pooling_checkpoint("qwen3-classify"), id="classifier-id2label"),
    ],
)
def test_config_snapshot_reads_as_the_transformers_config(path, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_LITE_CACHE_DIR", str(tmp_path))
    model_dir = path()
    first = hf_config_cache.load_hf_config(model_dir)  # through transformers; writes the snapshot
    assert isinstance(first, transformers.PretrainedConfig)
    second = hf_config_cache.load_hf_config(model_dir)
    assert isinstance(second, hf_config_cache.ConfigSnapshot)
    expected = _public_values(first)
    assert {"hidden_size", "num_hidden_layers", "vocab_size"} <= set(expected)
    got = {n: getattr(second, n, "<missing>") for n in expected}
    got = {n: v.to_dict() if isinstance(v, hf_config_cache.ConfigSnapshot) else v for n, v in got.items()}
    assert got == expected


def test_a_seen_config_loads_without_transformers(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_LITE_CACHE_DIR", str(tmp_path))
    model_dir = get_checkpoint("llama")
    expected = hf_config_cache.load_hf_config(model_dir).hidden_size

    def refuse(*args, **kwargs):
        raise AssertionError("AutoConfig was called for a config seen before")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)
    assert hf_config_cache.load_hf_config(model_dir).hidden_size == expected


def test_changed_config_json_is_a_new_snapshot(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_LITE_CACHE_DIR", str(tmp_path / "cache"))
    src = get_checkpoint("llama")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    config = json.loads(open(f"{src}/config.json").read())
    (model_dir / "config.json").write_text(json.dumps(config))
    hf_config_cache.load_hf_config(str(model_dir))
    assert hf_config_cache.load_hf_config(str(model_dir)).rms_norm_eps == config["rms_norm_eps"]
    config["rms_norm_eps"] = 0.125
    (model_dir / "config.json").write_text(json.dumps(config))
    assert hf_config_cache.load_hf_config(str(model_dir)).rms_norm_eps == 0.125


def test_tokenizer_loads_while_the_core_starts() -> None:
    both_running = threading.Barrier(2, timeout=60)

    def load() -> str:
        both_running.wait()  # returns only once start() is running too
        return "tokenizer"

    def start() -> str:
        both_running.wait()
        return "client"

    assert load_while_starting(load, start, lambda c: None) == ("tokenizer", "client")


def test_a_failed_load_stops_what_started() -> None:
    stopped = []

    def load() -> str:
        raise OSError("no tokenizer here")

    with pytest.raises(OSError, match="no tokenizer"):
        load_while_starting(load, lambda: "client", stopped.append)
    assert stopped == ["client"]


def test_a_failed_start_is_raised_after_the_load_finishes() -> None:
    finished = threading.Event()

    def load() -> str:
        finished.set()
        return "tokenizer"

    def start() -> str:
        raise RuntimeError("core failed")

    with pytest.raises(RuntimeError, match="core failed"):
        load_while_starting(load, start, lambda c: None)
    assert finished.is_set()
