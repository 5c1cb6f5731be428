"""Pooling without an engine: the runner and pooler config a checkpoint gets, the batched Pooler's math,
and the core's refusal of a request of the wrong kind."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vllm_lite.core.messages import EngineCoreRequest
from vllm_lite.core.request_validation import RequestLimits, validate_request
from vllm_lite.pooling_config import (
    PoolerConfig,
    read_sentence_transformers_pooler,
    resolve_pooler_config,
    resolve_runner,
)
from vllm_lite.pooling_params import PoolingParams
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.pooling_checkpoints import write_sentence_transformers_files
from vllm_lite.worker.pooler import Pooler


@pytest.mark.parametrize(
    "archs, st, want",
    [
        (["Qwen3ForCausalLM"], False, "generate"),
        (["Qwen3ForCausalLM"], True, "pooling"),  # a sentence-transformers checkpoint of a decoder
        (["Qwen3Model"], False, "pooling"),
        (["BertModel"], False, "pooling"),
        (["Qwen3ForSequenceClassification"], False, "pooling"),
        (["GPT2LMHeadModel"], False, "generate"),
    ],
)
def test_auto_runner_from_architecture_and_sentence_transformers_files(tmp_path, archs, st, want) -> None:
    if st:
        write_sentence_transformers_files(str(tmp_path), 8, "lasttoken", True)
    assert resolve_runner("auto", archs, str(tmp_path)) == want
    assert resolve_runner("generate", ["Qwen3Model"], str(tmp_path)) == "generate"
    with pytest.raises(ValueError, match="runner must be one of"):
        resolve_runner("embed", archs, str(tmp_path))


@pytest.mark.parametrize(
    "mode, normalize, want", [("lasttoken", True, "LAST"), ("mean", False, "MEAN"), ("cls", True, "CLS")]
)
def test_sentence_transformers_pooling_mode_and_normalize(tmp_path, mode, normalize, want) -> None:
    write_sentence_transformers_files(str(tmp_path), 8, mode, normalize)
    got = read_sentence_transformers_pooler(str(tmp_path))
    assert (got.pooling_type, got.normalize) == (want, normalize)


def test_sentence_transformers_6_pooling_mode_key_and_unsupported_modes(tmp_path) -> None:
    d = str(tmp_path)
    write_sentence_transformers_files(d, 8, "mean", False)
    cfg_path = os.path.join(d, "1_Pooling", "config.json")
    with open(cfg_path, "w") as f:  # what sentence-transformers 6 writes
        json.dump({"embedding_dimension": 8, "pooling_mode": "lasttoken", "include_prompt": True}, f)
    assert read_sentence_transformers_pooler(d).pooling_type == "LAST"
    with open(cfg_path, "w") as f:
        json.dump({"pooling_mode": "max"}, f)
    with pytest.raises(ValueError, match="pooling_mode 'max' is not supported"):
        read_sentence_transformers_pooler(d)


def test_user_pooler_config_wins_over_the_checkpoint_and_defaults_follow_the_architecture(tmp_path) -> None:
    d = str(tmp_path)
    assert resolve_pooler_config(None, ["Qwen3Model"], d) == PoolerConfig("LAST", True, None, True)
    assert resolve_pooler_config(None, ["BertModel"], d).pooling_type == "CLS"
    assert resolve_pooler_config(None, ["Qwen3ForSequenceClassification"], d).normalize is False
    write_sentence_transformers_files(d, 8, "mean", True)
    user = PoolerConfig.from_value('{"pooling_type": "cls"}')
    assert resolve_pooler_config(user, ["Qwen3Model"], d) == PoolerConfig("CLS", True, None, True)
    with pytest.raises(ValueError, match="unknown field"):
        PoolerConfig.from_value({"pooling": "MEAN"})
    with pytest.raises(ValueError, match="pooling_type"):
        PoolerConfig(pooling_type="MAX")


@pytest.mark.parametrize("pooling_type", ["LAST", "CLS", "MEAN", "ALL"])
def test_pooler_batched_segments_equal_per_request_pooling(pooling_type: str) -> None:
    torch.manual_seed(0)
    lens = [3, 1, 5]
    hidden = torch.randn(sum(lens), 6)
    qsl = np.concatenate([[0], np.cumsum(lens)])
    pooler = Pooler(PoolerConfig(pooling_type=pooling_type), torch.nn.Module())
    params = [
        PoolingParams(normalize=True),
        PoolingParams(normalize=False),
        PoolingParams(normalize=True, dimensions=4),
    ]
    outs = pooler(hidden, qsl, params)
    for i, (seg, p) in enumerate(zip(torch.split(hidden, lens), params)):
        want = {"LAST": seg[-1], "CLS": seg[0], "MEAN": seg.mean(0), "ALL": seg}[pooling_type]
        want = want[..., : p.dimensions or 6]
        if p.normalize:
            want = F.normalize(want, dim=-1)
        torch.testing.assert_close(outs[i], want, atol=1e-6, rtol=0)


def _request(**kw) -> EngineCoreRequest:
    base = dict(request_id="r", prompt_token_ids=[1, 2, 3], sampling_params=None, eos_token_id=None, arrival_time=0.0)
    return EngineCoreRequest(**{**base, **kw})


def test_the_core_refuses_a_request_of_the_wrong_kind_for_its_runner() -> None:
    gen = RequestLimits(vocab_size=10, max_model_len=8)
    pool = RequestLimits(vocab_size=10, max_model_len=8, runner_type="pooling", max_pooling_tokens=4)
    with pytest.raises(ValueError, match="only supported for pooling models.*--runner pooling"):
        validate_request(_request(pooling_params=PoolingParams()), gen)
    with pytest.raises(ValueError, match="only supported for generative models.*--runner generate"):
        validate_request(_request(sampling_params=SamplingParams()), pool)
    with pytest.raises(ValueError, match="not both"):
        validate_request(_request(sampling_params=SamplingParams(), pooling_params=PoolingParams()), pool)
    with pytest.raises(ValueError, match="max_num_batched_tokens=4"):
        validate_request(_request(prompt_token_ids=[1] * 5, pooling_params=PoolingParams()), pool)
    validate_request(_request(prompt_token_ids=[1] * 4, pooling_params=PoolingParams()), pool)


def test_pooler_serves_classify_and_embed_requests_in_one_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.classifier_head = torch.nn.Linear(6, 3, bias=False)
    hidden = torch.randn(5, 6)
    qsl = np.array([0, 2, 5])
    pooler = Pooler(PoolerConfig(pooling_type="LAST"), model)
    outs = pooler(hidden, qsl, [PoolingParams(task="classify"), PoolingParams(task="embed", normalize=True)])
    with torch.no_grad():
        want_probs = model.classifier_head(hidden[1]).softmax(-1)
    torch.testing.assert_close(outs[0], want_probs, atol=1e-6, rtol=0)
    torch.testing.assert_close(outs[1], F.normalize(hidden[4], dim=-1), atol=1e-6, rtol=0)


def test_engine_args_runner_pooling_budget_and_flags() -> None:
    import argparse

    from vllm_lite.engine_args import EngineArgs
    from vllm_lite.testing.checkpoints import get_checkpoint

    model = get_checkpoint("llama")  # a ForCausalLM without sentence-transformers files: auto is generate
    assert EngineArgs(model=model, device="cpu").create_engine_config().model_config.runner_type == "generate"
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", model, "--runner", "pooling", "--pooler-config", '{"pooling_type": "mean"}'])
    cfg = EngineArgs.from_cli_args(args, device="cpu").create_engine_config()
    assert cfg.model_config.runner_type == "pooling"
    assert cfg.model_config.pooler_config == PoolerConfig("MEAN", True, None, True)
    # A pooling prompt runs whole in one step: the budget holds max_model_len; a smaller one is refused.
    assert cfg.scheduler_config.max_num_batched_tokens >= cfg.model_config.max_model_len
    # With no decodes to keep moving, a pooling step defaults to the bigger budget that measured faster.
    assert cfg.scheduler_config.max_num_batched_tokens >= 4096
    generate_cfg = EngineArgs(model=model, device="cpu").create_engine_config()
    assert generate_cfg.scheduler_config.max_num_batched_tokens < 4096
    with pytest.raises(ValueError, match="max_num_batched_tokens \\(512\\) is smaller than max_model_len \\(1024\\)"):
        EngineArgs(
            model=model, device="cpu", runner="pooling", max_model_len=1024, max_num_batched_tokens=512
        ).create_engine_config()
    with pytest.raises(ValueError, match="pooler_config applies to pooling models only"):
        EngineArgs(model=model, device="cpu", pooler_config={"normalize": False}).create_engine_config()


def test_pooler_token_tasks_return_every_token_beside_pooled_requests() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(6, 4)
    qsl = np.array([0, 2, 6])
    pooler = Pooler(PoolerConfig(pooling_type="MEAN"), torch.nn.Module())
    outs = pooler(
        hidden, qsl, [PoolingParams(task="embed", normalize=False), PoolingParams(task="token_embed", normalize=True)]
    )
    torch.testing.assert_close(outs[0], hidden[:2].mean(0), atol=1e-6, rtol=0)
    torch.testing.assert_close(outs[1], F.normalize(hidden[2:], dim=-1), atol=1e-6, rtol=0)


def test_output_processor_turns_the_core_output_into_a_pooling_request_output_with_stats() -> None:
    from vllm_lite.client.output_processor import OutputProcessor
    from vllm_lite.core.messages import EngineCoreOutput, FinishReason
    from vllm_lite.outputs import PoolingRequestOutput

    op = OutputProcessor(tokenizer=None, log_stats=True)
    op.add_request(_request(pooling_params=PoolingParams(task="embed")), "abc")
    data = torch.arange(4, dtype=torch.float32)
    res = op.process_outputs([EngineCoreOutput("r", [], finish_reason=FinishReason.STOP, pooling_output=data)])
    (out,) = res.request_outputs
    assert isinstance(out, PoolingRequestOutput)
    assert (out.request_id, out.prompt, out.prompt_token_ids, out.finished, out.error) == (
        "r",
        "abc",
        [1, 2, 3],
        True,
        None,
    )
    assert torch.equal(out.outputs.data, data) and out.outputs.data is not data  # the caller's own copy
    assert res.iteration_stats.num_prompt_tokens == 3
    assert [f.finish_reason for f in res.iteration_stats.finished_requests] == ["stop"]
    assert not op.has_unfinished_requests()


def test_llm_pooling_methods_on_a_generate_model_say_to_pass_runner_pooling() -> None:
    from types import SimpleNamespace

    from vllm_lite.entrypoints.llm import LLM

    llm = LLM.__new__(LLM)  # the runner check comes before any engine work
    llm.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(runner_type="generate")))
    for method, call in [
        ("embed", lambda: llm.embed("a")),
        ("encode", lambda: llm.encode("a")),
        ("classify", lambda: llm.classify("a")),
        ("score", lambda: llm.score("a", "b")),
    ]:
        with pytest.raises(
            ValueError, match=rf"LLM.{method}\(\) is only supported for pooling models. Try passing `--runner pooling`"
        ):
            call()
    llm.llm_engine = None  # nothing to shut down
