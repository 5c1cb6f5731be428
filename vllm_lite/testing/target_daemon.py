"""A `vllm-lite serve` under attack: its processes, a real client beside the attacker, and leak checks.

Used by the reliability tests and ``benchmarks/soak.py``. The daemon serves the tiny Llama
(float32, one thread) with an auth token and a 600 s heartbeat timeout, so that only the
hardening under test (socket disconnects, process watches) can explain a prompt reaction.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

import httpx

from vllm_lite.client.exceptions import EngineDeadError
from vllm_lite.endpoints import CoreAddresses
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.processes import children, launched_as
from vllm_lite.testing.serve_process import ServeProcess
from vllm_lite.testing.waiting import wait_until

TOKEN = "reliability-token"
HUGE_S = 600.0  # no heartbeat timeout can fire within a test
MAX_MODEL_LEN = 1024


class TargetDaemon(ServeProcess):
    """`vllm-lite serve` (HTTP unless ``headless``) with its stderr in a log file."""

    def __init__(
        self,
        extra_args: Optional[list[str]] = None,
        headless: bool = False,
        token: str = TOKEN,
        startup_timeout_s: float = 300.0,
    ) -> None:
        self.token = token
        fd, self.log_path = tempfile.mkstemp(prefix="vlt-target-", suffix=".log")
        self._log = os.fdopen(fd, "w")
        args = [
            get_checkpoint("llama"),
            "--core-port",
            "0",
            "--auth-token",
            token,
            "--heartbeat-timeout",
            str(HUGE_S),
            "--num-threads",
            "1",
            "--dtype",
            "float32",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes",
            str(4 << 20),
            "--shutdown-timeout",
            "5",
            *(["--headless"] if headless else ["--port", "0"]),
            *(extra_args or []),
        ]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        super().__init__(args, env, stderr=self._log)
        self._probe: Any = None
        try:
            line = self.line_with("vllm-lite engine core listening on", startup_timeout_s)
            self.address = line.split(" listening on ", 1)[1].split(" ", 1)[0]
            self.core_pid = int(line.rsplit("pid ", 1)[1].rstrip(")"))
            self.base_url = None if headless else self.api_base()
        except BaseException:
            self.stop()
            raise

    @property
    def addresses(self) -> CoreAddresses:
        return CoreAddresses.from_base(self.address)

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def diagnostics(self) -> str:
        return super().diagnostics() + "\n--- stderr (last 4000 chars) ---\n" + self.log()[-4000:]

    def frontend_pids(self) -> list[int]:
        return [p for p in children(self.proc.pid) if launched_as(p, "vllm_lite.entrypoints.serve_frontend", "http-")]

    # ------------------------------------------------------------------ a real client beside the attackers
    @property
    def probe(self) -> Any:
        """An `LLM` attached to the core from this process (tokenizer and all): the honest tenant."""
        if self._probe is None:
            from vllm_lite import LLM

            self._probe = LLM(engine_address=self.address, auth_token=self.token)
        return self._probe

    def utility(self, method: str, *args: Any) -> Any:
        return self.probe.llm_engine.call_utility(method, *args)

    def blocks(self) -> tuple[int, int, int]:
        """(unfinished requests, free blocks, total blocks) in the core."""
        return (
            self.utility("get_num_unfinished_requests"),
            self.utility("get_num_free_blocks"),
            self.utility("get_num_total_blocks"),
        )

    def wait_clean(self, timeout_s: float = 120.0) -> float:
        """Wait until no request is left and every block is free; seconds it took."""
        start = time.monotonic()
        last: list[Any] = [None]

        def clean() -> bool:
            last[0] = self.blocks()
            unfinished, free, total = last[0]
            return unfinished == 0 and free == total

        try:
            wait_until(clean, timeout_s, "no request left and every KV block free", interval_s=0.05)
        except TimeoutError as e:
            raise AssertionError(f"{e}: (unfinished, free, total) = {last[0]}") from None
        return time.monotonic() - start

    def assert_serves(self, max_tokens: int = 4) -> None:
        """The honest tenant still gets its tokens, and /health says 200 where there is HTTP."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = self.probe.generate("The for statement", params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == max_tokens and out.finish_reason == "length", out
        if self.base_url is not None:
            assert httpx.get(self.base_url + "/health", timeout=60).status_code == 200

    def stop(self) -> None:
        if self._probe is not None:
            try:
                self._probe.shutdown()
            except Exception:  # noqa: BLE001 -- the core may be dead on purpose
                pass
            self._probe = None
        super().stop()
        self._log.close()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass


def rss_mb(pid: int) -> float:
    """Resident set size of a process, in MB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


# A frontend in its own process (no tokenizer: a bare core client): attaches, starts long requests,
# prints "running" once they stream, waits to be killed.
DOOMED_FRONTEND = r"""
import sys
from vllm_lite.client.sync_mp_client import SyncMPClient
from vllm_lite.core.messages import EngineCoreRequest
from vllm_lite.endpoints import CoreAddresses
from vllm_lite.sampling_params import SamplingParams

client = SyncMPClient(addresses=CoreAddresses.from_base(sys.argv[1]), auth_token=sys.argv[2], client_name="doomed")
params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
for i in range(int(sys.argv[3])):
    client.add_request(EngineCoreRequest(f"doomed-{i}", [5, 6, 7, i], params, None, 0.0))
client.get_output(timeout=120)
print("running", flush=True)
sys.stdin.read()
"""


def start_doomed_frontend(daemon: TargetDaemon, num_requests: int = 4) -> subprocess.Popen:
    """A separate attached frontend whose requests are running when this returns."""
    child = subprocess.Popen(
        [sys.executable, "-c", DOOMED_FRONTEND, daemon.address, daemon.token, str(num_requests)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    if line != "running":
        child.kill()
        raise AssertionError(f"the doomed frontend did not start (exit {child.wait()}): {line!r}")
    return child


def stream_sse(url: str, body: dict, events: list[str], streaming: threading.Event, timeout_s: float = 60.0) -> None:
    """POST ``body`` as a stream; every non-empty line (and first the status) into ``events``; set ``streaming``."""
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=timeout_s) as r:
        events.append(f"status {r.status_code}")
        for line in r.iter_lines():
            if line:
                events.append(line)
                streaming.set()


def generate_until_death(llm: Any, result: dict[str, Any], running: threading.Event) -> None:
    """Run a long request on an attached LLM; note when EngineDeadError came (``result["dead_at"]``)."""
    try:
        engine = llm.llm_engine
        engine.add_request("long", "Hello", SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True))
        while engine.has_unfinished_requests():
            if any(o.outputs[0].token_ids for o in engine.step()):
                running.set()
        result["finished"] = True
    except EngineDeadError as e:
        result["dead_at"] = time.monotonic()
        result["error"] = str(e)
    finally:
        running.set()
