"""`vllm-lite serve` as a child process for tests: its start-up lines say where the core and the API listen."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
from typing import Any

from vllm_lite.testing.waiting import wait_until


class ServeProcess:
    """`vllm-lite serve ARGS` as a child; pass --port 0 --core-port 0 and read the ports from its start-up lines."""

    def __init__(self, args: list[str], env: dict[str, str], stderr: Any = subprocess.STDOUT) -> None:
        """`stderr`: where the child's stderr goes (default: merged into the stdout lines read here)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_lite.entrypoints.cli", "serve", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def line_with(self, needle: str, timeout_s: float = 300.0) -> str:
        found: list[str] = []

        def look() -> bool:
            while not self.lines.empty():
                line = self.lines.get_nowait()
                self.seen.append(line)
                if needle in line:
                    found.append(line)
                    return True
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode}:\n" + self.diagnostics())
            return False

        wait_until(look, timeout_s, f"a line with {needle!r}", interval_s=0.05)
        return found[0]

    def diagnostics(self) -> str:
        """What a failure message shows of the child: the stdout lines read so far."""
        return "\n".join(self.seen)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def api_base(self) -> str:
        """The HTTP API's base URL from the start-up line."""
        return self.line_with("vllm-lite OpenAI API on").split(" OpenAI API on ", 1)[1].split(" ", 1)[0]

    def core_address(self) -> str:
        """The (first) engine core's ZMQ address from the start-up line."""
        return self.line_with("vllm-lite engine core").split(" listening on ", 1)[1].split(" ", 1)[0]
