"""Sampling flags: anything left unset falls back to the model's generation_config defaults."""

from __future__ import annotations

import argparse
from typing import Any

# CLI dest -> SamplingParams field.
_FLAG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


def add_sampling_args(parser: argparse.ArgumentParser, default_max_tokens: int) -> None:
    g = parser.add_argument_group("sampling (unset: the model's generation_config, else vLLM's defaults)")
    g.add_argument(
        "--max-tokens",
        "-n",
        type=int,
        default=default_max_tokens,
        help=f"Most tokens to generate (default {default_max_tokens}).",
    )
    g.add_argument("--temperature", "-t", type=float, default=None, help="0 is greedy.")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None, help="0 or -1 disables.")
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--frequency-penalty", type=float, default=None)
    g.add_argument("--seed", type=int, default=None, help="Seed for sampling (and the engine).")
    g.add_argument("--stop", action="append", default=None, metavar="STRING", help="Stop at this string (repeatable).")
    g.add_argument("--ignore-eos", action="store_true", help="Keep generating past the end-of-text token.")


def sampling_params_from(args: argparse.Namespace, defaults: Any, output_kind: Any) -> Any:
    """SamplingParams from the flags over `defaults` (the model's recommended params).

    Validation is SamplingParams' own: a bad value raises ValueError naming the field.
    """
    from vllm_lite.sampling_params import SamplingParams

    kwargs: dict[str, Any] = {}
    for dest, field in _FLAG_FIELDS.items():
        value = getattr(args, dest, None)
        if value is None and defaults is not None:
            value = getattr(defaults, field, None)
        if value is not None:
            kwargs[field] = value
    return SamplingParams(
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=list(args.stop) if args.stop else None,
        ignore_eos=bool(args.ignore_eos),
        output_kind=output_kind,
        **kwargs,
    )
