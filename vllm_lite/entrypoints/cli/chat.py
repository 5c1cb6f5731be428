"""`vllm-lite chat`: a terminal chat loop using the tokenizer's chat template.

Reads one user message per line from stdin, streams the reply, keeps the
conversation as context (oldest turns dropped when it no longer fits).
Ends on EOF or /exit; /reset forgets the conversation.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, TextIO

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

EXIT_COMMANDS = ("/exit", "/quit")
RESET_COMMAND = "/reset"


class ChatSession:
    """Conversation state and prompt building; knows nothing about the terminal."""

    def __init__(self, tokenizer: Any, max_model_len: int, max_tokens: int, system: Optional[str] = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat_template; use `vllm-lite generate` instead.")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        self.system = system
        self.turns: list[dict[str, str]] = []

    def reset(self) -> None:
        self.turns.clear()

    def _render(self, turns: list[dict[str, str]]) -> str:
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + turns
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompt_for(self, user_text: str) -> str:
        """The templated prompt for the conversation plus this message, oldest turns dropped to fit."""
        turns = self.turns + [{"role": "user", "content": user_text}]
        budget = self.max_model_len - self.max_tokens
        while True:
            text = self._render(turns)
            n = len(self.tokenizer.encode(text, add_special_tokens=True))
            if n <= budget or len(turns) == 1:
                break
            turns = turns[2:] if len(turns) > 2 else turns[-1:]
        if n > budget:
            raise ValueError(
                f"message too long: {n} prompt tokens, but max_model_len={self.max_model_len} minus "
                f"max_tokens={self.max_tokens} leaves {budget}."
            )
        self.turns = turns[:-1]
        return text

    def record(self, user_text: str, reply: str) -> None:
        self.turns += [{"role": "user", "content": user_text}, {"role": "assistant", "content": reply.strip()}]


def chat_loop(
    engine: Any,
    session: ChatSession,
    params: Any,
    inp: TextIO,
    out: TextIO,
    interactive: bool,
    err: Optional[TextIO] = None,
) -> int:
    """Read, generate, stream, repeat; returns the number of replies given.

    A message that cannot be served (too long, rejected by the engine) is reported
    on `err` and the conversation goes on; a dead engine ends it.
    """
    from vllm_lite.entrypoints.cli.streaming import RequestFailedError, stream_request

    err = err or sys.stderr

    replies = 0
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        line = inp.readline()
        if not line:  # EOF
            if interactive:
                out.write("\n")
            return replies
        text = line.strip()
        if not text:
            continue
        if text in EXIT_COMMANDS:
            return replies
        if text == RESET_COMMAND:
            session.reset()
            out.write("(conversation reset)\n")
            continue
        try:
            prompt = session.prompt_for(text)
            result = stream_request(engine, f"chat-{replies}", prompt, params, out)
        except (ValueError, RequestFailedError) as e:
            out.flush()
            err.write(f"error: {e}\n")
            err.flush()
            continue
        out.write("\n")
        out.flush()
        session.record(text, result.text)
        replies += 1


class ChatCommand(CLISubcommand):
    name = "chat"
    help = "Chat in the terminal: one message per line, replies streamed; /exit or EOF ends, /reset forgets."

    def add_parser(self, subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
        p = subparsers.add_parser(self.name, help=self.help, description=self.help)
        p.add_argument("--system", default=None, help="A system message to start the conversation with.")
        add_sampling_args(p, default_max_tokens=128)
        add_engine_args(p, exclude=("seed",), multiprocess=True, log_level="warning")  # --seed: sampling
        return p

    def run(self, args: argparse.Namespace) -> int:
        with vllm_lite_log_level(args.log_level):
            return self._chat(args)

    def _chat(self, args: argparse.Namespace) -> int:
        from vllm_lite.sampling_params import RequestOutputKind

        sampling_params_from(args, None, RequestOutputKind.DELTA)  # bad flags fail before the engine starts
        engine = build_engine(args)
        try:
            params = sampling_params_from(args, engine.processor.get_default_sampling_params(), RequestOutputKind.DELTA)
            session = ChatSession(
                engine.get_tokenizer(), engine.vllm_config.model_config.max_model_len, args.max_tokens, args.system
            )
            interactive = sys.stdin.isatty()
            if interactive:
                print("vllm-lite chat: type a message; /reset forgets, /exit or Ctrl-D quits.", file=sys.stderr)
            chat_loop(engine, session, params, sys.stdin, sys.stdout, interactive)
        finally:
            engine.shutdown()
        return 0
