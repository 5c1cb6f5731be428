"""Online serving benchmark: many streaming /v1/completions requests against the HTTP server.

Either targets a running server (--base-url) or starts one (--model, a child
process on a free port). Requests arrive as a Poisson process (--request-rate,
inf = all at once) with at most --max-concurrency in flight. Reports request
and output-token throughput, TTFT, inter-token latency (ITL) and end-to-end
latency (median / p99, ms), and prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm_lite.testing.baselines import bench_json  # noqa: E402 - after HF_HUB_OFFLINE is set


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def one_request(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> Result:
    start = time.perf_counter()
    last = None
    res = Result(ok=False)
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if chunk.get("usage") and not chunk.get("choices"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
    except httpx.HTTPError as e:
        res.error = repr(e)
        return res
    res.e2e = time.perf_counter() - start
    res.ok = True
    return res


async def run_benchmark(args: argparse.Namespace, base_url: str) -> dict:
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = base_url + "/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=1000)) as client:
        models = (await client.get(base_url + "/v1/models", headers=headers)).json()
        model = models["data"][0]["id"]
        vocab_lo, vocab_hi = 10, 1000

        def body() -> dict:
            prompt = [rng.randrange(vocab_lo, vocab_hi) for _ in range(args.input_len)]
            return {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }

        # Warm up (kernels, allocator) outside the measurement.
        await one_request(client, url, {**body(), "max_tokens": 4}, headers)
        sem = asyncio.Semaphore(args.max_concurrency)

        async def limited(b: dict) -> Result:
            async with sem:
                return await one_request(client, url, b, headers)

        tasks = []
        t0 = time.perf_counter()
        for _ in range(args.num_prompts):
            tasks.append(asyncio.create_task(limited(body())))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0

    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]

    def ms(xs: list[float], q: float) -> Optional[float]:
        return round(1e3 * float(np.percentile(xs, q)), 2) if xs else None

    ttfts = [r.ttft for r in ok]
    itls = [x for r in ok for x in r.itls]
    e2es = [r.e2e for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "num_prompts": args.num_prompts,
        "completed": len(ok),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 3),
        "output_token_throughput": round(out_tokens / duration, 2),
        "ttft_ms_median": ms(ttfts, 50),
        "ttft_ms_p99": ms(ttfts, 99),
        "itl_ms_median": ms(itls, 50),
        "itl_ms_p99": ms(itls, 99),
        "e2e_ms_median": ms(e2es, 50),
        "e2e_ms_p99": ms(e2es, 99),
    }


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "vllm_lite.entrypoints.openai.api_server",
        "--model",
        args.model,
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--uvicorn-log-level",
        "warning",
    ]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    proc = subprocess.Popen(cmd)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return proc, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("server did not become healthy")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None, help="A running server; else --model starts one.")
    p.add_argument("--model", default=None, help="Checkpoint dir (default: the tiny test checkpoint).")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    proc = None
    base_url = args.base_url
    if base_url is None:
        if args.model is None:
            from vllm_lite.testing.checkpoints import get_checkpoint

            args.model = get_checkpoint("llama")
        proc, base_url = start_server(args)
    try:
        print(bench_json(asyncio.run(run_benchmark(args, base_url))))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
