"""Models resolve as in vLLM: local directories, or repo ids found in the Hugging Face cache with the network off."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from vllm_lite import envs
from vllm_lite.client.processor import Processor
from vllm_lite.engine_args import EngineArgs
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.hf_cache import place_in_hf_cache

REPO = "test-org/tiny-llama"
COMMIT = "1234567890abcdef1234567890abcdef12345678"


@pytest.fixture
def hf_cache(tmp_path, tiny_checkpoint) -> str:
    cache = str(tmp_path / "hub")
    place_in_hf_cache(tiny_checkpoint, cache, REPO, commit=COMMIT)
    return cache


def test_suite_runs_offline():
    assert envs.HF_HUB_OFFLINE  # the premise of every test below: nothing is downloaded


def test_repo_id_resolves_to_its_cached_snapshot(hf_cache):
    config = EngineArgs(model=REPO, download_dir=hf_cache, device="cpu").create_engine_config()
    snapshot = os.path.join(hf_cache, "models--test-org--tiny-llama", "snapshots", COMMIT)
    assert os.path.samefile(config.model_config.model, snapshot)
    assert os.path.samefile(config.model_config.tokenizer, snapshot)
    assert config.model_config.name == REPO  # served under the repo id, as vLLM does


def test_revision_names_a_ref_in_the_cache(hf_cache, tiny_checkpoint):
    other = "abcdefabcdefabcdefabcdefabcdefabcdefabcd"
    place_in_hf_cache(tiny_checkpoint, hf_cache, REPO, commit=other, ref="v2")
    config = EngineArgs(model=REPO, revision="v2", download_dir=hf_cache, device="cpu").create_engine_config()
    assert os.path.basename(config.model_config.model) == other
    tok_only = EngineArgs(model=REPO, tokenizer_revision="v2", download_dir=hf_cache, device="cpu")
    mc = tok_only.create_engine_config().model_config
    assert os.path.basename(mc.model) == COMMIT and os.path.basename(mc.tokenizer) == other


def test_missing_repo_offline_names_the_repo_and_the_reason(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nobody/absent.*HF_HUB_OFFLINE=1"):
        EngineArgs(model="nobody/absent", download_dir=str(tmp_path), device="cpu").create_engine_config()


def test_missing_local_path_is_not_looked_up_on_the_hub(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        EngineArgs(model=str(tmp_path / "no" / "such" / "dir"), device="cpu").create_engine_config()


def test_repo_id_loads_and_generates_like_the_local_directory(hf_cache, tiny_checkpoint):
    """HF_HUB_CACHE + HF_HUB_OFFLINE=1 in a child's environment only: the default cache is found by repo id."""
    script = textwrap.dedent(
        f"""
        import json, sys
        from vllm_lite import LLM, SamplingParams
        sp = SamplingParams(temperature=0.0, max_tokens=6)
        out = []
        for model in ({REPO!r}, {tiny_checkpoint!r}):
            llm = LLM(model=model, multiprocess=False, device="cpu", kv_cache_memory_bytes=1 << 22)
            r = llm.generate([[5, 6, 7, 8]], sp, use_tqdm=False)[0]
            out.append(r.outputs[0].token_ids)
            llm.shutdown()
        print(json.dumps(out))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_CACHE=hf_cache, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_id, by_dir = json.loads(proc.stdout.strip().splitlines()[-1])
    assert by_id == by_dir and len(by_id) == 6


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"trust_remote_code": True}, ValueError, "runs no code from checkpoints"),
        ({"quantization": "awq"}, ValueError, "quantization='awq'.*not quantized"),
        ({"max_logprobs": -1}, ValueError, "max_logprobs"),
        ({"generation_config": "/no/such/dir"}, FileNotFoundError, "generation_config"),
    ],
)
def test_options_we_cannot_honour_are_refused_with_the_reason(tiny_checkpoint, kwargs, error, match):
    with pytest.raises(error, match=match):
        EngineArgs(model=tiny_checkpoint, device="cpu", **kwargs).create_engine_config()


def test_unknown_engine_arguments_raise_type_error_naming_them(tiny_checkpoint):
    from vllm_lite import LLM

    with pytest.raises(TypeError, match="not_a_flag"):
        EngineArgs(model=tiny_checkpoint, not_a_flag=1)
    with pytest.raises(TypeError, match="not_a_flag"):
        LLM(model=tiny_checkpoint, not_a_flag=1)


@pytest.fixture
def model_with_generation_config(tmp_path, tiny_checkpoint) -> str:
    path = str(tmp_path / "model")
    shutil.copytree(tiny_checkpoint, path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"temperature": 0.3, "top_p": 0.7, "max_new_tokens": 9}, f)
    return path


def test_generation_config_auto_vllm_and_a_directory(model_with_generation_config, tiny_checkpoint):
    def defaults(**kwargs):
        mc = EngineArgs(device="cpu", **kwargs).create_engine_config().model_config
        return Processor(mc, None).get_default_sampling_params()

    auto = defaults(model=model_with_generation_config)
    assert (auto.temperature, auto.top_p, auto.max_tokens) == (0.3, 0.7, 9)
    plain = defaults(model=model_with_generation_config, generation_config="vllm")
    vllm_default = SamplingParams()
    assert (plain.temperature, plain.top_p, plain.max_tokens) == (1.0, 1.0, vllm_default.max_tokens)
    other = defaults(model=tiny_checkpoint, generation_config=model_with_generation_config)
    assert (other.temperature, other.max_tokens) == (0.3, 9)


def test_max_logprobs_is_the_cap_in_the_frontend_and_the_core(tiny_checkpoint):
    from vllm_lite import LLM

    llm = LLM(model=tiny_checkpoint, multiprocess=False, device="cpu", max_logprobs=25, kv_cache_memory_bytes=1 << 22)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, logprobs=25), use_tqdm=False)[0]
        assert len(out.outputs[0].logprobs[0]) >= 25  # above vLLM's default cap of 20
        assert llm.llm_engine.processor.max_logprobs == 25
        with pytest.raises(ValueError, match="logprobs must be at most 25"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, logprobs=26), use_tqdm=False)
    finally:
        llm.shutdown()
