"""vLLM's `--convert`: a generative (*ForCausalLM) checkpoint served as a pooling model.

embed: the decoder's last hidden state of the last token, L2-normalised, against transformers' AutoModel on the
same weights; classify: the checkpoint's `score` head over the last token against transformers'
*ForSequenceClassification; reward: every token's hidden state; and the combinations vLLM refuses. Float32.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import threading

import pytest
import torch
import torch.nn.functional as F

from vllm_lite import LLM, EngineArgs
from vllm_lite.testing.checkpoints import get_checkpoint

PROMPTS = ["The for statement iterates over a sequence.", "a", "Exceptions are raised by the raise statement."]
ATOL = 1e-5
_CORE = dict(dtype="float32", kv_cache_memory_bytes=1 << 21, max_model_len=256)
_ENGINE = dict(_CORE, multiprocess=False)


def _hf_last_hidden(model_dir: str, ids_list: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids])).last_hidden_state[0] for ids in ids_list]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_convert_embed_equals_hf_last_token_normalized(arch: str) -> None:
    model_dir = get_checkpoint(arch)
    with LLM(model=model_dir, convert="embed", **_ENGINE) as llm:
        mc = llm.llm_engine.vllm_config.model_config
        assert (mc.runner_type, mc.convert_type) == ("pooling", "embed")
        assert mc.pooler_config.pooling_type == "LAST" and mc.pooler_config.normalize is True
        outs = llm.embed(PROMPTS, use_tqdm=False)
    wants = _hf_last_hidden(model_dir, [o.prompt_token_ids for o in outs])
    for o, hidden in zip(outs, wants):
        torch.testing.assert_close(
            torch.tensor(o.outputs.embedding), F.normalize(hidden[-1], dim=-1), atol=ATOL, rtol=0
        )


@pytest.fixture(scope="module")
def causal_lm_with_score(tmp_path_factory) -> str:
    """A Qwen2 checkpoint saved by transformers' Qwen2ForSequenceClassification (3 labels), whose config.json
    names Qwen2ForCausalLM: what convert='classify' loads (the `score` head from the checkpoint)."""
    from transformers import AutoModelForSequenceClassification

    src = get_checkpoint("qwen2")
    out = str(tmp_path_factory.mktemp("qwen2-seqcls-as-causal"))
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(src, num_labels=3, dtype=torch.float32)
    model.save_pretrained(out)
    for name in os.listdir(src):
        if "token" in name or name.endswith((".model", ".txt")) or name == "vocab.json":
            shutil.copy(os.path.join(src, name), out)
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["Qwen2ForCausalLM"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return out


def test_convert_classify_equals_hf_sequence_classification_logits(causal_lm_with_score: str) -> None:
    from transformers import Qwen2ForSequenceClassification

    with LLM(model=causal_lm_with_score, convert="classify", **_ENGINE) as llm:
        mc = llm.llm_engine.vllm_config.model_config
        assert mc.architecture == "Qwen2ForSequenceClassification" and mc.convert_type == "classify"
        outs = llm.classify(PROMPTS, use_tqdm=False)
    hf = Qwen2ForSequenceClassification.from_pretrained(causal_lm_with_score, dtype=torch.float32).eval()
    for o in outs:
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([o.prompt_token_ids])).logits[0]
        assert o.outputs.num_classes == 3
        torch.testing.assert_close(torch.tensor(o.outputs.probs), logits.softmax(-1), atol=ATOL, rtol=0)


def test_a_frontend_attached_to_a_converted_core_classifies_as_it_does(causal_lm_with_score: str, tmp_path) -> None:
    """The core's READY reports convert_type, so an attached frontend builds the same converted model config."""
    from vllm_lite.core.engine_core_proc import CoreProcOptions, EngineCoreProc
    from vllm_lite.endpoints import CoreAddresses

    address = f"ipc://{tmp_path}/core"
    args = EngineArgs(
        model=causal_lm_with_score, convert="classify", device="cpu", num_threads=torch.get_num_threads(), **_CORE
    )
    proc = EngineCoreProc(args.create_engine_config(), CoreAddresses.from_base(address), CoreProcOptions())
    thread = threading.Thread(target=proc.run_busy_loop, daemon=True)
    thread.start()
    try:
        with LLM(engine_address=address) as llm:
            mc = llm.llm_engine.vllm_config.model_config
            assert (mc.architecture, mc.convert_type) == ("Qwen2ForSequenceClassification", "classify")
            out = llm.classify(PROMPTS[0], use_tqdm=False)[0]
    finally:
        proc.request_shutdown()
        thread.join(30)
    assert out.outputs.num_classes == 3


def test_convert_reward_returns_every_tokens_hidden_state() -> None:
    model_dir = get_checkpoint("qwen2")
    with LLM(model=model_dir, runner="pooling", convert="reward", **_ENGINE) as llm:
        assert llm.llm_engine.vllm_config.model_config.pooler_config.pooling_type == "ALL"
        outs = llm.reward(PROMPTS[:2], use_tqdm=False)
    for o, hidden in zip(outs, _hf_last_hidden(model_dir, [o.prompt_token_ids for o in outs])):
        torch.testing.assert_close(o.outputs.data, hidden, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(runner="generate", convert="embed"), "convert"),
        (dict(convert="pool"), "convert"),
        (dict(runner="pooling", convert="none"), "convert"),
    ],
)
def test_bad_convert_combinations_are_value_errors_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineArgs(model=get_checkpoint("qwen2"), device="cpu", **kwargs).create_engine_config()


def test_classify_on_a_pooling_model_without_a_head_is_refused() -> None:
    from vllm_lite.testing.pooling_checkpoints import get_pooling_checkpoint

    with pytest.raises(ValueError, match="convert='classify'"):
        EngineArgs(model=get_pooling_checkpoint("qwen3-embed-last"), convert="classify").create_engine_config()


def test_generative_model_under_auto_convert_is_generate_and_pooling_runner_embeds() -> None:
    model_dir = get_checkpoint("qwen2")
    generate = EngineArgs(model=model_dir, device="cpu").create_engine_config().model_config
    assert (generate.runner_type, generate.convert_type, generate.architecture) == (
        "generate",
        "none",
        "Qwen2ForCausalLM",
    )
    pooling = EngineArgs(model=model_dir, runner="pooling", device="cpu").create_engine_config().model_config
    assert (pooling.runner_type, pooling.convert_type, pooling.architecture) == ("pooling", "embed", "Qwen2Model")


def test_convert_cli_flag_parses() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", get_checkpoint("qwen2"), "--convert", "classify"])
    assert EngineArgs.from_cli_args(args).convert == "classify"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--convert", "bogus"])
