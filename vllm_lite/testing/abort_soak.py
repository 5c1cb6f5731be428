"""Many HTTP streams, each cancelled by the client at a random point: nothing may be left in the core."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import httpx


async def _one(client: httpx.AsyncClient, url: str, body: dict, chunks: int, counts: Counter) -> None:
    """Read ``chunks`` SSE lines (0: cancel before the first byte), then drop the connection."""
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            counts[f"status-{resp.status_code}"] += 1
            return
        if chunks == 0:
            counts["cancelled-before-reading"] += 1
            return
        seen = 0
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if line == "data: [DONE]":
                    counts["finished-before-cancel"] += 1
                    return
                if seen >= chunks:
                    counts["cancelled-mid-stream"] += 1
                    return


async def _soak(base_url: str, streams: int, concurrency: int, seed: int) -> Counter:
    rng = random.Random(seed)
    counts: Counter = Counter()
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120.0) as client:

        async def run(i: int) -> None:
            chat = rng.random() < 0.5
            body: dict = {
                "max_tokens": 400,
                "temperature": 1.0,
                "ignore_eos": True,
                "stream": True,
                "n": rng.choice([1, 2]),
            }
            if chat:
                url, body["messages"] = base_url + "/v1/chat/completions", [{"role": "user", "content": f"hi {i}"}]
            else:
                url, body["prompt"] = base_url + "/v1/completions", f"The for statement {i}"
            chunks = rng.choice([0, 1, 2, 5, 20])
            async with limit:
                await _one(client, url, body, chunks, counts)

        await asyncio.gather(*(run(i) for i in range(streams)))
    return counts


def abort_soak(base_url: str, streams: int, concurrency: int = 8, seed: int = 0) -> Counter:
    """Open ``streams`` streaming requests (completions and chat, n 1 or 2), cancel each; counts by outcome."""
    return asyncio.run(_soak(base_url, streams, concurrency, seed))
