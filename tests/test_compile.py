"""compilation_config (vLLM's torch.compile switch): parsing, what is compiled, and HF-equal greedy tokens."""

from __future__ import annotations

import argparse

import pytest
import torch

from vllm_lite import LLM, SamplingParams
from vllm_lite.config import CompilationConfig
from vllm_lite.engine_args import EngineArgs
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.hf_match import hf_model_eager
from vllm_lite.testing.hf_oracle import hf_greedy
from vllm_lite.worker.compile import compiled_blocks, decoder_layers


@pytest.mark.parametrize(
    "value, mode",
    [
        (None, 0),
        (3, 3),
        ("3", 3),
        ({"level": 3}, 3),
        ('{"mode": 2}', 2),
        ({"mode": "VLLM_COMPILE"}, 3),
        ({"mode": "none"}, 0),
    ],
)
def test_compilation_config_accepts_vllm_spellings(value, mode) -> None:
    assert CompilationConfig.from_value(value).mode == mode


@pytest.mark.parametrize(
    "value, message",
    [
        (4, "compilation_config.mode"),
        ({"mode": "FAST"}, "compilation_config.mode"),
        ({"level": 1, "mode": 3}, "disagree"),
        ({"levels": 3}, "unknown field"),
        (True, "compilation_config"),
    ],
)
def test_compilation_config_refuses_bad_values_naming_the_field(value, message) -> None:
    with pytest.raises(ValueError, match=message):
        CompilationConfig.from_value(value)


def test_cli_spells_it_as_vllm_and_enforce_eager_wins() -> None:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert p.parse_args(["-O3"]).compilation_config.mode == 3
    assert p.parse_args(["--compilation-config", '{"level": 2}']).compilation_config.mode == 2
    model = get_checkpoint("llama")
    assert EngineArgs(model=model, compilation_config=3).create_engine_config().compilation_config.mode == 3
    eager = EngineArgs(model=model, compilation_config=3, enforce_eager=True).create_engine_config()
    assert eager.compilation_config.mode == 0


@pytest.fixture(scope="module")
def compiled_llm():
    with LLM(
        model=get_checkpoint("llama"), dtype="float32", max_model_len=128, multiprocess=False, compilation_config=3
    ) as llm:
        yield llm


def test_attention_is_never_compiled(compiled_llm) -> None:
    model = compiled_llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    blocks = compiled_blocks(model)
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)
    assert all(layer.self_attn._compiled_call_impl is None for layer in layers)
    assert {id(b) for b in blocks} == {id(layer.mlp) for layer in layers} | {
        id(n) for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
    }


def test_compiled_greedy_equals_hf_and_new_batch_sizes_do_not_recompile(compiled_llm) -> None:
    path = get_checkpoint("llama")
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [[1, 5, 9, 20, 33], [3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 8]]
    outs = compiled_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = hf_model_eager(path)
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(hf, p, 5).tokens
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs > 0  # the blocks really ran compiled
    other = [[2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 2, 3, 4, 5]]  # new prefill and decode token counts
    outs = compiled_llm.generate([{"prompt_token_ids": p} for p in other], params, use_tqdm=False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    for p, o in zip(other, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(hf, p, 5).tokens
