"""CUDA graphs of speculative-decoding verify steps (every request runs 1 + d tokens) and of LoRA engines
(worker/cuda_graphs.py): which (batch, q) graphs exist and which a step picks, the padded layout for q > 1 and
for the per-token adapter slots, and the padded inputs run eagerly on CPU against the unpadded step (the torch
paths, and the Triton attention and LoRA kernels in the interpreter); the replay path (buffers, LoRA slot buffer,
the runner's routing) in whole CPU engines with stand-in graphs that run the forward over the persistent
buffers; on CUDA, greedy tokens with and without graphs for an n-gram speculative engine and a LoRA engine.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Optional

import numpy as np
import pytest
import torch

from vllm_lite.lora.request import LoRARequest
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.cpu_runner import cpu_runner
from vllm_lite.testing.device_ops import install_stand_in_graphs
from vllm_lite.testing.lora_checkpoints import AdapterSpec, build_lora_adapter
from vllm_lite.worker.cuda_graphs import (
    NULL_BLOCK,
    CudaDecodeGraphs,
    estimate_graph_bytes,
    pad_decode_inputs,
    resolve_graph_keys,
    sizes_by_query_len,
    step_graph_key,
    uniform_query_len,
)
from vllm_lite.worker.forward_context import set_forward_context
from vllm_lite.worker.spec_decode_step import SpecDecodeStep
from vllm_lite.worker.step import CachedRequestData, NewRequestData, SchedulerOutput
from vllm_lite.worker.step_inputs import build_step_inputs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BLOCK_SIZE = 16
BLOCKS_PER_REQ = 4  # max_model_len 64 in the CPU runners
PROMPTS = [[1, 5, 9, 20, 33], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [7, 8]]
# Prompts that repeat themselves, so n-gram lookup finds drafts and the tiny model's loops accept some.
REPEATING = [[11, 12, 13, 14, 15] * 4, [40, 41, 42] * 6, [7, 8, 9, 10] * 5]


# ---------------------------------------------------------------------------------------------- bookkeeping
def test_graph_keys_add_verify_query_lengths_at_small_batches() -> None:
    sizes = [1, 2, 4, 8, 16, 24, 32]
    assert resolve_graph_keys(sizes) == [(b, 1) for b in reversed(sizes)]  # no speculation: decode only
    keys = resolve_graph_keys(sizes, num_speculative_tokens=3, max_num_batched_tokens=8192)
    by_q = sizes_by_query_len(keys)
    assert by_q == {1: sizes, 2: [1, 2, 4, 8, 16], 3: [1, 2, 4, 8, 16], 4: [1, 2, 4, 8, 16]}
    tokens = [b * q for b, q in keys]
    assert tokens == sorted(tokens, reverse=True)  # captured most tokens first: the pool grows once
    # No drafts from disable_by_batch_size requests on; no step past max_num_batched_tokens.
    assert sizes_by_query_len(resolve_graph_keys(sizes, 3, 8192, disable_by_batch_size=4))[2] == [1, 2]
    capped = sizes_by_query_len(resolve_graph_keys([1, 2, 4], 3, max_num_batched_tokens=10))
    assert capped == {1: [1, 2, 4], 2: [1, 2, 4], 3: [1, 2], 4: [1, 2]}
    # The KV reserve scales to the largest graph's tokens (32 decode rows here, not 16 * 4 = 64 verify rows).
    assert estimate_graph_bytes(1 << 30, 1024, tokens) == (1 << 30) * 64 // 1024 + len(keys) * (4 << 20)


def test_a_step_replays_the_graph_of_its_uniform_query_length() -> None:
    by_q = {1: [1, 2, 4], 3: [1, 2], 4: [1, 2]}
    assert step_graph_key(by_q, np.array([1, 1, 1])) == (4, 1)
    assert step_graph_key(by_q, np.array([3, 3])) == (2, 3)  # two requests, two drafts each
    assert step_graph_key(by_q, np.array([4])) == (1, 4)
    assert step_graph_key(by_q, np.array([3, 3, 3])) is None  # past the largest verify graph
    assert step_graph_key(by_q, np.array([2, 2])) is None  # no graph for q = 2
    assert step_graph_key(by_q, np.array([3, 4])) is None  # drafts of different lengths: eager
    assert step_graph_key(by_q, np.array([1, 17])) is None  # a prefill chunk beside a decode
    assert step_graph_key(by_q, np.zeros(0, dtype=np.int64)) is None
    assert uniform_query_len(np.array([5, 5])) == 5 and uniform_query_len(np.array([0])) is None


def _runner(dtype: str = "float32", max_num_seqs: int = 8, **kwargs):
    return cpu_runner(BLOCK_SIZE, BLOCKS_PER_REQ, dtype, max_num_seqs, **kwargs)


def _prefill(runner, prompts: list[list[int]], loras: Optional[list[Optional[LoRARequest]]] = None):
    new = [
        NewRequestData(
            req_id=f"r{i}",
            prompt_token_ids=list(p),
            output_token_ids=[],
            sampling_params=SamplingParams(temperature=0.0, max_tokens=32),
            block_ids=[1 + i * BLOCKS_PER_REQ + j for j in range(BLOCKS_PER_REQ)],
            num_computed_tokens=0,
            lora_request=None if loras is None else loras[i],
        )
        for i, p in enumerate(prompts)
    ]
    sched = {n.req_id: len(n.prompt_token_ids) for n in new}
    return runner.execute_model(SchedulerOutput(new, CachedRequestData(), sched, sum(sched.values()), set()))


def _verify_inputs(runner, drafts: int):
    """Every live request's next step with `drafts` draft tokens (q = 1 + drafts), drafts laid into the batch."""
    batch = runner.input_batch
    req_ids = [r for r in batch.req_ids if r is not None]
    computed = [int(batch.num_tokens[batch.req_id_to_row[r]]) - 1 for r in req_ids]
    spec = {r: [(5 * i + j) % 50 + 3 for j in range(drafts)] for i, r in enumerate(req_ids)} if drafts else {}
    so = SchedulerOutput(
        [],
        CachedRequestData(list(req_ids), [[] for _ in req_ids], computed),
        {r: 1 + drafts for r in req_ids},
        len(req_ids) * (1 + drafts),
        set(),
        scheduled_spec_decode_tokens=spec,
    )
    runner._update_states(so)
    if spec:
        SpecDecodeStep.write_drafts(batch, so)
    return build_step_inputs(batch, dict(so.num_scheduled_tokens), runner.block_size, runner._arange)


def test_pad_layout_of_a_verify_step() -> None:
    runner = _runner()
    _prefill(runner, PROMPTS[:2])
    inputs = _verify_inputs(runner, drafts=2)  # q = 3
    p = pad_decode_inputs(inputs, 4, BLOCK_SIZE)
    assert p.key == (4, 3) and p.num_real == 2 and len(p.input_ids) == 12
    assert p.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    assert p.input_ids[:6].tolist() == inputs.input_ids.tolist() and p.input_ids[6:].tolist() == [0] * 6
    assert p.positions[:6].tolist() == inputs.positions.tolist() and p.positions[6:].tolist() == [0, 1, 2] * 2
    assert p.slot_mapping[6:].tolist() == [NULL_BLOCK * BLOCK_SIZE + i for i in (0, 1, 2)] * 2
    assert p.seq_lens[2:].tolist() == [3, 3] and p.num_tokens[2:].tolist() == [3, 3]
    assert (p.block_table[2:] == NULL_BLOCK).all() and np.array_equal(p.block_table[:2], inputs.block_table)
    md = p.metadata(runner.device, runner.max_model_len)
    assert md.max_query_len == 3 and md.num_actual_tokens == 12 and md.num_reqs == 4
    # block_size < q: padding rows still map into block 0 only (two tokens share a slot there).
    small = pad_decode_inputs(inputs, 3, 2)
    assert small.slot_mapping[6:].tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="same number of tokens"):
        pad_decode_inputs(build_step_inputs(runner.input_batch, {"r0": 3, "r1": 2}, BLOCK_SIZE, runner._arange), 2, 16)


def test_pad_layout_of_lora_slots() -> None:
    runner = _runner()
    _prefill(runner, PROMPTS[:3])
    inputs = _verify_inputs(runner, drafts=1)  # q = 2, 3 requests
    slots = np.array([2, 2, -1, -1, 0, 0], dtype=np.int32)
    p = pad_decode_inputs(inputs, 4, BLOCK_SIZE, lora_slots=slots)
    assert p.lora_slots is not None and p.lora_slots.dtype == np.int32
    assert p.lora_slots.tolist() == [2, 2, -1, -1, 0, 0, -1, -1]  # padding rows: no adapter
    assert pad_decode_inputs(inputs, 4, BLOCK_SIZE).lora_slots is None
    with pytest.raises(ValueError, match="lora_slots"):
        pad_decode_inputs(inputs, 4, BLOCK_SIZE, lora_slots=slots[:3])


# ---------------------------------------------------------------------------------------------- padded == unpadded
def _padded_vs_unpadded(runner, inputs, bucket: int, lora: bool = False) -> dict:
    """Run one step eagerly, unpadded and padded to `bucket` requests, from the same KV cache."""
    manager = runner.lora_manager
    q = uniform_query_len(inputs.num_scheduled)
    before = [c.clone() for c in runner.kv_caches]
    with torch.inference_mode():
        if lora:
            manager.prepare_step(runner.input_batch.lora_ids[inputs.rows], inputs.num_scheduled)
        plain = runner._run_model(inputs).clone()
        after_plain = [c.clone() for c in runner.kv_caches]
        for c, b in zip(runner.kv_caches, before):
            c.copy_(b)
        p = pad_decode_inputs(inputs, bucket, runner.block_size, manager.step_token_slots if lora else None)
        if lora:
            from vllm_lite.lora import ops

            slots = torch.from_numpy(p.lora_slots)
            manager.state.token_slots = slots
            ops.set_step_slots(slots)
        md = p.metadata(runner.device, runner.max_model_len, runner.max_blocks_per_req)
        with set_forward_context(md, runner.backend):
            padded = runner.model(torch.from_numpy(p.input_ids), torch.from_numpy(p.positions)).clone()
    n = inputs.num_tokens
    return dict(
        n=n,
        q=q,
        plain=plain,
        padded=padded,
        same_tokens=bool(
            torch.equal(
                runner.model.compute_logits(plain).argmax(-1), runner.model.compute_logits(padded[:n]).argmax(-1)
            )
        ),
        caches=(before, after_plain, [c.clone() for c in runner.kv_caches]),
    )


def _check_padded(r: dict, tol: float = 1e-5) -> None:
    n, q = r["n"], r["q"]
    assert r["padded"].shape[0] > n
    torch.testing.assert_close(r["padded"][:n], r["plain"], rtol=tol, atol=tol)
    assert r["same_tokens"] and torch.isfinite(r["padded"]).all()
    before, after_plain, after_padded = r["caches"]
    for b, a_plain, a_padded in zip(before, after_plain, after_padded):
        torch.testing.assert_close(a_padded[:, NULL_BLOCK + 1 :], a_plain[:, NULL_BLOCK + 1 :], rtol=tol, atol=tol)
        # The null block: padding writes slots 0 .. q-1, never the rest.
        assert torch.equal(a_padded[:, NULL_BLOCK, q:], b[:, NULL_BLOCK, q:])
        assert not torch.equal(a_padded[:, NULL_BLOCK, :q], b[:, NULL_BLOCK, :q])
        assert torch.equal(a_plain[:, NULL_BLOCK], b[:, NULL_BLOCK])


@pytest.mark.parametrize(("drafts", "bucket"), [(1, 4), (3, 8)])
def test_padded_verify_step_gives_the_real_rows_the_unpadded_result(drafts: int, bucket: int) -> None:
    runner = _runner()
    _prefill(runner, PROMPTS[:3])
    _check_padded(_padded_vs_unpadded(runner, _verify_inputs(runner, drafts), bucket))


def _lora_runner(tmp: str, max_loras: int = 3):
    llama = get_checkpoint("llama")
    runner = _runner(enable_lora=True, max_loras=max_loras, max_lora_rank=8, max_cpu_loras=4)
    loras = [
        LoRARequest(f"a{i}", i + 1, build_lora_adapter(llama, os.path.join(tmp, f"a{i}"), AdapterSpec(8, 16, seed=i)))
        for i in range(3)
    ]
    return runner, loras


@pytest.mark.parametrize("drafts", [0, 2])
def test_padded_lora_step_gives_the_real_rows_the_unpadded_result(tmp_path, drafts: int) -> None:
    runner, loras = _lora_runner(str(tmp_path))
    _prefill(runner, PROMPTS[:3], [loras[0], None, loras[2]])
    r = _padded_vs_unpadded(runner, _verify_inputs(runner, drafts), 8, lora=True)
    _check_padded(r)
    slots = runner.lora_manager.step_token_slots  # the real tokens' slots: two adapters and none
    assert slots is not None and len(slots) == 3 * (1 + drafts) and (slots[1 + drafts : 2 * (1 + drafts)] == -1).all()
    assert len(set(slots.tolist())) == 3
    runner.lora_manager.prepare_step(np.zeros(3, dtype=np.int64), np.full(3, 1 + drafts))
    assert runner.lora_manager.step_token_slots is None  # no adapter: the graphs then run every slot -1


# ---------------------------------------------------------------------------------------------- stand-in replay
def _install_stand_ins(llm, keys: list[tuple[int, int]], lora: bool = False) -> tuple[CudaDecodeGraphs, list]:
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    replays: list = []
    return install_stand_in_graphs(runner, keys, lora, replays), replays


def _greedy(llm, prompts, max_tokens: int = 24, loras=None) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_ngram_engine_replays_verify_graphs_with_the_eager_tokens(monkeypatch) -> None:
    from vllm_lite.entrypoints.llm import LLM

    monkeypatch.setattr(SpecDecodeStep, "gain_rule", False)  # drafts at batch 2 too (uniform: identical prompts)
    kw = dict(model=get_checkpoint("llama"), device="cpu", dtype="float32", max_model_len=128, multiprocess=False)
    with LLM(speculative_config=NGRAM, **kw) as llm:
        single = [_greedy(llm, [p]) for p in REPEATING]
        pair = _greedy(llm, [REPEATING[0], REPEATING[0]])
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        keys = resolve_graph_keys([1, 2, 4], 3, runner.max_num_tokens)
        _, replays = _install_stand_ins(llm, keys)
        assert [_greedy(llm, [p]) for p in REPEATING] == single
        assert _greedy(llm, [REPEATING[0], REPEATING[0]]) == pair
    verify = [k for k in replays if k[1] > 1]
    assert verify, replays  # drafts were verified through the graphs
    assert {k[0] for k in verify} >= {1, 2} and (1, 1) in replays


def test_lora_engine_replays_graphs_with_the_eager_tokens(tmp_path) -> None:
    from vllm_lite.entrypoints.llm import LLM

    llama = get_checkpoint("llama")
    loras = [
        LoRARequest(f"a{i}", i + 1, build_lora_adapter(llama, str(tmp_path / f"a{i}"), AdapterSpec(8, 16, seed=i)))
        for i in range(3)
    ]
    which = [loras[0], None, loras[1], loras[2], loras[0]]
    prompts = [REPEATING[i % 3][: 5 + i] for i in range(len(which))]
    kw = dict(model=llama, device="cpu", dtype="float32", max_model_len=128, multiprocess=False)
    with LLM(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3, **kw) as llm:
        # max_loras=2 for 3 adapters: slots are reloaded between batches (in place: the graphs keep their tensors).
        eager = _greedy(llm, prompts[:2], loras=which[:2]) + _greedy(llm, prompts[2:4], loras=which[2:4])
        alone = _greedy(llm, prompts[1:2], loras=[None])
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        layers = list(runner.lora_manager.layers.values())
        ptrs = [(w.lora_a.data_ptr(), *(b.data_ptr() for b in w.lora_b)) for w in layers]
        g, replays = _install_stand_ins(llm, [(4, 1), (2, 1), (1, 1)], lora=True)
        assert g.lora_slots is not None and g.lora_slots.dtype == torch.int32
        got = _greedy(llm, prompts[:2], loras=which[:2]) + _greedy(llm, prompts[2:4], loras=which[2:4])
        assert got == eager
        assert _greedy(llm, prompts[1:2], loras=[None]) == alone  # no adapter in the step: every slot -1
        assert [(w.lora_a.data_ptr(), *(b.data_ptr() for b in w.lora_b)) for w in layers] == ptrs
    assert len(replays) >= 3 * 23 and set(replays) <= {(2, 1), (1, 1)}


class _FakeCudaApi:
    """torch.cuda's graph API stood in on CPU (as in test_cuda_graphs.py): capture's control flow without a GPU."""

    def __init__(self, monkeypatch) -> None:
        self.captures = 0
        api = self

        class Stream:
            def wait_stream(self, other) -> None:
                pass

        class Capture:
            def __init__(self, graph, pool=None) -> None:
                pass

            def __enter__(self) -> None:
                api.captures += 1

            def __exit__(self, *exc) -> None:
                pass

        class SideStream:
            def __init__(self, stream) -> None:
                pass

            def __enter__(self) -> None:
                pass

            def __exit__(self, *exc) -> None:
                pass

        for name, value in {
            "synchronize": lambda device=None: None,
            "empty_cache": lambda: None,
            "mem_get_info": lambda device=None: (10 << 30, 80 << 30),
            "graph_pool_handle": lambda: "pool",
            "Stream": lambda device=None: Stream(),
            "current_stream": lambda device=None: Stream(),
            "set_stream": lambda stream: None,
            "stream": SideStream,
            "CUDAGraph": lambda: object(),
            "graph": Capture,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)


def test_capture_of_verify_and_lora_keys_with_a_stand_in_cuda_api(monkeypatch, tmp_path) -> None:
    """Most tokens first; every captured forward reads the persistent slot buffer (all -1: no adapter) through the
    LoRA layers and touches only the null block's first q_max slots; the slots are unset afterwards."""
    runner, _ = _lora_runner(str(tmp_path))
    api = _FakeCudaApi(monkeypatch)
    state = runner.lora_manager.state
    keys = resolve_graph_keys([1, 2], num_speculative_tokens=2, max_num_batched_tokens=256)
    g = CudaDecodeGraphs(
        runner.model, runner.backend, runner.device, [1, 2], BLOCK_SIZE, BLOCKS_PER_REQ, runner.max_model_len,
        keys=keys, lora_state=state,
    )  # fmt: skip
    seen: list[tuple] = []
    model = g.model

    def recording_model(ids, pos):
        slots = state.token_slots
        seen.append((len(ids), slots is not None and slots.data_ptr() == g.lora_slots.data_ptr(), int(slots.max())))
        return model(ids, pos)

    g.model = recording_model  # type: ignore[assignment]
    g.capture()
    # Warm-up then capture of each: (2,3) (2,2) (1,3) (2,1) (1,2) (1,1).
    assert [n for n, _, _ in seen] == [6, 6, 4, 4, 3, 3, 2, 2, 2, 2, 1, 1]
    assert all(is_buffer and top == -1 for _, is_buffer, top in seen)
    assert api.captures == 6 and state.token_slots is None
    assert {k: tuple(o.shape) for k, o in g.outputs.items()} == {(b, q): (b * q, 64) for b, q in keys}
    assert all(torch.count_nonzero(c[:, NULL_BLOCK + 1 :]) == 0 for c in runner.kv_caches)
    assert all(torch.count_nonzero(c[:, NULL_BLOCK, 3:]) == 0 for c in runner.kv_caches)  # q_max = 3 slots at most
    line = g.describe()
    assert "captured 2 decode batch sizes [1, 2], verify steps q=2..3 at batch sizes [1, 2]" in line
    assert "LoRA slots in the graphs" in line and "6 graphs" in line


# ---------------------------------------------------------------------------------------------- Triton interpreter
def _triton_verify_check() -> dict:
    """The padded verify-step check through the Triton attention kernels (run under TRITON_INTERPRET=1)."""
    from vllm_lite.worker.attention.triton_attn import TritonBackend

    runner = _runner()
    runner.backend = TritonBackend()
    _prefill(runner, PROMPTS[:3])
    r = _padded_vs_unpadded(runner, _verify_inputs(runner, 3), 4)  # q = 4: BLOCK_M 16 with the model's GQA
    n, q = r["n"], r["q"]
    before, after_plain, after_padded = r["caches"]
    return dict(
        hidden_diff=float((r["padded"][:n] - r["plain"]).abs().max()),
        same_tokens=r["same_tokens"],
        finite=bool(torch.isfinite(r["padded"]).all()),
        real_blocks_diff=max(float((a[:, 1:] - p[:, 1:]).abs().max()) for a, p in zip(after_plain, after_padded)),
        null_rest_same=all(torch.equal(p[:, 0, q:], b[:, 0, q:]) for p, b in zip(after_padded, before)),
    )


def _triton_add_lora(y0, x, lora_a, lora_b, slots) -> torch.Tensor:
    """y0 + every sub-projection's delta as a CUDA layer runs it (ops.add_lora_triton), slots declared as a
    captured forward declares them."""
    from vllm_lite.lora import ops, triton_ops

    y, offsets = y0.clone(), np.cumsum([0] + [b.shape[1] for b in lora_b])
    triton_ops.set_step_slots(slots)
    try:
        ops.add_lora_triton(triton_ops, y, x, lora_a, lora_b, [int(o) for o in offsets[:-1]], slots)
    finally:
        triton_ops.set_step_slots(None)
    return y


def _triton_lora_check() -> dict:
    """The Triton LoRA kernels on a padded token batch (slots -1 on padding) against the unpadded one: BGMV
    (<= 16 tokens) and SGMV (with the step's grouping declared on a buffer slice, as a captured forward does)."""
    g = torch.Generator().manual_seed(0)
    slots_total, rank, d_in, outs = 3, 8, 64, [48, 16, 16]  # three subs (q/k/v): strided views of the buffer
    lora_a = torch.randn(slots_total, len(outs) * rank, d_in, generator=g) / 8
    lora_b = [torch.randn(slots_total, o, rank, generator=g) / 4 for o in outs]
    res = {}
    for real, padded_to in ((5, 8), (21, 32)):
        x = torch.randn(padded_to, d_in, generator=g)
        y0 = torch.randn(padded_to, sum(outs), generator=g)
        slots = torch.full((padded_to,), -1, dtype=torch.int32)
        slots[:real] = torch.tensor([(i % 4) - 1 for i in range(real)], dtype=torch.int32)  # -1, 0, 1, 2, ...

        plain = _triton_add_lora(y0[:real], x[:real], lora_a, lora_b, slots[:real])
        padded = _triton_add_lora(y0, x, lora_a, lora_b, slots)
        ref = y0[:real].clone()
        for t in range(real):
            s = int(slots[t])
            if s >= 0:
                h = lora_a[s] @ x[t]
                for i, (b, off) in enumerate(zip(lora_b, np.cumsum([0, *outs[:-1]]).tolist())):
                    ref[t, off : off + b.shape[1]] += b[s] @ h[i * rank : (i + 1) * rank]
        res[f"T{padded_to}"] = dict(
            real_diff=float((padded[:real] - plain).abs().max()),
            ref_diff=float((plain - ref).abs().max()),
            padding_untouched=bool(torch.equal(padded[real:], y0[real:])),
        )
    return res


def _in_interpreter(flag: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, __file__, flag], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def test_padded_verify_step_through_the_triton_kernels_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    res = _in_interpreter("--triton-verify-check")
    assert res["hidden_diff"] < 1e-4 and res["same_tokens"] and res["finite"], res
    assert res["real_blocks_diff"] < 1e-4 and res["null_rest_same"], res


def test_padded_lora_tokens_through_the_triton_kernels_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    res = _in_interpreter("--triton-lora-check")
    for name, r in res.items():  # T8: BGMV, T32: SGMV
        assert r["real_diff"] < 1e-5 and r["ref_diff"] < 1e-4 and r["padding_untouched"], (name, r)


# ---------------------------------------------------------------------------------------------- CUDA
def _cuda_llm(eager: bool, **kwargs):
    from vllm_lite.entrypoints.llm import LLM

    kw = {"max_num_seqs": 8, **kwargs}
    return LLM(
        model=get_checkpoint("llama"),
        dtype="float32",
        device="cuda",
        max_model_len=256,
        multiprocess=False,
        enforce_eager=eager,
        gpu_memory_utilization=0.15,
        **kw,
    )


def _count_replays(graphs: CudaDecodeGraphs) -> list[tuple[int, int]]:
    """Wrap graphs.run: the (requests, q) of every step that replayed."""
    replays: list[tuple[int, int]] = []
    real_run = graphs.run

    def counting_run(inputs, *args, **kwargs):  # whatever else run takes (LoRA slots, async input fix) passes through
        out = real_run(inputs, *args, **kwargs)
        if out is not None:
            replays.append((inputs.num_reqs, int(inputs.num_scheduled[0])))
        return out

    graphs.run = counting_run  # type: ignore[method-assign]
    return replays


@needs_cuda
def test_cuda_ngram_greedy_tokens_identical_with_and_without_verify_graphs(caplog) -> None:
    batch = [REPEATING[0], REPEATING[0]]  # identical requests: the same drafts, a uniform verify step at batch 2
    with _cuda_llm(True, speculative_config=NGRAM) as llm:
        eager = [_greedy(llm, [p], 40) for p in REPEATING]
        eager_pair = _greedy(llm, batch, 40)
    with caplog.at_level(logging.INFO, logger="vllm_lite.worker.model_runner"):
        llm = _cuda_llm(False, speculative_config=NGRAM)
    with llm:
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        graphs = runner.cuda_graphs
        assert graphs is not None, [r.getMessage() for r in caplog.records]
        assert sizes_by_query_len(list(graphs.graphs)) == {q: [1, 2, 4, 8] for q in (1, 2, 3, 4)}
        assert any("verify steps q=2..4" in r.getMessage() for r in caplog.records)
        replays = _count_replays(graphs)
        assert [_greedy(llm, [p], 40) for p in REPEATING] == eager
        assert _greedy(llm, batch, 40) == eager_pair
    verify = [r for r in replays if r[1] > 1]
    assert len(verify) >= 5 and {n for n, _ in verify} >= {1}, replays  # drafts verified by replaying graphs


@needs_cuda
def test_cuda_lora_greedy_tokens_identical_with_and_without_graphs(tmp_path, caplog) -> None:
    """20 requests over 3 adapters and none: decode steps replay bucket 24 (the SGMV kernels, their slot grouping
    captured), a lone request without an adapter bucket 1 (BGMV, every slot -1)."""
    llama = get_checkpoint("llama")
    loras = [
        LoRARequest(f"a{i}", i + 1, build_lora_adapter(llama, str(tmp_path / f"a{i}"), AdapterSpec(8, 16, seed=i)))
        for i in range(3)
    ]
    which = [loras[0], None, loras[1], loras[2]] * 5
    prompts = [[(7 * i + j) % 500 + 3 for j in range(3 + (5 * i) % 29)] for i in range(len(which))]
    lora_kw = dict(enable_lora=True, max_loras=3, max_lora_rank=8, max_cpu_loras=3, max_num_seqs=24)
    with _cuda_llm(True, **lora_kw) as llm:
        eager = _greedy(llm, prompts, loras=which)
        eager_base = _greedy(llm, prompts[1:2], loras=[None])
        eager_one = _greedy(llm, prompts[2:3], loras=which[2:3])
    with caplog.at_level(logging.INFO, logger="vllm_lite.worker.model_runner"):
        llm = _cuda_llm(False, **lora_kw)
    with llm:
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        graphs = runner.cuda_graphs
        assert graphs is not None and graphs.lora_slots is not None, [r.getMessage() for r in caplog.records]
        assert any("LoRA slots in the graphs" in r.getMessage() for r in caplog.records)
        replays = _count_replays(graphs)
        assert _greedy(llm, prompts, loras=which) == eager
        assert _greedy(llm, prompts[1:2], loras=[None]) == eager_base  # no adapter: every slot -1 in the graph
        assert _greedy(llm, prompts[2:3], loras=which[2:3]) == eager_one
    assert len(replays) >= 40 and (20, 1) in replays and (1, 1) in replays, replays


if __name__ == "__main__":
    torch.set_num_threads(1)
    checks = {"--triton-verify-check": _triton_verify_check, "--triton-lora-check": _triton_lora_check}
    print(json.dumps(checks[sys.argv[1]]()))
