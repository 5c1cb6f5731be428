"""Engine flags shared by the interactive subcommands, and building the engine from them."""

from __future__ import annotations

import argparse
from typing import Any

from vllm_lite.entrypoints.cli.parallel_args import add_parallel_args, parallel_kwargs_from


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model", "-m", default=None,
        help="Local checkpoint directory (default: the bundled vllm-lite model, no download).",
    )
    g.add_argument("--tokenizer", default=None, help="Tokenizer directory (default: the model's).")
    g.add_argument("--dtype", default="auto", help="auto, bfloat16 or float32 (float16 becomes bfloat16 on CPU).")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N].")
    g.add_argument("--max-model-len", type=int, default=None, help="Context length (default: the model's).")
    g.add_argument("--num-threads", type=int, default=None, help="Torch threads in the engine core.")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV cache size (default: per device).")
    g.add_argument(
        "--multiprocess", action=argparse.BooleanOptionalAction, default=True,
        help="Run the engine core in its own process (--no-multiprocess: in this one, for debugging).",
    )
    add_parallel_args(parser)


def engine_args_from(args: argparse.Namespace) -> Any:
    """EngineArgs for the chosen (or the bundled default) model."""
    from vllm_lite.config import EngineArgs
    from vllm_lite.default_model import DEFAULT_MODEL_NAME, default_model_path

    model = args.model
    served_name = None
    if not model:
        model = default_model_path()
        served_name = DEFAULT_MODEL_NAME
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be at least 2, got {args.max_model_len}.")
    if args.num_threads is not None and args.num_threads < 1:
        raise ValueError(f"--num-threads must be at least 1, got {args.num_threads}.")
    return EngineArgs(
        model=model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed if args.seed is not None else 0,
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        served_model_name=served_name,
        **parallel_kwargs_from(args),
    )


def build_engine(args: argparse.Namespace) -> Any:
    """An LLMEngine (spawns the engine core unless --no-multiprocess)."""
    from vllm_lite.client.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(engine_args_from(args), multiprocess_mode=args.multiprocess)
