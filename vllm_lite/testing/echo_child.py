"""A minimal child for launcher tests: ``python -m vllm_lite.testing.echo_child``.

It answers ``EchoReady`` with what it was given and saw (its arguments, log level, environment),
or fails at start-up on request; then it stays up until stopped, appending every control it
hears to a file, optionally ignoring SIGTERM (so the launcher must kill it).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Optional

import msgspec

from vllm_lite.launcher_child import ChildChannel, Control, run_child

ECHO_MODULE = "vllm_lite.testing.echo_child"


class EchoArgs(msgspec.Struct, kw_only=True):
    value: str
    fail_with: Optional[str] = None  # raise ValueError(fail_with) before answering
    ignore_sigterm: bool = False
    control_log: Optional[str] = None  # append each Control's kind here
    exit_before_ready: Optional[int] = None  # die with this code without answering


class EchoReady(msgspec.Struct, kw_only=True):
    value: str
    pid: int
    parent_pid: int
    log_level: str
    env: dict[str, str]


def _fail_at_startup(message: str) -> None:
    raise ValueError(message)


def _main(args: EchoArgs, channel: ChildChannel) -> int:
    if args.exit_before_ready is not None:
        os._exit(args.exit_before_ready)
    if args.fail_with is not None:
        _fail_at_startup(args.fail_with)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.control_log is not None:
        path = args.control_log

        def record(message: Control) -> None:
            with open(path, "a") as f:
                f.write(f"{message.kind}:{message.data}\n")

        channel.on_control(record)
    level = logging.getLevelName(logging.getLogger("vllm_lite").getEffectiveLevel())
    env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_LITE_") or k.startswith("ECHO_")}
    channel.ready(EchoReady(value=args.value, pid=os.getpid(), parent_pid=channel.parent_pid, log_level=level, env=env))
    threading.Event().wait()  # until a signal, or the parent's death, ends the process
    return 0


if __name__ == "__main__":
    run_child(EchoArgs, _main)
