"""Processor: validation and tokenization of prompts and sampling params."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from vllm_lite.client.processor import Processor
from vllm_lite.config import ModelConfig
from vllm_lite.core.messages import EngineCoreRequest
from vllm_lite.sampling_params import SamplingParams

torch.set_num_threads(1)

MAX_LEN = 32


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from vllm_lite.testing.checkpoints import build_tokenizer

    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def make_processor(tokenizer, model_dir: str, gen_config: dict | None = None, **kw) -> Processor:
    if gen_config is not None:
        with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
            json.dump(gen_config, f)
    cfg = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        dtype=torch.float32,
        max_model_len=MAX_LEN,
        hf_config={},
        architecture="LlamaForCausalLM",
        vocab_size=len(tokenizer),
    )
    return Processor(cfg, tokenizer, **kw)


@pytest.fixture()
def proc(tokenizer, tmp_path):
    return make_processor(tokenizer, str(tmp_path))


def test_text_prompt_is_tokenized_with_special_tokens(proc, tokenizer):
    text, req = proc.process_inputs("a", "Hello world", SamplingParams(max_tokens=4), arrival_time=5.0, priority=2)
    assert isinstance(req, EngineCoreRequest)
    assert text == "Hello world"
    assert req.prompt_token_ids == tokenizer.encode("Hello world", add_special_tokens=True)
    assert req.prompt_token_ids[0] == tokenizer.bos_token_id
    assert req.eos_token_id == tokenizer.eos_token_id
    assert req.arrival_time == 5.0 and req.priority == 2 and req.request_id == "a"


def test_token_id_and_dict_prompts(proc):
    assert proc.process_inputs("a", [5, 6, 7], SamplingParams())[1].prompt_token_ids == [5, 6, 7]
    text, req = proc.process_inputs("b", {"prompt_token_ids": [8, 9], "prompt": "hi"}, SamplingParams())
    assert text == "hi" and req.prompt_token_ids == [8, 9]
    text, req = proc.process_inputs("c", {"prompt": "hi"}, SamplingParams())
    assert text == "hi" and len(req.prompt_token_ids) >= 2


def test_numpy_token_ids_become_plain_ints(proc):
    import numpy as np

    _, req = proc.process_inputs("a", {"prompt_token_ids": np.array([5, 6], dtype=np.int64)}, SamplingParams())
    assert req.prompt_token_ids == [5, 6] and all(type(t) is int for t in req.prompt_token_ids)
    _, req = proc.process_inputs("b", [np.int32(7)], SamplingParams())
    assert req.prompt_token_ids == [7] and type(req.prompt_token_ids[0]) is int


@pytest.mark.parametrize("prompt", ["", [], {"prompt_token_ids": []}, {"prompt": ""}])
def test_empty_prompt_is_rejected(proc, prompt):
    with pytest.raises(ValueError, match="prompt is empty"):
        proc.process_inputs("a", prompt, SamplingParams())


def test_too_long_prompt_names_both_lengths(proc):
    proc.process_inputs("ok", list(range(10, 10 + MAX_LEN - 1)), SamplingParams())  # exactly fits
    with pytest.raises(ValueError, match=rf"{MAX_LEN} tokens.*max_model_len={MAX_LEN}"):
        proc.process_inputs("a", list(range(10, 10 + MAX_LEN)), SamplingParams())


@pytest.mark.parametrize("bad_id", [-1, 2000, 10**6])
def test_out_of_vocabulary_prompt_ids_are_rejected(proc, bad_id):
    with pytest.raises(ValueError, match=rf"token id {bad_id}.*out of vocabulary"):
        proc.process_inputs("a", [5, bad_id], SamplingParams())


@pytest.mark.parametrize(
    "prompt, exc",
    [
        (3.5, TypeError),
        ([1, "x"], TypeError),
        ([1, True], TypeError),
        ({"text": "x"}, ValueError),
        ({"prompt": 5}, TypeError),
    ],
)
def test_malformed_prompts_are_rejected(proc, prompt, exc):
    with pytest.raises(exc, match="prompt"):
        proc.process_inputs("a", prompt, SamplingParams())


def test_bad_params_are_rejected(proc):
    with pytest.raises(TypeError, match="params"):
        proc.process_inputs("a", [5], {"temperature": 0.5})
    with pytest.raises(ValueError, match="stop_token_ids"):
        proc.process_inputs("a", [5], SamplingParams(stop_token_ids=[5000]))
    with pytest.raises(ValueError, match="logit_bias"):
        proc.process_inputs("a", [5], SamplingParams(logit_bias={99999: 1.0}))
    with pytest.raises(ValueError, match="logprobs"):
        proc.process_inputs("a", [5], SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        proc.process_inputs("a", [5], SamplingParams(prompt_logprobs=50))
    with pytest.raises(TypeError, match="request_id"):
        proc.process_inputs("", [5], SamplingParams())
    with pytest.raises(TypeError, match="priority"):
        proc.process_inputs("a", [5], SamplingParams(), priority="high")
    with pytest.raises(ValueError, match="bad_words"):
        proc.process_inputs("a", [5], SamplingParams(bad_words=["  "]))


def test_max_tokens_none_means_up_to_max_model_len(proc):
    _, req = proc.process_inputs("a", [5, 6, 7], SamplingParams(max_tokens=None))
    assert req.sampling_params.max_tokens == MAX_LEN - 3


def test_callers_params_are_not_mutated(proc):
    params = SamplingParams(max_tokens=None, stop_token_ids=[9], bad_words=["hello"])
    _, req = proc.process_inputs("a", [5], params)
    assert params.max_tokens is None and params._bad_words_token_ids is None and params._all_stop_token_ids == [9]
    assert req.sampling_params is not params
    assert req.sampling_params._bad_words_token_ids


def test_generation_config_eos_ids_become_stop_ids_except_tokenizer_eos(tokenizer, tmp_path):
    eos = tokenizer.eos_token_id
    proc = make_processor(tokenizer, str(tmp_path), {"eos_token_id": [eos, 3, 7]})
    _, req = proc.process_inputs("a", [5], SamplingParams(stop_token_ids=[11, 7]))
    assert req.sampling_params._all_stop_token_ids == [11, 7, 3]
    assert req.sampling_params.stop_token_ids == [11, 7]  # the user's list is unchanged
    _, req = proc.process_inputs("b", [5], SamplingParams(stop_token_ids=[11], ignore_eos=True))
    assert req.sampling_params._all_stop_token_ids == [11]
    single = make_processor(tokenizer, str(tmp_path / "no_gen_config"))  # nothing extra
    assert single.process_inputs("c", [5], SamplingParams())[1].sampling_params._all_stop_token_ids == []


def test_default_sampling_params_come_from_generation_config(tokenizer, tmp_path):
    gen = {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.1,
        "max_new_tokens": 64,
        "do_sample": True,
    }
    proc = make_processor(tokenizer, str(tmp_path), gen)
    p = proc.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.6, 0.9, 20, 1.1, 64)
    empty = make_processor(tokenizer, str(tmp_path / "none_here"))
    assert empty.get_default_sampling_params().temperature == SamplingParams().temperature


def test_bad_words_are_tokenized_with_and_without_leading_space(proc, tokenizer):
    _, req = proc.process_inputs("a", [5], SamplingParams(bad_words=["hello", " world"]))
    seqs = req.sampling_params._bad_words_token_ids
    for word in ("hello", " hello", "world", " world"):
        assert tokenizer.encode(word, add_special_tokens=False) in seqs
    assert len(seqs) == len({tuple(s) for s in seqs})  # no duplicates
