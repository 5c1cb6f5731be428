"""`vllm-lite generate PROMPT`: complete one prompt, streaming the text to stdout."""

from __future__ import annotations

import argparse
import sys

from vllm_lite.entrypoints.cli.engine_args import (
    add_engine_args,
    build_engine,
    vllm_lite_log_level,
)
from vllm_lite.entrypoints.cli.sampling_args import (
    add_sampling_args,
    sampling_params_from,
)
from vllm_lite.entrypoints.cli.types import CLISubcommand


class GenerateCommand(CLISubcommand):
    name = "generate"
    help = "Complete a prompt and print the text (streamed as it is generated)."

    def add_parser(self, subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
        p = subparsers.add_parser(
            self.name,
            help=self.help,
            description=self.help,
            epilog='example: vllm-lite generate "The for statement" --max-tokens 32 --temperature 0',
        )
        p.add_argument("prompt", help="Prompt text; '-' reads it from stdin.")
        p.add_argument(
            "--stream",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="Print tokens as they arrive (--no-stream: print the whole completion at the end).",
        )
        p.add_argument("--echo", action="store_true", help="Print the prompt before the completion.")
        p.add_argument("--verbose", "-v", action="store_true", help="Print token count and speed to stderr.")
        add_sampling_args(p, default_max_tokens=64)
        add_engine_args(p, exclude=("seed",), multiprocess=True, log_level="warning")  # --seed: sampling
        return p

    def run(self, args: argparse.Namespace) -> int:
        with vllm_lite_log_level(args.log_level):
            return self._generate(args)

    def _generate(self, args: argparse.Namespace) -> int:
        from vllm_lite.entrypoints.cli.streaming import stream_request
        from vllm_lite.sampling_params import RequestOutputKind

        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        if not prompt:
            raise ValueError("prompt is empty: pass some text (or '-' with text on stdin).")
        kind = RequestOutputKind.DELTA if args.stream else RequestOutputKind.FINAL_ONLY
        sampling_params_from(args, None, kind)  # bad flags fail before the engine starts
        engine = build_engine(args)
        try:
            params = sampling_params_from(args, engine.processor.get_default_sampling_params(), kind)
            out = sys.stdout
            if args.echo:
                out.write(prompt)
                out.flush()
            result = stream_request(engine, "generate-0", prompt, params, out)
            if not result.text.endswith("\n"):
                out.write("\n")
            out.flush()
        finally:
            engine.shutdown()
        if args.verbose:
            ttft = f"{result.first_token_seconds * 1000:.0f} ms" if result.first_token_seconds is not None else "n/a"
            print(
                f"[{result.num_tokens} tokens in {result.seconds:.2f} s, {result.tokens_per_second:.1f} tok/s, "
                f"first token {ttft}, finish: {result.finish_reason}]",
                file=sys.stderr,
            )
        return 0
