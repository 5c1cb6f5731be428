"""One draft length per verify step (spec_decode/uniform_drafts.py): n-gram drafts padded with fillers so that a
batch verify step replays a CUDA graph. The padding rule on its own (lengths, caps, fillers), the runner-side
conditions, the rejection sampler's handling of fillers (never kept unless they are the target's own token), and
end to end with padding forced on the CPU: greedy tokens and logprobs, seeded tokens and the sampled distribution
as without speculation, and every verify step of the batch uniform."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from vllm_lite import LLM, SamplingParams
from vllm_lite.engine_args import EngineArgs
from vllm_lite.spec_decode.draft_budget import DraftBudget
from vllm_lite.spec_decode.rejection_sampler import greedy_verify_host, rejection_sample
from vllm_lite.spec_decode.uniform_drafts import UniformDrafts, verify_graph_sizes
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.chi_square import chi_square_homogeneity_pvalue
from vllm_lite.testing.spec_outputs import REPEATING, assert_same_outputs, tiny_llm, token_counts, token_prompts
from vllm_lite.worker.cuda_graphs import resolve_capture_sizes, resolve_graph_keys, sizes_by_query_len
from vllm_lite.worker.spec_decode_step import SpecDecodeStep

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SIGNIFICANCE = 1e-3  # every draw is seeded, so the distribution test's outcome is fixed
RANDOM = [[17, 1203, 845, 77, 1500, 9, 333, 1024, 64], [1999, 3, 1400, 250, 88]]


# ---------------------------------------------------------------------------------------------- the rule
def test_drafts_padded_to_the_longest_with_cyclic_and_last_token_fillers() -> None:
    u = UniformDrafts(5, max_num_batched_tokens=2048)
    room = np.full(3, 100)
    got = u.pad([[7, 8], [], [1, 2, 3, 4]], [9, 11, 12], room)
    assert got == ([[7, 8, 7, 8], [11, 11, 11, 11], [1, 2, 3, 4]], [2, 0, 4])
    assert (u.num_padded_steps, u.num_filler_tokens) == (1, 6)
    # Nothing to pad: no drafts at all, or a single request (batch 1 is always uniform).
    assert u.pad([[], []], [1, 2], room[:2]) is None
    assert u.pad([[1, 2]], [3], room[:1]) is None
    assert u.num_padded_steps == 1


def test_common_length_is_capped_by_room_budget_threshold_and_graphs() -> None:
    lengths = np.array([5, 2, 0])
    assert UniformDrafts(5, 2048).common_length(lengths, np.array([9, 9, 9])) == 5
    # A request's room under max_model_len / max_tokens: the scheduler would cut its padded draft there.
    assert UniformDrafts(5, 2048).common_length(lengths, np.array([9, 3, 9])) == 3
    assert UniformDrafts(5, 2048).common_length(lengths, np.array([9, 9, 0])) == 0
    # The step's token budget: 3 requests of 1 + L tokens within 12.
    assert UniformDrafts(5, 12).common_length(lengths, np.full(3, 9)) == 3
    # long_prefill_token_threshold cuts every request's step at 1 + L tokens.
    assert UniformDrafts(5, 2048, long_prefill_token_threshold=3).common_length(lengths, np.full(3, 9)) == 2
    # The longest length with a captured verify graph for 3 requests (bucket 4): q = 4 is not captured at 4.
    graphs = {2: [1, 2, 4], 3: [1, 2, 4], 4: [1, 2], 6: [1, 2, 4]}
    assert UniformDrafts(5, 2048, graph_sizes=graphs).common_length(lengths, np.full(3, 9)) == 5
    assert UniformDrafts(5, 2048, graph_sizes=graphs).common_length(lengths, np.array([9, 9, 3])) == 2
    assert UniformDrafts(5, 2048, graph_sizes={2: [1, 2]}).common_length(lengths, np.full(3, 9)) == 0


def test_padding_truncates_drafts_past_the_common_length() -> None:
    u = UniformDrafts(5, 2048)
    assert u.pad([[1, 2, 3, 4, 5], [6]], [0, 0], np.array([2, 9])) == ([[1, 2], [6, 6]], [2, 1])


def test_a_request_the_batch_rule_set_aside_verifies_its_own_lookup_instead_of_fillers() -> None:
    u = UniformDrafts(5, 2048)
    room = np.full(3, 9)
    spare = [(), [4, 5, 6, 7, 8], [9]]
    assert u.pad([[1, 2, 3], [], []], [0, 0, 7], room, spare) == ([[1, 2, 3], [4, 5, 6], [9, 9, 9]], [3, 3, 1])
    # The common length still comes from what the rule kept: spares never make the step longer.
    assert u.pad([[], [], [1]], [0, 0, 0], room, [[1, 2, 3], [], ()]) == ([[1], [0], [1]], [1, 0, 1])
    assert u.pad([[], []], [0, 0], room[:2], [[1, 2], [3]]) is None


def test_verify_graph_sizes_follow_the_runners_keys() -> None:
    """Padding is on by default exactly where the runner captures verify graphs (the same derivation)."""
    cfg = EngineArgs(model=get_checkpoint("llama"), speculative_config=SPEC, max_num_seqs=8).create_engine_config()
    assert verify_graph_sizes(cfg, torch.device("cpu"), "triton") is None
    cuda = torch.device("cuda")
    assert verify_graph_sizes(cfg, cuda, "torch_sdpa") is None
    assert verify_graph_sizes(cfg, cuda, "triton", tp_size=2) is None
    keys = resolve_graph_keys(resolve_capture_sizes(8), 3, cfg.scheduler_config.max_num_batched_tokens)
    expected = {q: bs for q, bs in sizes_by_query_len(keys).items() if q > 1}
    assert expected and verify_graph_sizes(cfg, cuda, "triton") == expected
    cfg.model_config.enforce_eager = True
    assert verify_graph_sizes(cfg, cuda, "triton") is None


# ---------------------------------------------------------------------------------------------- in the runner
def _step(k: int = 3) -> SpecDecodeStep:
    step = SpecDecodeStep.__new__(SpecDecodeStep)
    step.budget = DraftBudget(k, gain_rule=False)
    step.uniform = UniformDrafts(k, 2048)
    step._real_drafts = None
    step.lengths = None
    return step


def _batch(histories: list[list[int]], max_model_len: int = 64, **per_row: Any) -> SimpleNamespace:
    n = len(histories)
    buf = np.zeros((n, max_model_len), dtype=np.int64)
    for i, h in enumerate(histories):
        buf[i, : len(h)] = h
    sampling = SimpleNamespace(
        num_output=np.asarray(per_row.get("num_output", [5] * n), dtype=np.int64),
        min_tokens=np.asarray(per_row.get("min_tokens", [0] * n), dtype=np.int64),
        tracks_history=np.asarray(per_row.get("tracks_history", [False] * n)),
    )
    params = [SamplingParams(max_tokens=m) for m in per_row.get("max_tokens", [None] * n)]
    return SimpleNamespace(
        token_ids=buf,
        num_tokens=np.array([len(h) for h in histories], dtype=np.int64),
        max_model_len=max_model_len,
        sampling=sampling,
        params=params,
    )


def _inputs(n: int) -> SimpleNamespace:
    return SimpleNamespace(num_reqs=n, req_ids=[f"r{i}" for i in range(n)], rows=np.arange(n))


def test_runner_hook_narrows_padding_to_the_captured_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """set_verify_graphs (for the runner, once its capture is done): the captured sizes replace the derived ones,
    none captured (a failed capture) turns padding off; forced padding (tests) ignores it."""
    step = _step()
    step.uniform.graph_sizes = {2: [1, 2, 4], 3: [1, 2, 4]}
    step.set_verify_graphs({1: [1, 2, 4, 8], 2: [1, 2], 4: [1, 2]})
    assert step.uniform.graph_sizes == {2: [1, 2], 4: [1, 2]}
    step.set_verify_graphs(None)
    assert step.uniform is None
    monkeypatch.setattr(SpecDecodeStep, "uniform_drafts", True)
    forced = _step()
    forced.set_verify_graphs(None)
    assert forced.uniform is not None and forced.uniform.graph_sizes is None


def test_runner_pads_only_steps_where_every_request_decodes_and_may_speculate() -> None:
    hist = [[1, 2, 3, 9], [4, 5, 6, 7]]
    step = _step()
    out = [[1, 2, 3], []]
    step._pad_uniform(_batch(hist), _inputs(2), np.arange(2), out)
    assert out == [[1, 2, 3], [7, 7, 7]]
    assert step._real_drafts == {"r0": 3, "r1": 0}
    step._spare = {1: [4, 5]}  # r1's lookup found [4, 5], which the batch rule set aside
    out = [[1, 2, 3], []]
    step._pad_uniform(_batch(hist), _inputs(2), np.arange(2), out)
    assert out == [[1, 2, 3], [4, 5, 4]]
    assert step._real_drafts == {"r0": 3, "r1": 2}
    # A request whose min_tokens is unmet, or with multi-token bad words, gets no drafts from the scheduler.
    for kw in ({"min_tokens": [0, 9]}, {"tracks_history": [True, False]}):
        out = [[1, 2, 3], []]
        _step()._pad_uniform(_batch(hist, **kw), _inputs(2), np.arange(2), out)
        assert out == [[1, 2, 3], []]
    # max_tokens: r1 may emit 2 more tokens (output 5 of 7), so 1 draft + the bonus; max_model_len: r0 has room 2.
    out = [[1, 2, 3], [4]]
    _step()._pad_uniform(_batch(hist, max_tokens=[None, 7]), _inputs(2), np.arange(2), out)
    assert out == [[1], [4]]
    out = [[1, 2, 3], [4]]
    _step()._pad_uniform(_batch(hist, max_model_len=6), _inputs(2), np.arange(2), out)
    assert out == [[1, 2], [4, 4]]
    # r1 reached its max_tokens this step (it will not run again): left out, the others padded.
    hist3 = hist + [[8, 9]]
    out = [[1, 2, 3], [4], []]
    _step()._pad_uniform(_batch(hist3, max_tokens=[None, 5, None]), _inputs(3), np.arange(3), out)
    assert out == [[1, 2, 3], [4], [9, 9, 9]]
    # No verify graph holds 3 requests: nothing to gain.
    step = _step()
    step.uniform = UniformDrafts(3, 2048, graph_sizes={2: [1, 2], 4: [1, 2]})
    out = [[1, 2, 3], [4], []]
    step._pad_uniform(_batch(hist3), _inputs(3), np.arange(3), out)
    assert out == [[1, 2, 3], [4], []]


@pytest.mark.parametrize("row_search_max_batch", [64, 0])
def test_proposals_padded_after_the_batch_rule_with_set_aside_lookups_verified(row_search_max_batch: int) -> None:
    """SpecDecodeStep.propose end to end on the host (per-row and vectorised lookups): the batch rule sits out r1
    (acceptance below its floor), whose lookup is then verified in place of fillers; r2 found nothing."""
    from vllm_lite.spec_decode.ngram_proposer import NgramProposer

    step = _step()
    step.budget = DraftBudget(3)
    step.budget._acceptance["r1"] = 0.1
    step.proposer = NgramProposer(3, 1, 3, 64)
    step.proposer.row_search_max_batch = row_search_max_batch
    step.draft, step.disable_by_batch_size, step._step_drafts = None, None, 0
    batch = _batch([[1, 2, 3, 1, 2], [4, 5, 6, 4, 5], [7, 8, 9]])
    inputs = SimpleNamespace(**vars(_inputs(3)), num_tokens=3)
    out = step.propose(batch, inputs, np.arange(3))
    assert out == [[3, 1, 2], [6, 4, 5], [9, 9, 9]]
    assert step._real_drafts == {"r0": 3, "r1": 3, "r2": 0}


def test_budget_learns_acceptance_from_the_lookups_own_drafts() -> None:
    """Fillers are rejected by design: a padded request's acceptance average counts its own drafts only, and a
    request whose draft was all filler keeps its average; the step-cost bookkeeping counts every verified row."""
    step = _step()
    step._real_drafts = {"a": 1, "b": 0}
    step.observe(["a", "b"], np.array([3, 3]), np.array([1, 0]))
    assert step.budget.acceptance("a") == pytest.approx(0.5 + 0.3 * (1.0 - 0.5))
    assert step.budget.acceptance("b") == 0.5
    assert step._step_drafts == 6
    step._real_drafts = None
    step.observe(["a"], np.array([3]), np.array([0]))
    assert step.budget.acceptance("a") < 0.5


# ---------------------------------------------------------------------------------------------- verification
def _padded(drafts: torch.Tensor, num_draft: torch.Tensor, fillers: torch.Tensor) -> torch.Tensor:
    k = drafts.shape[1]
    return torch.where(torch.arange(k)[None, :] < num_draft[:, None], drafts, fillers)


@pytest.mark.parametrize("greedy", [True, False])
def test_fillers_change_no_emitted_token(greedy: bool) -> None:
    """Rows verified with their own drafts and again with fillers after them (the same seeded generators): the
    padded row emits the unpadded row's tokens first, and a filler is kept only where it is the target's token."""
    gen = torch.Generator().manual_seed(11)
    b, k, v = 400, 4, 4  # a small vocabulary: some fillers are the target's token, most are not
    target = torch.rand((b, k + 1, v), generator=gen).pow(3)
    target = target / target.sum(dim=2, keepdim=True)
    drafts = torch.randint(0, v, (b, k), generator=gen)
    num_draft = torch.randint(0, k, (b,), generator=gen)
    padded = _padded(drafts, num_draft, torch.randint(0, v, (b, k), generator=gen))
    full = torch.full((b,), k)

    def verify(d: torch.Tensor, n: torch.Tensor) -> Any:
        if greedy:
            return greedy_verify_host(target.log(), d.numpy(), n.numpy())
        generators = {i: torch.Generator().manual_seed(500 + i) for i in range(b)}
        return rejection_sample(d, n, None, target, torch.zeros(b, dtype=torch.bool), generators)

    plain, pad = verify(drafts, num_draft), verify(padded, full)
    kept_fillers = 0
    for i in range(b):
        a, n = int(plain.num_accepted[i]), int(num_draft[i])
        ref = plain.output_token_ids[i, : a + 1].tolist()
        assert pad.output_token_ids[i, : a + 1].tolist() == ref, f"row {i}"
        if a < n:  # rejected before the fillers: the same row
            assert int(pad.num_accepted[i]) == a
        for j in range(n, int(pad.num_accepted[i])):  # kept fillers: each is the token emitted there unpadded
            kept_fillers += 1
            if j == n:
                assert int(padded[i, j]) == ref[n]
            if greedy:
                assert int(padded[i, j]) == int(target[i, j].argmax())
    assert kept_fillers > 0 and (pad.num_accepted < full).any(), "fillers both kept and rejected"


# ---------------------------------------------------------------------------------------------- end to end
def _llm(**kwargs: Any) -> LLM:
    """On the CPU also on a GPU machine (these pin the CPU's no-graph rule; the CUDA case has its own test below)."""
    return tiny_llm(device="cpu", kv_cache_memory_bytes=4 << 20, **kwargs)


@pytest.fixture(scope="module")
def base() -> Iterator[LLM]:
    llm = _llm()
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def padded() -> Iterator[LLM]:
    """Padding forced on (no graphs on the CPU), drafts at every step (the batch rule off: it decides from
    measured step times, and this tests what padded drafts verify to)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SpecDecodeStep, "uniform_drafts", True)
        mp.setattr(SpecDecodeStep, "gain_rule", False)
        llm = _llm(speculative_config=SPEC)
    yield llm
    llm.shutdown()


def _runner(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


def _scheduler(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def _record_verify_steps(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], bool]]:
    """Each verify step's tokens per request, as scheduled, and whether a request in it was on its last token (no
    room for a draft under max_tokens or max_model_len: the rule then leaves the step's drafts as they are)."""
    sched = _scheduler(llm)
    schedule, steps = sched.schedule, []

    def recording() -> Any:
        so = schedule()
        if so.scheduled_spec_decode_tokens:
            reqs = [sched.requests[r] for r in so.num_scheduled_tokens]
            last = any(r.num_tokens >= sched.max_model_len or r.num_output_tokens + 1 >= r.max_tokens for r in reqs)
            steps.append((sorted(so.num_scheduled_tokens.values()), last))
        return so

    monkeypatch.setattr(sched, "schedule", recording)
    return steps


def test_padding_is_off_on_the_cpu_by_default(base: LLM) -> None:
    llm = _llm(speculative_config=SPEC)
    try:
        assert _runner(llm).spec_decode.uniform is None
    finally:
        llm.shutdown()


def test_greedy_outputs_equal_plain_decoding_and_every_verify_step_is_uniform(
    base: LLM, padded: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests with drafts beside requests without, one running into max_model_len and one into a short
    max_tokens (room caps): the tokens and logprobs of plain decoding, and every verify step one length."""
    uniform = _runner(padded).spec_decode.uniform
    assert uniform is not None
    fillers = uniform.num_filler_tokens
    accepted = _scheduler(padded).spec.total.num_accepted_tokens
    steps = _record_verify_steps(padded, monkeypatch)
    long_prompt = (REPEATING[0] * 5)[:110]  # 110 + 40 > max_model_len 128: finishes on length there
    prompts = token_prompts(REPEATING + RANDOM + [long_prompt])
    params = [SamplingParams(temperature=0.0, max_tokens=40, logprobs=3, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(temperature=0.0, max_tokens=13, logprobs=3, ignore_eos=True)
    expected = base.generate(prompts, params, use_tqdm=False)
    got = padded.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(expected, got, logprobs=True)
    assert _scheduler(padded).spec.total.num_accepted_tokens > accepted, "no draft accepted: nothing was verified"
    assert uniform.num_filler_tokens > fillers, "no step was padded"
    mixed = [(s, last) for s, last in steps if s[0] != s[-1]]
    assert len(steps) > 5 and all(last for _, last in mixed), f"mixed verify steps: {mixed}"


def test_seeded_requests_emit_what_plain_decoding_emits(base: LLM, padded: LLM) -> None:
    """n-gram drafts and fillers are point masses: a seeded row emits the target's own draws, one per token."""
    prompts = token_prompts(REPEATING + RANDOM)
    params = [SamplingParams(temperature=0.8, top_k=4, max_tokens=30, seed=s, ignore_eos=True) for s in range(5)]
    fillers = _runner(padded).spec_decode.uniform.num_filler_tokens
    assert_same_outputs(
        base.generate(prompts, params, use_tqdm=False), padded.generate(prompts, params, use_tqdm=False)
    )
    assert _runner(padded).spec_decode.uniform.num_filler_tokens > fillers


def test_sampled_token_frequencies_match_plain_decoding(base: LLM, padded: LLM) -> None:
    """Chi-square homogeneity at 1e-3 (as tests/test_spec_decode_e2e.py, padding forced): the 3rd and 4th sampled
    tokens of many seeded runs with padded speculation against as many independent runs without it."""
    n = 300
    prompts = token_prompts([REPEATING[1], RANDOM[0]] * (n // 2))
    with_spec = [SamplingParams(temperature=0.8, top_k=4, max_tokens=4, seed=s, ignore_eos=True) for s in range(n)]
    without = [SamplingParams(temperature=0.8, top_k=4, max_tokens=4, seed=n + s, ignore_eos=True) for s in range(n)]
    uniform = _runner(padded).spec_decode.uniform
    fillers, accepted = uniform.num_filler_tokens, _scheduler(padded).spec.total.num_accepted_tokens
    got = padded.generate(prompts, with_spec, use_tqdm=False)
    expected = base.generate(prompts, without, use_tqdm=False)
    assert _scheduler(padded).spec.total.num_accepted_tokens > accepted
    assert uniform.num_filler_tokens > fillers
    for half in (0, 1):  # each prompt's runs on their own
        for position in (2, 3):
            a, b = got[half::2], expected[half::2]
            pvalue = chi_square_homogeneity_pvalue(token_counts(a, position), token_counts(b, position))
            assert pvalue > SIGNIFICANCE, f"prompt {half}, position {position}: p = {pvalue}"


def _verify_steps_and_replays(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list]:
    """(batch size, some request on its last token) of the verify steps scheduled from now on, and the (requests,
    q) of the verify steps replayed."""
    steps = _record_verify_steps(llm, monkeypatch)
    runner = _runner(llm)
    run = runner.cuda_graphs.run
    replays: list = []

    def counting(inputs: Any, *args: Any, **kwargs: Any) -> Any:
        out = run(inputs, *args, **kwargs)
        if out is not None and int(inputs.num_scheduled[0]) > 1:
            replays.append((inputs.num_reqs, int(inputs.num_scheduled[0])))
        return out

    monkeypatch.setattr(runner.cuda_graphs, "run", counting)
    return steps, replays


def _assert_batch_verify_steps_replayed(steps: list, replays: list) -> None:
    """Every batch verify step replayed, but those with a request on its last token beside drafted ones (no room
    for a draft: the rule leaves that step mixed)."""
    batch = [(len(s), last) for s, last in steps if len(s) > 1]
    assert len(batch) >= 5, steps
    assert len([r for r in replays if r[0] > 1]) == len([b for b, last in batch if not last]), (steps, replays)


def test_every_batch_verify_step_takes_the_graph_path_with_stand_in_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU stand-ins for the runner's graphs (testing/device_ops.py: the replay path's buffer copies) and the
    padding as on CUDA (capped by those keys): requests with drafts of different lengths and without any verify
    every batch step through a graph, and emit what the same engine emits unpadded."""
    from vllm_lite.testing.device_ops import install_stand_in_graphs

    monkeypatch.setattr(SpecDecodeStep, "gain_rule", False)
    llm = _llm(speculative_config=SPEC)
    try:
        runner = _runner(llm)
        keys = resolve_graph_keys([1, 2, 4, 8], 3, runner.max_num_tokens)
        prompts = token_prompts(REPEATING + RANDOM[:1])
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        unpadded = llm.generate(prompts, params, use_tqdm=False)
        install_stand_in_graphs(runner, keys)
        runner.spec_decode.uniform = UniformDrafts(3, runner.max_num_tokens)
        runner.spec_decode.set_verify_graphs(runner.cuda_graphs.by_q)
        assert runner.spec_decode.uniform.graph_sizes == {q: [1, 2, 4, 8] for q in (2, 3, 4)}
        steps, replays = _verify_steps_and_replays(llm, monkeypatch)
        assert_same_outputs(unpadded, llm.generate(prompts, params, use_tqdm=False))
        _assert_batch_verify_steps_replayed(steps, replays)
    finally:
        llm.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batch_verify_steps_replay_graphs_with_the_eager_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA padding is on by default: every batch verify step replays a graph, and the greedy tokens (float32)
    are the eager engine's."""
    monkeypatch.setattr(SpecDecodeStep, "gain_rule", False)
    kw: dict[str, Any] = dict(
        model=get_checkpoint("llama"),
        dtype="float32",
        device="cuda",
        max_model_len=256,
        multiprocess=False,
        max_num_seqs=8,
        gpu_memory_utilization=0.15,
        speculative_config=SPEC,
    )
    prompts = token_prompts(REPEATING + RANDOM[:1])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(enforce_eager=True, **kw) as llm:
        assert _runner(llm).spec_decode.uniform is None
        eager = llm.generate(prompts, params, use_tqdm=False)
    with LLM(**kw) as llm:
        assert _runner(llm).spec_decode.uniform is not None and _runner(llm).cuda_graphs is not None
        steps, replays = _verify_steps_and_replays(llm, monkeypatch)
        assert_same_outputs(eager, llm.generate(prompts, params, use_tqdm=False))
    _assert_batch_verify_steps_replayed(steps, replays)
