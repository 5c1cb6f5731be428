"""AsyncLLM end to end: a real engine core process running a tiny random-weight Llama."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import uuid

import pytest
import torch
import zmq

from vllm_lite.client import async_llm as async_llm_module
from vllm_lite.client.async_llm import AsyncLLM
from vllm_lite.client.exceptions import EngineDeadError, EngineStartupError
from vllm_lite.core.messages import (
    PROTOCOL_VERSION,
    EngineCoreOutputType,
    EngineCoreRequestType,
    HelloRequest,
    UtilityRequest,
)
from vllm_lite.engine_args import EngineArgs
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams
from vllm_lite.serialization import MsgpackEncoder
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.waiting import async_wait_until

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

PROMPTS = [
    "The quick brown fox",
    "def main():",
    "Lists are mutable sequences",
    "import os",
    "In the beginning",
    "Exceptions are raised when",
    "for i in range(10):",
    "The with statement",
]


def engine_args(model: str) -> EngineArgs:
    return EngineArgs(
        model=model, dtype="float32", max_model_len=256, num_threads=1, kv_cache_memory_bytes=32 << 20, max_num_seqs=256
    )


def greedy(max_tokens: int, kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind, **kw)


async def collect(llm: AsyncLLM, prompt, params: SamplingParams, rid: str):
    return [out async for out in llm.generate(prompt, params, rid)]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def llm(loop):
    engine = AsyncLLM.from_engine_args(engine_args(get_checkpoint("llama")))

    async def stop() -> None:
        engine.shutdown()
        # Wait for the cancelled handler tasks to finish (a deadline, not a guess at how long they take).
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if pending:
            await asyncio.wait(pending, timeout=60)

    yield engine
    loop.run_until_complete(stop())


@pytest.fixture(scope="module")
def reference(llm, loop) -> dict[str, list[int]]:
    """Greedy 12-token continuations of PROMPTS, each run alone."""

    async def run() -> dict[str, list[int]]:
        ref = {}
        for i, p in enumerate(PROMPTS):
            outs = await collect(llm, p, greedy(12), f"ref-{i}")
            assert len(outs) == 1 and outs[0].finished
            ref[p] = outs[0].outputs[0].token_ids
        return ref

    return loop.run_until_complete(run())


def test_delta_pieces_concatenate_to_the_final_output(llm, loop, reference):
    async def run() -> None:
        prompt = PROMPTS[0]
        deltas = await collect(llm, prompt, greedy(12, RequestOutputKind.DELTA), "delta")
        cumulative = await collect(llm, prompt, greedy(12, RequestOutputKind.CUMULATIVE), "cumul")
        final = (await collect(llm, prompt, greedy(12), "final"))[-1].outputs[0]
        assert len(deltas) > 1 and all(not d.finished for d in deltas[:-1]) and deltas[-1].finished
        assert "".join(d.outputs[0].text for d in deltas) == final.text
        assert [t for d in deltas for t in d.outputs[0].token_ids] == final.token_ids == reference[prompt]
        assert cumulative[-1].outputs[0].text == final.text and cumulative[-1].outputs[0].token_ids == final.token_ids
        # Cumulative outputs grow: each is a prefix of the next.
        texts = [c.outputs[0].text for c in cumulative]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert final.finish_reason == "length"

    loop.run_until_complete(run())


def test_cancel_50_of_200_streams_frees_every_block_and_the_rest_finish(llm, loop, reference, monkeypatch):
    # Small slices: the output handler's chunked path runs too (200 outputs per step -> 6 slices).
    monkeypatch.setattr(async_llm_module, "_OUTPUT_CHUNK", 37)

    async def run() -> None:
        free_before = await llm.call_utility_async("get_num_free_blocks")
        rng = random.Random(1234)
        cancel_ids = set(rng.sample(range(200), 50))
        # Cancel after a random number of streamed outputs (0 = before the first arrives).
        cancel_after = {i: rng.randint(0, 8) for i in cancel_ids}
        seen: dict[int, int] = {i: 0 for i in range(200)}
        results: dict[int, list] = {}

        async def stream(i: int) -> None:
            outs = []
            async for out in llm.generate(PROMPTS[i % len(PROMPTS)], greedy(12, RequestOutputKind.DELTA), f"c{i}"):
                outs.append(out)
                seen[i] += 1
            results[i] = outs

        tasks = {i: asyncio.ensure_future(stream(i)) for i in range(200)}
        while any(not tasks[i].done() for i in cancel_ids):
            for i in cancel_ids:
                if not tasks[i].done() and seen[i] >= cancel_after[i]:
                    tasks[i].cancel()
            await asyncio.sleep(0.001)
        await asyncio.wait(tasks.values(), timeout=120)
        assert all(t.done() for t in tasks.values())
        for i in range(200):
            if i in cancel_ids and tasks[i].cancelled():
                continue
            assert tasks[i].exception() is None, tasks[i].exception()
            if i in cancel_ids:
                continue  # finished before its cancel point came: fine, checked no further
            outs = results[i]
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
            assert [t for o in outs for t in o.outputs[0].token_ids] == reference[PROMPTS[i % len(PROMPTS)]]
        assert sum(tasks[i].cancelled() for i in cancel_ids) >= 40  # most were really cut short

        # Aborts are sent asynchronously; the core frees the blocks within a step or two.
        async def all_blocks_back() -> bool:
            stats = await llm.get_stats()
            free = await llm.call_utility_async("get_num_free_blocks")
            return free == free_before and stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0

        await async_wait_until(all_blocks_back, 60, "every block free and no request left in the core")
        assert not llm.output_processor.has_unfinished_requests()

    loop.run_until_complete(run())


def test_stop_string_ends_the_request_and_aborts_it_in_the_core(llm, loop, reference):
    async def run() -> None:
        full = (await collect(llm, PROMPTS[1], greedy(12), "full"))[-1].outputs[0].text
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        assert stop.strip(), f"pick a visible stop string from {full!r}"
        out = (await collect(llm, PROMPTS[1], greedy(12, stop=[stop]), "stopped"))[-1].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert full.startswith(out.text) and len(out.text) < len(full)

        async def nothing_running() -> bool:
            return (await llm.get_stats())["num_running_reqs"] == 0

        await async_wait_until(nothing_running, 60, "the stop-string request aborted in the core")

    loop.run_until_complete(run())


def test_duplicate_request_id_is_a_clear_error_and_the_first_is_undisturbed(llm, loop, reference, monkeypatch):
    async def run() -> None:
        # The duplicate comes right after the first request is registered, before the loop can hand it any output:
        # a fast engine (CUDA, async scheduling) can finish all 64 tokens before a consumer polls once, and a DELTA
        # collector merges them into one finished output, so "after the first token" is no fixed point in time.
        registered = asyncio.Event()
        add_request = llm.output_processor.add_request

        def add_and_tell(request, *args, **kwargs):
            add_request(request, *args, **kwargs)
            if request.request_id == "same":
                registered.set()

        monkeypatch.setattr(llm.output_processor, "add_request", add_and_tell)
        first = llm.generate(PROMPTS[2], greedy(64, RequestOutputKind.DELTA), "same")
        first_out = asyncio.ensure_future(first.__anext__())
        await registered.wait()  # resumes before any output of "same" can be processed (those come later)
        assert "same" in llm.output_processor.request_states
        with pytest.raises(ValueError, match="'same' is already in use"):
            await collect(llm, PROMPTS[3], greedy(4), "same")
        outs = [await first_out]
        outs += [o async for o in first]
        ref = reference[PROMPTS[2]]
        assert outs[-1].finished
        assert [t for o in outs for t in o.outputs[0].token_ids][: len(ref)] == ref  # greedy: 12 tokens are a prefix

    loop.run_until_complete(run())


def test_n_greater_than_one_streams_every_sample(llm, loop, reference):
    async def run() -> None:
        outs = await collect(llm, PROMPTS[4], greedy(12, n=3), "multi")
        final = outs[-1]
        assert final.finished and sorted(c.index for c in final.outputs) == [0, 1, 2]
        assert all(c.token_ids == reference[PROMPTS[4]] for c in final.outputs)

    loop.run_until_complete(run())


def test_logprob_tensors_from_the_core_become_per_token_dicts(llm, loop, reference):
    async def run() -> None:
        params = greedy(6, RequestOutputKind.DELTA, logprobs=3, prompt_logprobs=2)
        outs = await collect(llm, PROMPTS[6], params, "lp")
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        lps = [d for o in outs for d in o.outputs[0].logprobs]
        assert ids == reference[PROMPTS[6]][:6] and len(lps) == 6
        for tok, d in zip(ids, lps):
            assert tok in d and d[tok].rank == 1  # greedy: the sampled token is the most likely
            assert len(d) >= 3 and all(lp.logprob <= 0.0 for lp in d.values())
        prompt_lps = [p for o in outs if o.prompt_logprobs for p in o.prompt_logprobs]
        assert prompt_lps[0] is None and len(prompt_lps) == len(outs[0].prompt_token_ids)

    loop.run_until_complete(run())


def test_garbage_and_wrong_type_frames_are_dropped_and_the_core_still_serves(llm, loop, reference):
    client = llm.engine_core
    ctx = zmq.Context()
    try:
        enc = MsgpackEncoder()
        # A stranger that never said HELLO, sending junk of every kind.
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(client.addresses.input)
        stranger.send_multipart([b"\x07", os.urandom(100)])
        stranger.send_multipart([EngineCoreRequestType.ADD.value, os.urandom(100)])
        stranger.send_multipart([EngineCoreRequestType.UTILITY.value, *enc.encode(UtilityRequest(0, 1, "ping"))])
        # An attached frontend sending wrong types: a UtilityRequest as ADD, a list as HELLO, a bare ADD.
        ident = uuid.uuid4().bytes
        inp, out = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for s, a in ((out, client.addresses.output), (inp, client.addresses.input)):
            s.setsockopt(zmq.IDENTITY, ident)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(a)
        inp.send_multipart(
            [EngineCoreRequestType.HELLO.value, *enc.encode(HelloRequest(PROTOCOL_VERSION, client._auth_token, "raw"))]
        )
        assert out.poll(10_000) and out.recv_multipart()[0] == EngineCoreOutputType.READY.value
        inp.send_multipart([EngineCoreRequestType.ADD.value, *enc.encode(UtilityRequest(0, 1, "ping"))])
        inp.send_multipart([EngineCoreRequestType.HELLO.value, *enc.encode([1, 2, 3])])
        inp.send_multipart([EngineCoreRequestType.ADD.value])
        inp.send_multipart([EngineCoreRequestType.ABORT.value, b"\xff\xfe"])
        # A wrong token is refused, not ignored.
        bad = ctx.socket(zmq.DEALER)
        bad_out = ctx.socket(zmq.DEALER)
        bad_id = uuid.uuid4().bytes
        for s, a in ((bad_out, client.addresses.output), (bad, client.addresses.input)):
            s.setsockopt(zmq.IDENTITY, bad_id)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(a)
        bad.send_multipart(
            [EngineCoreRequestType.HELLO.value, *enc.encode(HelloRequest(PROTOCOL_VERSION, "guess", "bad"))]
        )
        assert bad_out.poll(10_000) and bad_out.recv_multipart()[0] == EngineCoreOutputType.REFUSED.value

        async def run() -> None:
            outs = await collect(llm, PROMPTS[5], greedy(12), "after-garbage")
            assert outs[-1].outputs[0].token_ids == reference[PROMPTS[5]]
            assert await llm.call_utility_async("ping") is True

        loop.run_until_complete(run())
        assert client.proc.is_alive()
    finally:
        ctx.destroy(linger=0)


def test_kill_9_raises_engine_dead_in_every_generator_within_5s():
    async def main() -> None:
        llm = AsyncLLM.from_engine_args(engine_args(get_checkpoint("llama")))
        try:
            first_output = asyncio.Event()

            async def stream(i: int) -> None:
                async for _ in llm.generate(PROMPTS[i % len(PROMPTS)], greedy(200, RequestOutputKind.DELTA), f"k{i}"):
                    first_output.set()

            tasks = [asyncio.ensure_future(stream(i)) for i in range(8)]
            await asyncio.wait_for(first_output.wait(), 60)
            os.kill(llm.engine_core.proc.pid, signal.SIGKILL)
            # The 5 s is the promise under test (death reaches every caller within seconds), not a timing guess.
            done, pending = await asyncio.wait(tasks, timeout=5)
            assert not pending, "a generator did not fail within 5 s of kill -9"
            for t in done:
                assert isinstance(t.exception(), EngineDeadError)
            assert llm.errored and not llm.is_running
            with pytest.raises(EngineDeadError):
                async for _ in llm.generate("x", greedy(2), "after-death"):
                    pass
        finally:
            proc, tmpdir = llm.engine_core.proc, llm.engine_core.tmpdir
            llm.shutdown()
        assert proc.exitcode == -9 and not os.path.exists(tmpdir)

    asyncio.run(main())


def test_startup_failure_on_a_bad_checkpoint_raises_the_loader_error(tmp_path):
    src = get_checkpoint("llama")
    bad = tmp_path / "bad-model"
    shutil.copytree(src, bad, ignore=shutil.ignore_patterns("*.safetensors*"))
    (bad / "model.safetensors").write_bytes(b"this is not a safetensors file")
    with pytest.raises(EngineStartupError, match="Engine core failed to start: .*") as info:
        AsyncLLM.from_engine_args(engine_args(str(bad)))
    assert "safetensor" in str(info.value).lower()  # the loader's own words reach the caller
