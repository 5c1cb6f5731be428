"""InputBatch: random add / remove / update / sample sequences keep every row's tokens, blocks and
sampling state aligned with its request (checked against a plain dict model and a fresh one-row state)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.input_batch import InputBatch
from vllm_lite.worker.sampler import Sampler
from vllm_lite.worker.sampling_metadata import SamplingMetadata
from vllm_lite.worker.sampling_state import _ROW_FIELDS, SamplingState
from vllm_lite.worker.step import NewRequestData

CPU = torch.device("cpu")
V = 32
MAX_REQS = 5
MAX_LEN = 24
BLOCK = 4
MAX_BLOCKS = MAX_LEN // BLOCK
EOS = 2

# One of each kind of per-request sampling state: scalars, tables, penalty history, seeds, bad-word history.
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, logprobs=2),
    SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, seed=7),
    SamplingParams(temperature=0.7, seed=11, repetition_penalty=1.1, allowed_token_ids=[3, 4, 5, 9]),
    SamplingParams(temperature=1.0, logit_bias={6: 2.0, 8: -1.5}),
    SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[12, 13]),
    SamplingParams(temperature=1.0, _bad_words_token_ids=[[14], [15, 16], [17, 18, 19]]),
]


@dataclass
class Req:
    """The dict model's view of one request."""

    params: SamplingParams
    prompt: list[int]
    outputs: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0


def _new_data(rid: str, req: Req) -> NewRequestData:
    return NewRequestData(rid, list(req.prompt), list(req.outputs), req.params, list(req.blocks), req.num_computed, EOS)


def _row_view(md: SamplingMetadata, i: int) -> dict[str, Any]:
    """Batch index i's share of the batched metadata, independent of the other rows in the batch."""

    def pairs(index: Optional[tuple[torch.Tensor, torch.Tensor]], values: Optional[torch.Tensor] = None) -> Any:
        if index is None:
            return {}
        b, t = index[0].tolist(), index[1].tolist()
        vals = values.tolist() if values is not None else [None] * len(b)
        return {tok: v for bi, tok, v in zip(b, t, vals) if bi == i}

    view: dict[str, Any] = {
        "allowed": sorted(pairs(md.allowed_index)),
        "has_allowed": bool(md.allowed_rows[i]) if md.allowed_rows is not None else False,
        "banned": sorted(pairs(md.banned_index)),
        "bias": pairs(md.logit_bias_index, md.logit_bias_values),
        "penalties": None,
    }
    if md.penalty_token_ids is not None:
        pres, freq = float(md.presence_penalties[i]), float(md.frequency_penalties[i])
        rep = float(md.repetition_penalties[i])
        if (pres, freq, rep) != (0.0, 0.0, 1.0):
            seen = dict(zip(md.penalty_token_ids[i].tolist(), md.penalty_output_counts[i].tolist()))
            view["penalties"] = (pres, freq, rep, seen)
    return view


def _assert_aligned(batch: InputBatch, model: dict[str, Req]) -> None:
    n = len(model)
    assert batch.num_reqs == n
    assert sorted(batch.req_id_to_row.values()) == list(range(n)), "rows are not dense"
    state = batch.sampling
    assert state.active[:n].all() and not state.active[n:].any()
    for table in (state.allowed, state.bad_single, state.bad_multi, state.logit_bias, state.stop_ids):
        assert (table.rows < n).all(), "a freed row kept table entries"
    assert all(r < n for r in state.generators)
    for rid, req in model.items():
        row = batch.req_id_to_row[rid]
        assert batch.req_ids[row] == rid and batch.params[row] is req.params
        tokens = req.prompt + req.outputs
        assert batch.num_tokens[row] == len(tokens) and batch.num_prompt_tokens[row] == len(req.prompt)
        assert batch.token_ids[row, : len(tokens)].tolist() == tokens
        assert batch.block_table[row, : batch.num_blocks[row]].tolist() == req.blocks
        assert batch.num_computed_tokens[row] == req.num_computed
        # The row's sampling state equals that of a fresh state holding only this request.
        ref = SamplingState(1, V, MAX_LEN, CPU)
        ref.add_request(0, req.params, req.prompt, req.outputs, EOS)
        for name, _, _ in _ROW_FIELDS:
            assert getattr(state, name)[row] == getattr(ref, name)[0], f"{rid}: {name} drifted from its row"
        got = _row_view(state.make_metadata(np.array([row])), 0)
        assert got == _row_view(ref.make_metadata(np.array([0])), 0), rid
        assert (row in state.generators) == (0 in ref.generators)
        if row in state.generators:
            assert torch.equal(state.generators[row].get_state(), ref.generators[0].get_state()), f"{rid}: seed stream"


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, len(PARAMS) - 1), st.integers(1, 8), st.integers(0, 3)),
        st.tuples(st.just("remove"), st.integers(0, 99)),
        st.tuples(st.just("update"), st.integers(0, 99), st.integers(0, 1)),
        st.tuples(st.just("sample"), st.integers(0, 2**31 - 1)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_random_add_remove_sample_keeps_rows_and_sampling_state_aligned(operations: list[tuple]) -> None:
    batch = InputBatch(MAX_REQS, MAX_LEN, MAX_BLOCKS, V, CPU)
    model: dict[str, Req] = {}
    next_id = 0
    rng = np.random.default_rng(0)
    for op in operations:
        if op[0] == "add" and len(model) < MAX_REQS:
            _, p, n_prompt, n_out = op
            prompt = rng.integers(0, V, n_prompt).tolist()
            req = Req(PARAMS[p], prompt, rng.integers(0, V, n_out).tolist(), [next_id * 10], n_prompt)
            rid = f"r{next_id}"
            next_id += 1
            batch.add_request(_new_data(rid, req))
            model[rid] = req
        elif op[0] == "remove" and model:
            rid = sorted(model)[op[1] % len(model)]
            assert batch.remove_request(rid)
            del model[rid]
        elif op[0] == "update" and model:
            rid = sorted(model)[op[1] % len(model)]
            req = model[rid]
            new_blocks = [b + 1 for b in req.blocks[-1:]] if op[2] and len(req.blocks) < MAX_BLOCKS else []
            req.blocks += new_blocks
            req.num_computed = len(req.prompt) + len(req.outputs) - 1
            batch.update_request(rid, new_blocks, req.num_computed)
        elif op[0] == "sample" and model:
            live = [r for r in sorted(model) if len(model[r].prompt) + len(model[r].outputs) < MAX_LEN]
            if not live:
                continue
            rows = batch.rows_of(live)
            logits = torch.from_numpy(np.random.default_rng(op[1]).standard_normal((len(rows), V)).astype(np.float32))
            toks = Sampler()(logits, batch.sampling_metadata(rows)).sampled_token_ids.numpy()
            batch.record_sampled(rows, toks)
            for rid, t in zip(live, toks.tolist()):
                model[rid].outputs.append(t)
        _assert_aligned(batch, model)
    assert not batch.remove_request("never-added")


def test_condensing_moves_the_last_row_into_the_hole_with_its_sampling_state() -> None:
    batch = InputBatch(4, MAX_LEN, MAX_BLOCKS, V, CPU)
    reqs = {f"r{i}": Req(PARAMS[i + 2], [i + 1] * 3, [], [i]) for i in range(3)}  # penalties, seed, seed+allowed
    for rid, req in reqs.items():
        batch.add_request(_new_data(rid, req))
    batch.remove_request("r0")
    assert batch.req_id_to_row == {"r2": 0, "r1": 1}
    assert batch.sampling.has_allowed[0] and 0 in batch.sampling.generators and 2 not in batch.sampling.generators
    del reqs["r0"]
    _assert_aligned(batch, reqs)


def test_add_request_with_bad_sampling_tokens_leaves_the_batch_unchanged() -> None:
    batch = InputBatch(2, MAX_LEN, MAX_BLOCKS, V, CPU)
    batch.add_request(_new_data("ok", Req(PARAMS[1], [1, 2], [], [0])))
    bad = Req(SamplingParams(temperature=1.0, allowed_token_ids=[1, V + 5]), [1, 2], [], [1])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        batch.add_request(_new_data("bad", bad))
    assert batch.num_reqs == 1 and "bad" not in batch.req_id_to_row
    _assert_aligned(batch, {"ok": Req(PARAMS[1], [1, 2], [], [0])})
    with pytest.raises(ValueError, match="already in the batch"):
        batch.add_request(_new_data("ok", Req(PARAMS[1], [1, 2], [], [0])))
