"""Offline bf16 generate with stop strings gives the same tokens run to run (issue 15).

Stop strings are matched in the frontend's detokenizer, which then aborts the request at the core. If the
core keeps stepping meanwhile, the stopped request stays in a timing-dependent number of further batches;
bf16 linears give row results that depend on the batch's row count (oneDNN picks kernels by M, our own
small-m kernel takes <= SMALL_M_MAX rows), so the other requests' logits, and at times their tokens, change.

The checkpoint is 768 wide (2 layers): at that width the row count changes bf16 sums (the 64-wide tiny
checkpoint's do not). ``late_answers`` makes the race visible without depending on timing: the frontend's
answers reach the core ``lag`` outputs late, as from a frontend that fell behind. Before the fix (stop aborts
sent as ABORTs, the core stepping on) that changed a greedy token; now an offline frontend's stop-string
requests carry ``await_stop_verdict`` and their stop aborts travel in the StopVerdict that the core waits for
before its next step, so a late answer only delays the core.

Below those, the protocol on a real EngineCore served by EngineCoreProc, with frontends speaking the wire.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator

import pytest

from vllm_lite import LLM, SamplingParams
from vllm_lite.core.messages import (
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreRequestBatch,
    EngineCoreRequestType,
    FinishReason,
    StopVerdict,
    UtilityRequest,
)
from vllm_lite.testing.checkpoints import CACHE_VERSION, build_checkpoint, cached_build
from vllm_lite.testing.core_harness import make_request, unique_id
from vllm_lite.testing.fake_core import RawFrontend
from vllm_lite.testing.served_core import ServedCore
from vllm_lite.worker.models.cpu_prepack import SMALL_M_MAX

# The batch crosses the small-m kernel's row limit when the short requests leave (oneDNN above it).
NUM_SHORT = 8
NUM_LONG = max(1, SMALL_M_MAX - 4)
MAX_TOKENS = 32
# Before the fix, with the frontend's ABORTs 3 outputs late, these prompts changed a long request's greedy
# token (and five long requests' logprobs) on Zen 4 AVX-512 BF16 (SMALL_M_MAX 12: 16 rows -> 8).
PROMPTS = [("word " * (3 + 2 * i)).strip() + f" {i}" for i in range(NUM_LONG + NUM_SHORT)]


def wide_checkpoint() -> str:
    """A 2-layer llama 768 wide (random weights, the tiny tokenizer), cached like the others."""
    overrides = dict(
        hidden_size=768, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=4
    )
    return cached_build(
        f"{CACHE_VERSION}-llama-wide768-l2",
        lambda tmp: build_checkpoint("llama", tmp, config_overrides=dict(overrides, head_dim=64)),
    )


def make_llm() -> LLM:
    # bfloat16 as the issue reports it; prefix caching off, so every run computes the same prefill.
    return LLM(model=wide_checkpoint(), dtype="bfloat16", max_model_len=128, num_threads=1, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with make_llm() as engine:
        yield engine


def _params(stop: list[str] | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, stop=stop)


@pytest.fixture(scope="module")
def params(llm: LLM) -> list[SamplingParams]:
    """The long requests run MAX_TOKENS; each short one stops on a string its own output reaches early."""
    free = llm.generate(PROMPTS, _params(), use_tqdm=False)
    tok = llm.get_tokenizer()
    out: list[SamplingParams] = [_params() for _ in range(NUM_LONG)]
    for i, o in enumerate(free[NUM_LONG:]):
        text = o.outputs[0].text
        # The text of the first few tokens: the stop string first matches there, a few steps in.
        length = len(tok.decode(o.outputs[0].token_ids[: 3 + i % 3], skip_special_tokens=True))
        stop = text[: max(1, min(length, len(text) - 1))]
        assert stop.strip(), f"output {text!r} starts with whitespace only"
        out.append(_params([stop]))
    return out


def _run(llm: LLM, params: list[SamplingParams]) -> list[tuple[list[int], list[float]]]:
    """Per prompt: greedy token ids and their logprobs (bit-exact floats)."""
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    got = []
    for i, o in enumerate(outs):
        c = o.outputs[0]
        if i >= NUM_LONG:  # the short ones did stop on their string, early
            assert c.finish_reason == "stop" and len(c.token_ids) < MAX_TOKENS // 2, (c.finish_reason, c.token_ids)
        got.append((list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]))
    return got


# How long a lagging frontend waits for the core's next outputs before it sends what it holds: the core that
# waits for a verdict sends none, so each held verdict costs this much (the result never depends on it).
READ_AHEAD_S = 0.3


@contextlib.contextmanager
def late_answers(llm: LLM, lag: int) -> Iterator[None]:
    """The frontend's ABORTs and stop verdicts reach the core ``lag`` outputs after it sent them (a frontend
    that fell behind), or once the core has sent nothing for READ_AHEAD_S (it waits for them)."""
    client = llm.llm_engine.engine_core
    send_abort, send_verdict, get_output = client.abort_requests, client.send_stop_verdict, client.get_output
    held: list[list[Any]] = []  # [outputs still to wait for, send, args]

    def release(due: list[list[Any]]) -> None:
        for h in due:
            held.remove(h)
            h[1](*h[2])

    def lagging_get_output() -> Any:
        try:
            outs = get_output(timeout=READ_AHEAD_S if held else None)
        except TimeoutError:  # the core waits for what we hold
            release(list(held))
            outs = get_output()
        for h in held:
            h[0] -= 1
        release([h for h in held if h[0] <= 0])
        return outs

    client.get_output = lagging_get_output
    client.abort_requests = lambda ids: held.append([lag, send_abort, (ids,)]) if lag else send_abort(ids)
    client.send_stop_verdict = lambda *a: held.append([lag, send_verdict, a]) if lag else send_verdict(*a)
    try:
        yield
    finally:
        del client.abort_requests, client.send_stop_verdict, client.get_output
        release(list(held))


def test_tokens_do_not_depend_on_when_stop_aborts_reach_the_core(llm: LLM, params: list[SamplingParams]) -> None:
    runs = {}
    for lag in (0, 3):
        with late_answers(llm, lag):
            runs[lag] = _run(llm, params)
    for lag in (3,):
        assert [ids for ids, _ in runs[lag]] == [ids for ids, _ in runs[0]], f"tokens changed with lag {lag}"
        assert runs[lag] == runs[0], f"logprobs changed with lag {lag}"


def test_tokens_repeat_run_to_run_and_in_a_fresh_llm(llm: LLM, params: list[SamplingParams]) -> None:
    first = _run(llm, params)
    assert _run(llm, params) == first
    with make_llm() as fresh:
        assert _run(fresh, params) == first


def test_only_stop_string_requests_wait_for_verdicts(llm: LLM, params: list[SamplingParams]) -> None:
    client = llm.llm_engine.engine_core
    sent: list[Any] = []
    add_requests = client.add_requests
    client.add_requests = lambda requests: (sent.extend(requests), add_requests(requests))[1]
    try:
        _run(llm, params)
    finally:
        del client.add_requests
    assert [r.await_stop_verdict for r in sent] == [False] * NUM_LONG + [True] * NUM_SHORT


# ---------------------------------------------------------------------------- the protocol, on a real core

PLAIN = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=["no such text"])
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=["no such text"])
_call_ids = itertools.count(1000)


@pytest.fixture(scope="module")
def served() -> Iterator[ServedCore]:
    core = ServedCore()
    yield core
    core.stop()


def _outputs(fe: RawFrontend) -> EngineCoreOutputs:
    """The next OUTPUTS message that carries request outputs."""
    while True:
        kind, outs = fe.recv(30.0)
        if kind is EngineCoreOutputType.OUTPUTS and outs.outputs:
            return outs


def _until_utility(fe: RawFrontend, method: str, *args: Any) -> tuple[Any, list[EngineCoreOutputs]]:
    """Call a utility; returns its result and every outputs message the core sent before the reply."""
    call_id = next(_call_ids)
    fe.send(EngineCoreRequestType.UTILITY, UtilityRequest(0, call_id, method, list(args)))
    before = []
    while True:
        kind, outs = fe.recv(30.0)
        if kind is not EngineCoreOutputType.OUTPUTS:
            continue
        if outs.outputs:
            before.append(outs)
        if outs.utility_output is not None and outs.utility_output.call_id == call_id:
            return outs.utility_output.result, before


def _steps(fe: RawFrontend) -> tuple[int, list[EngineCoreOutputs]]:
    stats, before = _until_utility(fe, "get_stats")
    return stats["step_counter"], before


def _idle(served: ServedCore, fe: RawFrontend) -> None:
    """Nothing left running in the core and every KV block free again (aborts freed theirs)."""
    assert _until_utility(fe, "get_num_unfinished_requests")[0] == 0
    assert _until_utility(fe, "get_num_free_blocks")[0] == _until_utility(fe, "get_num_total_blocks")[0]


def test_the_core_steps_again_only_after_the_stop_verdict(served: ServedCore) -> None:
    fe = served.frontend()
    flagged, plain = unique_id("flagged"), unique_id("plain")
    batch = [make_request(flagged, [1, 5, 6, 7], LONG, await_stop_verdict=True), make_request(plain, [1, 8, 9], PLAIN)]
    fe.send(EngineCoreRequestType.ADD_BATCH, EngineCoreRequestBatch(batch))
    first = _outputs(fe)
    assert first.stop_verdict_step > 0
    assert sorted(o.request_id for o in first.outputs) == sorted([flagged, plain])
    # The core waits for our answer: it serves calls, but takes no step and sends no outputs.
    steps, before = _steps(fe)
    for _ in range(3):
        assert _steps(fe) == (steps, [])
    assert before == []
    # An answer for an older step does not count.
    fe.send(EngineCoreRequestType.STOP_VERDICT, StopVerdict(first.stop_verdict_step - 1, []))
    assert _steps(fe) == (steps, [])
    # The verdict: the flagged request stopped (a stop string matched). Aborted before the next step.
    fe.send(EngineCoreRequestType.STOP_VERDICT, StopVerdict(first.stop_verdict_step, [flagged]))
    later = []
    while not any(o.finished for m in later for o in m.outputs):
        later.append(_outputs(fe))
    assert {o.request_id for m in later for o in m.outputs} == {plain}
    # Stop strings alone (no flag, as from the HTTP server) never make the core wait.
    assert [m.stop_verdict_step for m in later] == [0] * len(later)
    assert sum(len(o.new_token_ids) for m in later for o in m.outputs) == PLAIN.max_tokens - 1
    _idle(served, fe)


def test_a_frontend_owing_a_verdict_never_holds_up_another(served: ServedCore) -> None:
    a, b = served.frontend(), served.frontend()
    flagged, other = unique_id("flagged"), unique_id("other")
    batch = [make_request(flagged, [1, 5, 6, 7], LONG, await_stop_verdict=True), make_request(other, [1, 9], LONG)]
    a.send(EngineCoreRequestType.ADD_BATCH, EngineCoreRequestBatch(batch))
    owed = [_outputs(a).stop_verdict_step]
    assert owed[0] > 0
    # b's request runs to the end while a owes its answer (a's request steps along with it, unanswered).
    plain = unique_id("plain")
    b.send(EngineCoreRequestType.ADD, make_request(plain, [1, 8, 9], PLAIN))
    got = b.collect({plain}, timeout_s=30.0)
    assert sum(len(o.new_token_ids) for o in got[plain]) == PLAIN.max_tokens
    _, before = _steps(a)
    owed += [m.stop_verdict_step for m in before]
    assert len(owed) > 1 and owed == sorted(set(owed))  # one new step number per step it got a token in
    # Alone again, the core waits for a's answer to its latest step.
    steps, _ = _steps(a)
    a.send(EngineCoreRequestType.STOP_VERDICT, StopVerdict(owed[-2], []))
    assert _steps(a) == (steps, [])
    # a leaves without answering: its requests are aborted (a hears so) and nothing waits for it any more.
    a.inp.send(EngineCoreRequestType.GOODBYE.value)
    assert [o.finish_reason for o in _outputs(a).outputs] == [FinishReason.ABORT] * 2
    _idle(served, b)
    assert served.proc._awaited_verdicts == {} and served.proc._verdict_ids == set()


def test_a_lone_stop_string_request_never_waits(served: ServedCore) -> None:
    """With no other request live, a stopped request's extra steps change nobody's batch: no verdict asked."""
    fe = served.frontend()
    rid = unique_id("alone")
    fe.send(EngineCoreRequestType.ADD, make_request(rid, [1, 5, 6, 7], PLAIN, await_stop_verdict=True))
    got = []
    while not any(o.finished for m in got for o in m.outputs):
        got.append(_outputs(fe))
    assert [m.stop_verdict_step for m in got] == [0] * len(got)
    assert sum(len(o.new_token_ids) for m in got for o in m.outputs) == PLAIN.max_tokens
    _idle(served, fe)
