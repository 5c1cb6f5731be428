"""The issue's crash, end to end: ADDs with out-of-vocabulary ids sent straight to a core process.

Before, an ADD whose logit_bias, allowed_token_ids or bad-words ids were out of
vocabulary passed the core and killed it inside the next step ("Fatal error in
the engine core busy loop"). Here a frontend skips its own Processor and sends
such ADDs over the socket beside a normal request: each hostile one gets an
error output naming its field, the normal one finishes, and the core stays up
with every block free. (Values that SamplingParams itself rejects never get this
far: they fail to decode, which is the socket loop's business, not this test's.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_lite.client.core_client import EngineCoreClient, make_client
from vllm_lite.core.messages import FinishReason
from vllm_lite.engine_args import EngineArgs
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.core_harness import TINY_MAX_MODEL_LEN, Result, make_request, unique_id

DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def client() -> Iterator[EngineCoreClient]:
    cfg = EngineArgs(
        model=get_checkpoint("llama"),
        device="cpu",
        max_model_len=TINY_MAX_MODEL_LEN,
        block_size=8,
        kv_cache_memory_bytes=1 << 20,
    ).create_engine_config()
    c = make_client(cfg, multiprocess=True, asyncio_mode=False)
    yield c
    c.shutdown()


def _collect(client: EngineCoreClient, ids: set[str]) -> dict[str, Result]:
    results: dict[str, Result] = {}
    deadline = time.monotonic() + DEADLINE_S
    while not ids <= {rid for rid, r in results.items() if r.finish_reason is not None}:
        assert time.monotonic() < deadline, f"no answer for {ids - set(results)} within {DEADLINE_S} s"
        try:
            outs = client.get_output(timeout=1.0)  # type: ignore[call-arg]  # raises EngineDeadError if it died
        except TimeoutError:
            continue
        for out in outs.outputs:
            res = results.setdefault(out.request_id, Result())
            res.token_ids.extend(out.new_token_ids)
            res.finish_reason = out.finish_reason
            res.error = out.error
    return results


@pytest.mark.parametrize(
    "field,value",
    [
        ("logit_bias", {10**6: 5.0}),
        ("allowed_token_ids", [3, 2**40]),
        ("_bad_words_token_ids", [[4, 99_999]]),
        ("logprobs", 21),
        ("n", 10**6),
    ],
)
def test_a_hostile_add_gets_an_error_and_the_core_keeps_serving(
    client: EngineCoreClient, field: str, value: Any
) -> None:
    hostile = SamplingParams(temperature=0.0, max_tokens=4)
    setattr(hostile, field, value)  # after construction: what a client bypassing its own checks sends
    bad_id, good_id = unique_id("hostile"), unique_id("good")
    client.add_request(make_request(bad_id, [5, 6, 7], hostile))
    client.add_request(make_request(good_id, [8, 9, 10]))
    results = _collect(client, {bad_id, good_id})
    print(f"\n[wire {field}] hostile -> {results[bad_id].finish_reason}: {results[bad_id].error}")
    assert results[bad_id].finish_reason == FinishReason.ERROR
    assert field.lstrip("_") in (results[bad_id].error or "")
    assert results[good_id].finish_reason == FinishReason.LENGTH and len(results[good_id].token_ids) == 4
    assert client.call_utility("get_num_unfinished_requests") == 0
    assert client.call_utility("get_num_free_blocks") == client.call_utility("get_num_total_blocks")
