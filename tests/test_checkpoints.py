"""The test-checkpoint fixtures: tokenizer contract, non-degenerate weights, cache reuse and race safety."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers

from vllm_lite.testing import checkpoints
from vllm_lite.testing.checkpoints import build_tokenizer, get_checkpoint


def test_tokenizer_loads_as_fast_tokenizer_with_special_tokens_and_chat_template(tmp_path):
    path = build_tokenizer(str(tmp_path / "tok"))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert tok.is_fast
    assert 1900 <= len(tok) <= 2000
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    text = "def f(x):\n    return x + 1  # héllo"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text  # byte-level: lossless round trip
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>\nhi</s>\n<|assistant|>\n"


@pytest.mark.parametrize("arch", ["llama", "opt", "gpt2", "gemma2"])
def test_greedy_decoding_of_tiny_checkpoint_is_not_degenerate(arch):
    """Random weights scaled so greedy generation varies (not one token repeated forever)."""
    path = get_checkpoint(arch)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tok("The quick brown fox", return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = model(prompt).logits[0, -1]
        out = model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    top2 = logits.topk(2).values
    assert top2[0] - top2[1] > 1e-3  # not tied
    assert len(set(out[0, prompt.shape[1] :].tolist())) >= 4


def test_checkpoint_config_matches_the_requested_shape():
    with open(os.path.join(get_checkpoint("qwen3"), "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["head_dim"] == 32 and cfg["hidden_size"] == 64 and cfg["num_key_value_heads"] == 2
    with pytest.raises(ValueError, match="arch must be one of"):
        get_checkpoint("bloom")


def test_concurrent_builders_share_one_cache_entry(tmp_path, monkeypatch):
    """Two builders racing on an empty cache (threads: same filesystem race, no process start-up cost)."""
    cache = str(tmp_path / "cache")
    monkeypatch.setenv("VLLM_LITE_TEST_CACHE", cache)
    with ThreadPoolExecutor(2) as pool:
        paths = set(pool.map(lambda _: get_checkpoint("opt"), range(2)))
    entry = f"{checkpoints.CACHE_VERSION}-opt-tiny"
    assert paths == {os.path.join(cache, entry)}
    # Only the final entry is left: the loser's temp build dir is gone.
    assert os.listdir(cache) == [entry]
    assert transformers.AutoConfig.from_pretrained(os.path.join(cache, entry)).model_type == "opt"
    mtime = os.path.getmtime(os.path.join(cache, entry, "config.json"))
    get_checkpoint("opt")  # reused, not rebuilt
    assert os.path.getmtime(os.path.join(cache, entry, "config.json")) == mtime
