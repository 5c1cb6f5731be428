"""The engine core in its own process gives exactly what the in-process core gives."""

from __future__ import annotations

from vllm_lite import LLM, SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint


def _workload(llm: LLM, stop: str):
    prompts = ["The for statement", "Exceptions are raised", "A class definition", "def main():"] * 3
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=7, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=16, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=32, stop=[stop], ignore_eos=True),
    ] * 3
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs
    ]


def _same(a, b) -> bool:
    """Tokens, text and reasons exactly; logprobs within 1e-5 (float32 kernels may round apart by an ulp)."""
    for ra, rb in zip(a, b, strict=True):
        for ca, cb in zip(ra, rb, strict=True):
            if ca[:5] != cb[:5] or (ca[5] is None) != (cb[5] is None):
                return False
            for da, db in zip(ca[5] or [], cb[5] or [], strict=True):
                if da.keys() != db.keys() or any(abs(da[t].logprob - db[t].logprob) > 1e-5 for t in da):
                    return False
    return True


def test_multiprocess_outputs_equal_inprocess_outputs() -> None:
    path = get_checkpoint("llama")
    kw = dict(dtype="float32", max_model_len=256, num_threads=1)
    with LLM(model=path, multiprocess=False, **kw) as llm:
        # A stop string the greedy continuation of "def main():" really contains, mid-text.
        probe = (
            llm.generate(
                "def main():", SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False
            )[0]
            .outputs[0]
            .text
        )
        stop = probe[len(probe) // 2 : len(probe) // 2 + 3]
        inproc = _workload(llm, stop)
    with LLM(model=path, multiprocess=True, **kw) as llm:
        mp = _workload(llm, stop)
    assert _same(mp, inproc)
    assert any(c[3] == "stop" and c[4] == stop for o in inproc for c in o)  # the stop string path ran
