"""vLLM's everyday engine and server flags, with vLLM's names and meanings: --load-format (auto, safetensors, pt,
dummy), --enable-chunked-prefill, --kv-cache-dtype, --num-gpu-blocks-override, --disable-fastapi-docs and
--disable-uvicorn-access-log. Each is parsed from the command line into EngineArgs and the engine config, and its
effect checked on a real engine, server or loader; bad values are refused naming the field."""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import shutil
from typing import Any

import httpx
import pytest
import torch

from vllm_lite.engine_args import EngineArgs
from vllm_lite.entrypoints.openai.api_server import server_options
from vllm_lite.entrypoints.openai.cli_args import make_arg_parser
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.core_harness import Result, drain, make_request, tiny_engine_core, unique_id
from vllm_lite.testing.openai_fake_engine import FakeAsyncLLM
from vllm_lite.testing.openai_server import ServerThread
from vllm_lite.testing.quantize import quantization_config
from vllm_lite.worker.gpu_worker import GPUWorker
from vllm_lite.worker.model_loader import (
    DUMMY_HIGH,
    DUMMY_LOW,
    iterate_weights,
    load_model,
    weight_files,
)


def _parse(argv: list[str]) -> argparse.Namespace:
    return make_arg_parser(argparse.ArgumentParser()).parse_args(argv)


def _weightless_copy(src: str, dst: str, config_edit=None) -> str:
    """dst with src's config.json, tokenizer and generation config, and no weight file."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith((".safetensors", ".safetensors.index.json", ".bin", ".pt")):
            shutil.copy(os.path.join(src, name), dst)
    if config_edit is not None:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            config = json.load(f)
        config_edit(config)
        with open(path, "w") as f:
            json.dump(config, f)
    return dst


@pytest.fixture(scope="module")
def weightless(tmp_path_factory) -> str:
    return _weightless_copy(get_checkpoint("llama"), str(tmp_path_factory.mktemp("weightless") / "llama"))


def _model_config(path: str, **kw):
    return EngineArgs(model=path, device="cpu", dtype="float32", **kw).create_engine_config().model_config


# ---------------------------------------------------------------------------- the command line


def test_flags_parse_into_engine_args_and_the_engine_config(weightless):
    args = _parse(
        [
            "--model",
            weightless,
            "--device",
            "cpu",
            "--load-format",
            "dummy",
            "--kv-cache-dtype",
            "auto",
            "--num-gpu-blocks-override",
            "40",
            "--enable-chunked-prefill",
            "--disable-fastapi-docs",
            "--disable-uvicorn-access-log",
        ]
    )
    ea = EngineArgs.from_cli_args(args)
    assert (ea.load_format, ea.kv_cache_dtype, ea.num_gpu_blocks_override, ea.enable_chunked_prefill) == (
        "dummy",
        "auto",
        40,
        True,
    )
    config = ea.create_engine_config()
    assert config.model_config.load_format == "dummy"
    assert config.cache_config.num_gpu_blocks_override == 40
    assert config.cache_config.cache_dtype == "auto"
    assert config.scheduler_config.enable_chunked_prefill is True
    options = server_options(args)
    assert options["disable_fastapi_docs"] is True and options["disable_uvicorn_access_log"] is True
    # Unset: vLLM's defaults.
    plain = _parse(["--model", weightless])
    assert (plain.load_format, plain.kv_cache_dtype, plain.num_gpu_blocks_override) == ("auto", "auto", None)
    assert plain.enable_chunked_prefill is None
    assert not server_options(plain)["disable_fastapi_docs"] and not server_options(plain)["disable_uvicorn_access_log"]
    off = _parse(["--model", weightless, "--no-enable-chunked-prefill"])
    assert off.enable_chunked_prefill is False
    assert EngineArgs.from_cli_args(off).create_engine_config().scheduler_config.enable_chunked_prefill is False


@pytest.mark.parametrize(
    "max_model_len, max_num_seqs, given, expected",
    [
        (512, 128, None, 2048),  # vLLM's max(max_model_len, 2048)
        (1024, 128, None, 2048),
        (512, 2, None, 1024),  # at most max_num_seqs * max_model_len, as vLLM
        (512, 128, 512, 512),  # given and >= max_model_len: kept
    ],
)
def test_no_chunked_prefill_budget(weightless, max_model_len, max_num_seqs, given, expected):
    """Off, the step budget holds a whole max_model_len prompt: vLLM's default, or the given value if it does."""
    config = EngineArgs(
        model=weightless,
        device="cpu",
        enable_chunked_prefill=False,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=given,
    ).create_engine_config()
    assert config.scheduler_config.max_num_batched_tokens == expected
    assert config.scheduler_config.enable_chunked_prefill is False
    # On (unset), the default is unchanged: max(2048, min(max_model_len, 8192)) on CPU.
    on = EngineArgs(
        model=weightless,
        device="cpu",
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=given,
    )
    assert on.create_engine_config().scheduler_config.max_num_batched_tokens == (
        given or max(2048, min(max_model_len, 8192))
    )


def test_no_chunked_prefill_refuses_a_budget_below_max_model_len(weightless):
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(511\) is smaller than max_model_len \(512\)"):
        EngineArgs(
            model=weightless, device="cpu", enable_chunked_prefill=False, max_model_len=512, max_num_batched_tokens=511
        ).create_engine_config()
    # The same budget with chunked prefill on is fine (prompts run in chunks).
    on = EngineArgs(model=weightless, device="cpu", max_model_len=512, max_num_batched_tokens=511)
    assert on.create_engine_config().scheduler_config.max_num_batched_tokens == 511


def test_serve_subcommand_takes_the_flags(weightless):
    from vllm_lite.entrypoints.cli import build_parser
    from vllm_lite.entrypoints.cli.serve import serve_config_from

    parser, _ = build_parser()
    args = parser.parse_args(
        ["serve", weightless, "--load-format", "dummy", "--num-gpu-blocks-override", "33", "--disable-fastapi-docs"]
    )
    cfg = serve_config_from(args)
    assert cfg.engine_args.load_format == "dummy" and cfg.engine_args.num_gpu_blocks_override == 33
    assert cfg.http_options["disable_fastapi_docs"] is True
    assert cfg.http_options["disable_uvicorn_access_log"] is False
    # What serve's HTTP frontend processes are started with (typed, msgpack on the launcher's pipe).
    import msgspec

    from vllm_lite.entrypoints.serve_frontend import FrontendArgs

    sent = FrontendArgs(engine=["ipc:///x"], listen_fd=3, **cfg.http_options)
    got = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=FrontendArgs)
    assert got.disable_fastapi_docs is True and got.disable_uvicorn_access_log is False


@pytest.mark.parametrize(
    "flags",
    [
        ["--kv-cache-dtype", "int8"],
        ["--num-gpu-blocks-override", "many"],
        ["--enable-chunked-prefill", "yes"],
    ],
)
def test_malformed_values_are_argparse_errors(flags, weightless, capsys):
    with pytest.raises(SystemExit):
        _parse(["--model", weightless, *flags])
    assert "error" in capsys.readouterr().err


# ---------------------------------------------------------------------------- values we refuse, naming the field


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"load_format": "npcache"}, "load_format"),
        ({"load_format": "gguf"}, "load_format"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype"),
        ({"kv_cache_dtype": "bfloat16"}, "kv_cache_dtype"),  # the model computes in float32 here
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),  # Python callers skip argparse's choices
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 100}, "max_num_batched_tokens"),
        ({"enable_chunked_prefill": False, "long_prefill_token_threshold": 64}, "long_prefill_token_threshold"),
        ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override"),
        ({"num_gpu_blocks_override": -5}, "num_gpu_blocks_override"),
        ({"num_gpu_blocks_override": True}, "num_gpu_blocks_override"),
    ],
)
def test_unsupported_values_are_value_errors_naming_the_field(kwargs, field, weightless):
    with pytest.raises(ValueError, match=field):
        EngineArgs(model=weightless, device="cpu", dtype="float32", **kwargs).create_engine_config()


def test_load_format_error_lists_the_formats_we_have(weightless):
    with pytest.raises(ValueError) as e:
        EngineArgs(model=weightless, load_format="tensorizer").create_engine_config()
    assert all(name in str(e.value) for name in ("auto", "safetensors", "pt", "dummy"))


def test_kv_cache_dtype_naming_the_models_dtype_is_auto(weightless):
    config = EngineArgs(model=weightless, device="cpu", dtype="bfloat16", kv_cache_dtype="bfloat16")
    assert config.create_engine_config().cache_config.cache_dtype == "auto"


def test_chunked_prefill_follows_the_runner(weightless):
    """Generative models chunk unless told not to (True/None: on, False: off); pooling models run prompts whole
    (False/None)."""
    gen = EngineArgs(model=weightless, device="cpu", enable_chunked_prefill=True).create_engine_config()
    assert gen.scheduler_config.enable_chunked_prefill is True
    unset = EngineArgs(model=weightless, device="cpu").create_engine_config()
    assert unset.scheduler_config.enable_chunked_prefill is True
    gen_off = EngineArgs(model=weightless, device="cpu", enable_chunked_prefill=False).create_engine_config()
    assert gen_off.scheduler_config.enable_chunked_prefill is False
    pool = EngineArgs(model=weightless, device="cpu", runner="pooling").create_engine_config()
    assert pool.scheduler_config.enable_chunked_prefill is False
    off = EngineArgs(model=weightless, device="cpu", runner="pooling", enable_chunked_prefill=False)
    assert off.create_engine_config().scheduler_config.enable_chunked_prefill is False
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        EngineArgs(model=weightless, device="cpu", runner="pooling", enable_chunked_prefill=True).create_engine_config()


def test_dummy_weights_are_refused_for_a_quantized_checkpoint(tmp_path):
    path = _weightless_copy(
        get_checkpoint("llama"),
        str(tmp_path / "awq"),
        lambda c: c.update(quantization_config=quantization_config("awq", 32)),
    )
    with pytest.raises(ValueError, match="load_format='dummy'"):
        EngineArgs(model=path, device="cpu", load_format="dummy").create_engine_config()


# ---------------------------------------------------------------------------- load_format: what is read


def test_dummy_needs_no_weight_file_and_is_deterministic_small_and_finite(weightless):
    config = _model_config(weightless, load_format="dummy")
    with pytest.raises(FileNotFoundError):  # the directory really holds no weights
        weight_files(weightless, "auto")
    a = load_model(config, torch.device("cpu"))
    b = load_model(config, torch.device("cpu"))
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys() and pa
    for name, p in pa.items():
        torch.testing.assert_close(p, pb[name], rtol=0, atol=0, msg=name)
        assert torch.isfinite(p).all(), name
        assert p.min() >= DUMMY_LOW and p.max() <= DUMMY_HIGH, name
        if p.numel() > 16:  # random, not a constant fill
            assert p.std() > (DUMMY_HIGH - DUMMY_LOW) / 10, name


def test_dummy_engine_generates_from_config_and_tokenizer_only(weightless):
    from vllm_lite import LLM

    llm = LLM(
        model=weightless,
        load_format="dummy",
        device="cpu",
        dtype="float32",
        max_model_len=128,
        override_generation_config={"top_k": 7, "max_new_tokens": 11},
    )
    try:
        params = SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.0, logprobs=1)
        outs = llm.generate(["hello there", "a b c"], params)
        defaults = llm.get_default_sampling_params()  # what a request without params gets
    finally:
        llm.shutdown()
    assert (defaults.top_k, defaults.max_tokens) == (7, 11)
    for out in outs:
        comp = out.outputs[0]
        assert len(comp.token_ids) == 9
        assert all(torch.isfinite(torch.tensor([lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs)])))


def _torch_save_weights(src: str, dst: str, name: str) -> str:
    """The safetensors checkpoint `src` as one PyTorch state dict file dst/name (plus config and tokenizer)."""
    _weightless_copy(src, dst)
    state = {k: v.clone() for k, v in iterate_weights(src)}
    torch.save(state, os.path.join(dst, name))
    return dst


@pytest.mark.parametrize("load_format, file_name", [("auto", "pytorch_model.bin"), ("pt", "model.pt")])
def test_pytorch_state_dicts_load_the_same_weights_as_safetensors(load_format, file_name, tmp_path):
    src = get_checkpoint("llama")
    dst = _torch_save_weights(src, str(tmp_path / "pt"), file_name)
    assert weight_files(dst, load_format)[0] == "pt"
    with pytest.raises(FileNotFoundError):  # safetensors only: there are none
        weight_files(dst, "safetensors")
    want = dict(load_model(_model_config(src), torch.device("cpu")).named_parameters())
    got = dict(load_model(_model_config(dst, load_format=load_format), torch.device("cpu")).named_parameters())
    assert want.keys() == got.keys()
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, rtol=0, atol=0, msg=name)


class _RunsCode:
    """An object whose unpickling would call os.system: weights_only loading must refuse it."""

    def __reduce__(self):
        return (os.system, ("touch should-not-exist",))


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])  # zip format (mmap) and a legacy pickle
def test_pt_files_that_would_run_code_are_refused(writer, tmp_path, monkeypatch):
    dst = _weightless_copy(get_checkpoint("llama"), str(tmp_path / "evil"))
    payload = {"model.embed_tokens.weight": _RunsCode()}
    with open(os.path.join(dst, "pytorch_model.bin"), "wb") as f:
        if writer == "torch.save":
            torch.save(payload, f)
        else:
            pickle.dump(payload, f, protocol=2)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(pickle.UnpicklingError):
        list(iterate_weights(dst, load_format="pt"))
    assert not (tmp_path / "should-not-exist").exists()


def test_safetensors_format_ignores_pytorch_files(tmp_path):
    """load_format=safetensors reads the *.safetensors even when PyTorch files sit beside them."""
    src = get_checkpoint("llama")
    dst = str(tmp_path / "both")
    shutil.copytree(src, dst)
    torch.save({"junk": torch.zeros(1)}, os.path.join(dst, "pytorch_model.bin"))
    kind, files = weight_files(dst, "safetensors")
    assert kind == "safetensors" and all(f.endswith(".safetensors") for f in files)
    assert weight_files(dst, "auto")[0] == "safetensors"  # auto prefers them too


# ---------------------------------------------------------------------------- num_gpu_blocks_override


def test_num_gpu_blocks_override_sizes_the_kv_cache_exactly():
    core = tiny_engine_core(num_gpu_blocks_override=37)  # its kv_cache_memory_bytes would give another count
    try:
        assert core.model_facts["num_gpu_blocks"] == 37
        assert core.scheduler.num_total_blocks == 37 - 1  # the null block is never handed out
        caches = [layer.kv_cache for layer in core.executor.worker.model_runner.attn_layers]
        assert caches and all(c.shape[1] == 37 for c in caches)
        results: dict[str, Result] = {}
        rid = unique_id("override")
        core.add_request(make_request(rid, [5, 6, 7, 8]))
        drain(core, results)
        assert len(results[rid].token_ids) == 4
    finally:
        core.shutdown()


def test_num_gpu_blocks_override_too_small_for_one_request_is_refused():
    # max_model_len 64 in blocks of 8: one request needs 8 blocks plus the null block.
    with pytest.raises(ValueError, match="num_gpu_blocks_override=8 is too small"):
        tiny_engine_core(num_gpu_blocks_override=8)
    core = tiny_engine_core(num_gpu_blocks_override=9)
    core.shutdown()


class _SizingRunner:
    """What determine_num_blocks asks the runner: a block's bytes (1 MiB here)."""

    def kv_cache_bytes_per_block(self) -> int:
        return 1 << 20


def _cuda_sizing_worker(monkeypatch, budget: Any) -> tuple[GPUWorker, list[int]]:
    """A GPUWorker shell that sizes its KV cache as on CUDA (no device touched): num_gpu_blocks_override=10,
    4 blocks a sequence, the profiled budget `budget` bytes (an exception: raised). Returns it and its
    profiling calls."""
    from vllm_lite.testing.scheduler_config import make_config

    worker = GPUWorker.__new__(GPUWorker)
    worker.config = make_config(max_model_len=16, block_size=4)
    worker.config.cache_config.num_gpu_blocks_override = 10
    worker.device = torch.device("cuda", 0)
    worker.model_runner = _SizingRunner()
    calls: list[int] = []

    def profiled() -> int:
        calls.append(1)
        if isinstance(budget, Exception):
            raise budget
        return budget

    monkeypatch.setattr(worker, "_profiled_cuda_budget", profiled)
    monkeypatch.setattr(worker, "_blocks_per_seq", lambda: 4)
    return worker, calls


@pytest.mark.parametrize(
    ("budget", "warned"),
    [(100 << 20, None), (5 << 20, "num_gpu_blocks_override=10 needs"), (ValueError("no room"), "no room")],
)
def test_num_gpu_blocks_override_on_cuda_still_profiles_and_warns_when_the_card_cannot_hold_it(
    monkeypatch, caplog, budget, warned
):
    """As vLLM: under the override the profiling pass still runs on CUDA (the largest step's kernels compile at
    start-up), and an override beyond the memory budget is a warning at start-up, the blocks as asked."""
    worker, calls = _cuda_sizing_worker(monkeypatch, budget)
    with caplog.at_level(logging.WARNING, logger="vllm_lite.worker.gpu_worker"):
        assert worker.determine_num_blocks() == (10, 0)
    assert calls == [1]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if warned is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warned in warnings[0]


def test_num_gpu_blocks_override_off_cuda_runs_no_profiling_pass(monkeypatch):
    worker, calls = _cuda_sizing_worker(monkeypatch, 1 << 30)
    worker.device = torch.device("cpu")
    assert worker.determine_num_blocks() == (10, 0) and calls == []


# ---------------------------------------------------------------------------- server flags


@pytest.mark.parametrize("disabled", [False, True])
def test_fastapi_docs_and_access_log_flags(disabled):
    srv = ServerThread(
        lambda: FakeAsyncLLM(get_checkpoint("llama")),
        disable_fastapi_docs=disabled,
        disable_uvicorn_access_log=disabled,
    )
    try:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(srv.base_url + path, timeout=30).status_code == (404 if disabled else 200), path
        assert httpx.get(srv.base_url + "/health", timeout=30).status_code == 200
        assert srv.app.state.server.config.access_log is (not disabled)
    finally:
        srv.stop()


# ---------------------------------------------------------------------------- override_generation_config


@pytest.fixture(scope="module")
def with_gen_config(tmp_path_factory) -> str:
    """A weightless checkpoint whose generation_config.json recommends temperature 0.7 and top_k 20."""
    path = _weightless_copy(get_checkpoint("llama"), str(tmp_path_factory.mktemp("gen") / "llama"))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 2, "temperature": 0.7, "top_k": 20}, f)
    return path


def _defaults(model_config) -> SamplingParams:
    from vllm_lite.client.processor import Processor

    return Processor(model_config, None).get_default_sampling_params()


def test_override_generation_config_is_laid_over_the_checkpoints_defaults(with_gen_config):
    args = _parse(
        ["--model", with_gen_config, "--override-generation-config", '{"temperature": 0.2, "max_new_tokens": 5}']
    )
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.model_config.override_generation_config == {"temperature": 0.2, "max_new_tokens": 5}
    got = _defaults(config.model_config)
    assert (got.temperature, got.top_k, got.max_tokens) == (0.2, 20, 5)  # top_k still the checkpoint's
    plain = _defaults(EngineArgs(model=with_gen_config).create_engine_config().model_config)
    assert (plain.temperature, plain.top_k) == (0.7, 20)
    # generation_config="vllm": vLLM's defaults, and the override on top of them (as vLLM).
    vllm_defaults = EngineArgs(
        model=with_gen_config, generation_config="vllm", override_generation_config={"temperature": 0.2}
    ).create_engine_config()
    got = _defaults(vllm_defaults.model_config)
    assert got.temperature == 0.2 and got.top_k == SamplingParams().top_k


def test_override_generation_config_reaches_serves_attached_frontends(with_gen_config, monkeypatch):
    """serve's HTTP frontends build their config from the core's handshake facts; the override rides in their
    FrontendArgs (the core does not report it) and lands in their processor."""
    from types import SimpleNamespace

    import msgspec

    import vllm_lite.client.async_llm as async_llm
    from vllm_lite.entrypoints.cli import build_parser
    from vllm_lite.entrypoints.cli.serve import serve_config_from
    from vllm_lite.entrypoints.reattach import build_attached_engine
    from vllm_lite.entrypoints.serve_frontend import FrontendArgs

    parser, _ = build_parser()
    argv = ["serve", with_gen_config, "--override-generation-config", '{"top_p": 0.5}']
    cfg = serve_config_from(parser.parse_args(argv))
    # As the daemon starts a frontend process: FrontendArgs from http_options, msgpack over the launcher's pipe.
    sent = FrontendArgs(engine=["ipc:///x"], listen_fd=3, **cfg.http_options)
    frontend_args = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=FrontendArgs)
    client = SimpleNamespace(  # the handshake's facts of a core serving the checkpoint
        model_path=with_gen_config,
        tokenizer_path=with_gen_config,
        model_facts={"model": with_gen_config, "max_model_len": 128, "block_size": 16},
    )
    monkeypatch.setattr(async_llm, "AsyncLLM", lambda config, client: config)  # the config it would run on
    got = _defaults(build_attached_engine(frontend_args, client).model_config)
    assert (got.top_p, got.temperature) == (0.5, 0.7)  # the override, over the checkpoint's defaults
    plain = FrontendArgs(engine=["ipc:///x"], listen_fd=3)
    assert _defaults(build_attached_engine(plain, client).model_config).top_p == SamplingParams().top_p
    with pytest.raises(ValueError, match="--override-generation-config"):  # no frontend would apply it
        serve_config_from(parser.parse_args([*argv, "--headless"]))


def test_api_server_attached_to_a_running_core_refuses_the_override(weightless):
    from vllm_lite.entrypoints.openai.cli_args import check_api_server_args

    args = _parse(["--engine", "tcp://127.0.0.1:1", "--override-generation-config", '{"top_p": 0.5}'])
    with pytest.raises(ValueError, match="--override-generation-config"):
        check_api_server_args(args)


@pytest.mark.parametrize(
    "value, match",
    [
        ({"temprature": 0.5}, "unknown key"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 2.0}, "top_p"),
        ([("temperature", 0.5)], "dict"),
    ],
)
def test_bad_override_generation_config_is_a_value_error(value, match, weightless):
    with pytest.raises(ValueError, match=match) as e:
        EngineArgs(model=weightless, override_generation_config=value).create_engine_config()
    assert "override_generation_config" in str(e.value)


@pytest.mark.parametrize("text", ["temperature=0.5", "[1, 2]"])
def test_override_generation_config_flag_takes_a_json_object(text, weightless, capsys):
    with pytest.raises(SystemExit):
        _parse(["--model", weightless, "--override-generation-config", text])
    assert "JSON object" in capsys.readouterr().err
