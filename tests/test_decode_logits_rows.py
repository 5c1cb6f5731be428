"""A decode step (one token a request, every request samples) hands the LM head its hidden states as they are: no
index tensor copied to the device and no gather of the rows (counted on CPU through the CUDA-graph replay path
with stand-in graphs, as tests/test_step_op_budget.py counts), and the tokens are those of the eager path."""

from __future__ import annotations

from vllm_lite import SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.device_ops import count_steps, install_stand_in_graphs

PROMPTS = [[11, 12, 13, 14, 15] * 4, [21, 22, 23], [31, 32, 33, 34, 35, 36, 37]]


def _run(graphs: bool) -> tuple[list, list[list[int]]]:
    from vllm_lite.entrypoints.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(
        model=get_checkpoint("llama"), device="cpu", dtype="float32", max_model_len=256, multiprocess=False
    ) as llm:
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        if graphs:
            install_stand_in_graphs(runner, [(b, 1) for b in (1, 2, 4)])
        with count_steps(runner, where=True) as records:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return records, [list(o.outputs[0].token_ids) for o in outs]


def test_decode_step_reads_hidden_rows_in_place() -> None:
    records, tokens = _run(graphs=True)
    decodes = [r for r in records if r.kind == "decode"]
    assert decodes
    for r in decodes:
        assert r.h2d == 0, r.ops  # no logits index moved to the device
        assert not any(op.startswith(("aten.index.", "aten.index_select")) for op in r.ops), r.ops
    _, eager = _run(graphs=False)
    assert tokens == eager
