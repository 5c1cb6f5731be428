"""Bad input fails early with a clear message, and nothing else is lost."""

from __future__ import annotations

import json
import shutil

import pytest

from vllm_lite import LLM, LLMEngine, SamplingParams
from vllm_lite.engine_args import EngineArgs
from vllm_lite.testing.checkpoints import get_checkpoint


@pytest.fixture(scope="module")
def llm():
    engine = LLM(model=get_checkpoint("llama"), dtype="float32", multiprocess=False, max_model_len=64)
    yield engine
    engine.shutdown()


def test_missing_model_dir_names_the_path(tmp_path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        LLM(model=missing, multiprocess=False)


def test_missing_weights_is_a_clear_error(tmp_path) -> None:
    src = get_checkpoint("llama")
    dst = tmp_path / "no_weights"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    with pytest.raises((FileNotFoundError, ValueError), match="safetensors"):
        LLM(model=str(dst), multiprocess=False)


def test_unknown_architecture_lists_supported_ones(tmp_path) -> None:
    dst = tmp_path / "weird"
    shutil.copytree(get_checkpoint("llama"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FancyNewForCausalLM") as e:
        LLM(model=str(dst), multiprocess=False)
    assert "LlamaForCausalLM" in str(e.value) and "Qwen2ForCausalLM" in str(e.value)


def test_prompt_longer_than_max_model_len_is_rejected(llm) -> None:
    with pytest.raises(ValueError, match="max_model_len|maximum model length"):
        llm.generate({"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=4), use_tqdm=False)


def test_empty_prompt_is_rejected(llm) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, SamplingParams(max_tokens=4), use_tqdm=False)


@pytest.mark.parametrize("bad", [0, -3])
def test_max_tokens_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=bad)


def test_too_long_prompt_in_batch_names_its_index_and_engine_keeps_working(llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    good = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([good[0], {"prompt_token_ids": [5] * 100}, good[1]], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    outs = llm.generate(good, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


def test_bad_request_through_engine_leaves_others_running() -> None:
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=get_checkpoint("llama"), dtype="float32", max_model_len=64), multiprocess_mode=False
    )
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [3, 4, 5]}, params)
    with pytest.raises(ValueError):
        engine.add_request("b", {"prompt_token_ids": [1] * 200}, params)
    engine.add_request("c", {"prompt_token_ids": [6, 7]}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == ["a", "c"]
    assert all(len(o.outputs[0].token_ids) == 5 for o in done.values())
    free = engine.call_utility("get_num_free_blocks")
    assert free == engine.call_utility("get_num_total_blocks")  # no KV block leaked
    engine.shutdown()


def test_kv_cache_too_small_for_one_sequence_fails_at_startup() -> None:
    with pytest.raises(ValueError, match="KV cache too small"):
        LLM(model=get_checkpoint("llama"), multiprocess=False, max_model_len=512, kv_cache_memory_bytes=4096)
