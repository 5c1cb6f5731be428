"""Engine flags generated from EngineArgs: one flag, one default and one help text per field.

Every subcommand that builds an engine takes the same generated flags; parsing them gives
the EngineArgs a direct construction gives.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from vllm_lite.cli_flags import field_default, flag_name, flag_specs
from vllm_lite.default_model import DEFAULT_MODEL_NAME, default_model_path
from vllm_lite.engine_args import EngineArgs
from vllm_lite.entrypoints.cli import build_parser
from vllm_lite.entrypoints.cli.engine_args import engine_args_from
from vllm_lite.entrypoints.openai.cli_args import (
    check_api_server_args,
    engine_args_from_cli,
)

FIELDS = dataclasses.fields(EngineArgs)


def engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    return p


def options_of(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def subparser(name: str) -> argparse.ArgumentParser:
    parser, _ = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_every_field_has_a_flag_and_a_help_text():
    options = options_of(engine_parser())
    specs = {s.name: s for s in flag_specs(EngineArgs)}
    for f in FIELDS:
        assert flag_name(f.name) in options, f"EngineArgs.{f.name} has no flag"
        assert specs[f.name].kwargs["help"].strip(), f"EngineArgs.{f.name} has no help text (field metadata 'help')"


def test_parsed_defaults_equal_the_dataclass_defaults():
    ns = engine_parser().parse_args([])
    for f in FIELDS:
        default = field_default(f)
        want = None if default is dataclasses.MISSING else default
        assert getattr(ns, f.name) == want, f.name


def test_bool_fields_round_trip_through_x_and_no_x():
    p = engine_parser()
    assert p.parse_args([]).enable_prefix_caching is True
    assert p.parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert p.parse_args(["--no-enable-prefix-caching", "--enable-prefix-caching"]).enable_prefix_caching is True


def test_optional_and_numeric_types_are_parsed():
    ns = engine_parser().parse_args(["--max-model-len", "128", "--swap-space", "0.5", "--tokenizer", "/t"])
    assert ns.max_model_len == 128 and isinstance(ns.max_model_len, int)
    assert ns.swap_space == 0.5 and ns.tokenizer == "/t"
    assert engine_parser().parse_args([]).max_model_len is None


@pytest.mark.parametrize(
    "flags",
    [
        ["--preemption-mode", "sometimes"],
        ["--scheduling-policy", "random"],
        ["--dtype", "int8"],
        ["--device", "gpu"],
        ["--max-num-seqs", "many"],
    ],
)
def test_values_outside_a_fields_fixed_set_or_type_are_rejected(flags, capsys):
    with pytest.raises(SystemExit) as e:
        engine_parser().parse_args(flags)
    assert e.value.code == 2 and flags[0] in capsys.readouterr().err


def test_device_accepts_auto_cpu_cuda_and_cuda_n():
    for d in ("auto", "cpu", "cuda", "cuda:3"):
        assert engine_parser().parse_args(["--device", d]).device == d


def test_parsing_gives_what_direct_construction_gives():
    argv = [
        "--model",
        "/m",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--block-size",
        "32",
        "--kv-cache-memory-bytes",
        "1048576",
        "--no-enable-prefix-caching",
        "--swap-space",
        "2",
        "--preemption-mode",
        "swap",
        "--max-num-batched-tokens",
        "512",
        "--max-num-seqs",
        "4",
        "--long-prefill-token-threshold",
        "64",
        "--scheduling-policy",
        "priority",
        "--num-threads",
        "1",
        "-tp",
        "2",
        "-dp",
        "3",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "29500",
        "--seed",
        "7",
        "--device",
        "cpu",
        "--served-model-name",
        "a",
        "b",
    ]
    got = EngineArgs.from_cli_args(engine_parser().parse_args(argv))
    want = EngineArgs(
        model="/m",
        dtype="float32",
        max_model_len=256,
        block_size=32,
        kv_cache_memory_bytes=1 << 20,
        enable_prefix_caching=False,
        swap_space=2.0,
        preemption_mode="swap",
        max_num_batched_tokens=512,
        max_num_seqs=4,
        long_prefill_token_threshold=64,
        scheduling_policy="priority",
        num_threads=1,
        tensor_parallel_size=2,
        data_parallel_size=3,
        nnodes=2,
        node_rank=0,
        master_addr="10.0.0.1",
        master_port=29500,
        seed=7,
        device="cpu",
        served_model_name="a",
    )
    assert got == want


def test_no_model_means_the_bundled_default_model():
    ea = EngineArgs.from_cli_args(engine_parser().parse_args([]))
    assert ea == EngineArgs(model=default_model_path(), served_model_name=DEFAULT_MODEL_NAME)


@pytest.mark.parametrize("name", ["generate", "chat", "serve", "api-server"])
def test_every_engine_subcommand_takes_every_engine_flag(name):
    options = options_of(subparser(name))
    positional = {a.dest for a in subparser(name)._actions if not a.option_strings}
    for f in FIELDS:
        assert flag_name(f.name) in options or f.name in positional, f"{name} lacks {flag_name(f.name)}"


def test_readme_engine_flag_spellings_keep_their_meaning():
    argv = [
        "chat",
        "--dtype",
        "float32",
        "--max-model-len",
        "64",
        "--block-size",
        "8",
        "--kv-cache-memory-bytes",
        "4096",
        "--no-enable-prefix-caching",
        "--preemption-mode",
        "swap",
        "--swap-space",
        "0.25",
        "--max-num-batched-tokens",
        "100",
        "--max-num-seqs",
        "3",
        "--long-prefill-token-threshold",
        "16",
        "--scheduling-policy",
        "priority",
        "--num-threads",
        "2",
        "-tp",
        "2",
        "-dp",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "h",
        "--master-port",
        "9",
    ]
    parser, _ = build_parser()
    ea = engine_args_from(parser.parse_args(argv))
    assert (ea.dtype, ea.max_model_len, ea.block_size, ea.kv_cache_memory_bytes) == ("float32", 64, 8, 4096)
    assert (ea.enable_prefix_caching, ea.preemption_mode, ea.swap_space) == (False, "swap", 0.25)
    assert (ea.max_num_batched_tokens, ea.max_num_seqs, ea.long_prefill_token_threshold) == (100, 3, 16)
    assert (ea.scheduling_policy, ea.num_threads) == ("priority", 2)
    assert (ea.tensor_parallel_size, ea.data_parallel_size, ea.nnodes, ea.node_rank) == (2, 2, 2, 0)
    assert (ea.master_addr, ea.master_port) == ("h", 9)


def test_generate_seed_seeds_sampling_and_engine_and_unset_keeps_the_engine_default():
    parser, _ = build_parser()
    assert engine_args_from(parser.parse_args(["generate", "p", "--seed", "5"])).seed == 5
    args = parser.parse_args(["generate", "p"])
    assert args.seed is None and engine_args_from(args).seed == field_default(EngineArgs.__dataclass_fields__["seed"])


def test_serve_takes_model_as_a_positional_and_served_names_for_http():
    from vllm_lite.entrypoints.cli.serve import serve_config_from

    parser, _ = build_parser()
    cfg = serve_config_from(
        parser.parse_args(["serve", "/ckpt", "-dp", "2", "--served-model-name", "x", "y", "--max-model-len", "64"])
    )
    assert (cfg.engine_args.model, cfg.engine_args.served_model_name, cfg.engine_args.max_model_len) == (
        "/ckpt",
        "x",
        64,
    )
    assert cfg.data_parallel_size == cfg.engine_args.data_parallel_size == 2
    assert cfg.served_model_names == ["x", "y"]


def test_worker_takes_the_generated_parallel_flags_with_node_defaults():
    p = subparser("worker")
    options = options_of(p)
    assert {"--tensor-parallel-size", "-tp", "--nnodes", "--node-rank", "--master-addr", "--master-port"} <= options
    assert "--dtype" not in options
    ns = p.parse_args(["--nnodes", "2", "--master-port", "29500"])
    assert (ns.tensor_parallel_size, ns.node_rank, ns.master_port) == (None, 1, 29500)


def test_api_server_model_xor_engine_and_no_ignored_engine_flags_with_engine():
    parser, _ = build_parser()
    args = parser.parse_args(["api-server", "--model", "/m", "--max-model-len", "64", "--served-model-name", "a", "b"])
    check_api_server_args(args)
    ea = engine_args_from_cli(args)
    assert (ea.model, ea.max_model_len, ea.served_model_name) == ("/m", 64, "a")
    check_api_server_args(parser.parse_args(["api-server", "--engine", "tcp://127.0.0.1:1", "-dp", "2"]))
    with pytest.raises(ValueError, match="--max-model-len"):
        check_api_server_args(parser.parse_args(["api-server", "--engine", "tcp://h:1", "--max-model-len", "64"]))
    with pytest.raises(ValueError, match="--model"):
        check_api_server_args(parser.parse_args(["api-server"]))
    with pytest.raises(ValueError, match="only one"):
        check_api_server_args(parser.parse_args(["api-server", "--model", "/m", "--engine", "tcp://h:1"]))


def test_a_new_field_gets_a_flag_with_nothing_else_written():
    @dataclasses.dataclass
    class Args(EngineArgs):
        gpu_fraction_for_test: float = dataclasses.field(default=0.5, metadata={"help": "A new knob."})
        flag_for_test: bool = dataclasses.field(default=False, metadata={"help": "A new switch."})

    p = argparse.ArgumentParser()
    Args.add_cli_args(p)
    ns = p.parse_args(["--model", "/m", "--gpu-fraction-for-test", "0.25", "--flag-for-test"])
    got = Args.from_cli_args(ns)
    assert isinstance(got, Args) and (got.gpu_fraction_for_test, got.flag_for_test) == (0.25, True)


def test_engine_args_reject_bad_sizes_with_the_field_named():
    from vllm_lite.testing.checkpoints import get_checkpoint

    ckpt = get_checkpoint("llama")
    for kw, name in (({"max_model_len": 1}, "max_model_len"), ({"num_threads": 0}, "num_threads")):
        with pytest.raises(ValueError, match=name):
            EngineArgs(model=ckpt, device="cpu", **kw).create_engine_config()
