"""Engine flags, defined once for every subcommand (generate, chat, serve, api-server), and EngineArgs from them."""

from __future__ import annotations

import argparse
from typing import Any

from vllm_lite.entrypoints.cli.parallel_args import add_parallel_args, parallel_kwargs_from

# (flag, argparse keyword arguments); dest names equal EngineArgs field names.
_ENGINE_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--tokenizer", dict(default=None, help="Tokenizer directory (default: the model's).")),
    ("--dtype", dict(default="auto", help="auto, bfloat16 or float32 (float16 becomes bfloat16 on CPU).")),
    ("--device", dict(default="auto", help="auto, cpu or cuda[:N].")),
    ("--max-model-len", dict(type=int, default=None, help="Context length (default: the model's).")),
    ("--block-size", dict(type=int, default=16, help="Tokens per KV-cache block.")),
    ("--kv-cache-memory-bytes", dict(type=int, default=None, help="KV cache size (default: per device).")),
    ("--enable-prefix-caching", dict(action=argparse.BooleanOptionalAction, default=True,
                                     help="Reuse KV blocks of shared prompt prefixes.")),
    ("--preemption-mode", dict(default="recompute", choices=["recompute", "swap"],
                               help="When KV blocks run out: drop and re-prefill, or swap blocks to host memory.")),
    ("--swap-space", dict(type=float, default=1.0, help="GiB of host memory for swapped-out KV blocks.")),
    ("--max-num-batched-tokens", dict(type=int, default=None, help="Token budget per engine step.")),
    ("--max-num-seqs", dict(type=int, default=128, help="Requests running at once.")),
    ("--long-prefill-token-threshold", dict(type=int, default=0,
                                            help="Cap on one prompt's tokens per step (0: no cap).")),
    ("--scheduling-policy", dict(default="fcfs", choices=["fcfs", "priority"])),
    ("--num-threads", dict(type=int, default=None,
                           help="Torch threads per engine core (default: all cores but one on CPU).")),
]


def add_engine_args(
    parser: argparse.ArgumentParser, *, model_option: bool = True, seed: bool = False, multiprocess: bool = True
) -> None:
    """Add every engine flag. `model_option`: --model/-m (else the caller adds a positional MODEL);
    `seed`: --seed here (generate/chat take it with the sampling flags); `multiprocess`: --[no-]multiprocess."""
    g = parser.add_argument_group("engine")
    if model_option:
        g.add_argument("--model", "-m", default=None,
                       help="Local checkpoint directory (default: the bundled vllm-lite model, no download).")
    if seed:
        g.add_argument("--seed", type=int, default=0, help="Engine seed.")
    for flag, kwargs in _ENGINE_FLAGS:
        g.add_argument(flag, **kwargs)
    if multiprocess:
        g.add_argument("--multiprocess", action=argparse.BooleanOptionalAction, default=True,
                       help="Run the engine core in its own process (--no-multiprocess: in this one, for debugging).")
    add_parallel_args(parser)


def engine_kwargs_from(args: argparse.Namespace) -> dict[str, Any]:
    """EngineArgs keyword arguments for the engine flags (model excluded); ValueError on bad values."""
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be at least 2, got {args.max_model_len}.")
    if args.num_threads is not None and args.num_threads < 1:
        raise ValueError(f"--num-threads must be at least 1, got {args.num_threads}.")
    kwargs = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag, _ in _ENGINE_FLAGS}
    kwargs["seed"] = args.seed if getattr(args, "seed", None) is not None else 0
    kwargs.update(parallel_kwargs_from(args))
    return kwargs


def engine_args_from(args: argparse.Namespace) -> Any:
    """EngineArgs for the chosen (or the bundled default) model."""
    from vllm_lite.config import EngineArgs
    from vllm_lite.default_model import DEFAULT_MODEL_NAME, default_model_path

    model = args.model
    served_name = None
    if not model:
        model = default_model_path()
        served_name = DEFAULT_MODEL_NAME
    return EngineArgs(model=model, served_model_name=served_name, **engine_kwargs_from(args))


def build_engine(args: argparse.Namespace) -> Any:
    """An LLMEngine (spawns the engine core unless --no-multiprocess).

    The core's INFO lines would interleave with the streamed text in a terminal, so an
    interactive command's core logs warnings and errors only unless $VLLM_LITE_LOG_LEVEL says otherwise.
    """
    import os

    from vllm_lite.client.llm_engine import LLMEngine

    quiet = "VLLM_LITE_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ["VLLM_LITE_LOG_LEVEL"] = "WARNING"  # read by the core process as it starts
    try:
        return LLMEngine.from_engine_args(engine_args_from(args), multiprocess_mode=args.multiprocess)
    finally:
        if quiet:
            del os.environ["VLLM_LITE_LOG_LEVEL"]
