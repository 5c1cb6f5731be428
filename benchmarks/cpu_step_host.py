"""Per decode step of an in-process LLM on CPU: the model forward, the LM head's matmul, and everything else (the
runner's host work and the sampler, the logits' float32 copy included where there is one), batch 32 (vs_vllm's
workload: bench Qwen2 ~128M, bf16, 32 prompts of 32-256 tokens, 128 greedy tokens) and batch 1 (a 128-token prompt).

"host_and_sampler" is a step's execute_model less the model's forward and less the LM-head kernel calls made outside
the forward (cpu_prepack's VNNI / small-m ops), so it compares trees whose LM head returns float32 logits and trees
that hand bfloat16 ones to the sampler alike. Also per-part medians (build_step_inputs, record_sampled, ...) and a
hash of the greedy tokens (the same tree gives the same hash). Compare trees in alternating processes:

    for t in base new new base; do PYTHONPATH=$t python benchmarks/cpu_step_host.py; done
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from vs_vllm import make_prompts  # noqa: E402

import vllm_lite.worker.input_batch as ibm  # noqa: E402
import vllm_lite.worker.model_runner as mr  # noqa: E402
import vllm_lite.worker.models.cpu_prepack as cpp  # noqa: E402
import vllm_lite.worker.sampler as smp  # noqa: E402
import vllm_lite.worker.step_inputs as sim  # noqa: E402
from vllm_lite import LLM, SamplingParams  # noqa: E402
from vllm_lite.testing.baselines import bench_json  # noqa: E402
from vllm_lite.testing.checkpoints import get_checkpoint  # noqa: E402

pc = time.perf_counter
times: dict[tuple[int, str], list[float]] = defaultdict(list)
cur: dict[str, float] = {}
inside = [False]


def timed(f, key):
    def w(*a, **k):
        t0 = pc()
        r = f(*a, **k)
        cur[key] = cur.get(key, 0.0) + pc() - t0
        return r

    return w


def lm_head_kernel(f):
    def w(*a, **k):
        if inside[0]:
            return f(*a, **k)
        t0 = pc()
        r = f(*a, **k)
        cur["lm_head_mm"] = cur.get("lm_head_mm", 0.0) + pc() - t0
        return r

    return w


def install() -> None:
    cpp._vnni_op = lm_head_kernel(cpp._vnni_op)
    cpp._small_m_op = lm_head_kernel(cpp._small_m_op)
    runner = mr.GPUModelRunner
    for name in ("_update_states", "_req_id_to_index"):
        setattr(runner, name, timed(getattr(runner, name), name))
    mr.build_step_inputs = timed(mr.build_step_inputs, "build_step_inputs")
    mr._build_output = timed(mr._build_output, "_build_output")
    sim.StepInputs.to_device = timed(sim.StepInputs.to_device, "to_device")
    ibm.InputBatch.sampling_metadata = timed(ibm.InputBatch.sampling_metadata, "sampling_metadata")
    ibm.InputBatch.record_sampled = timed(ibm.InputBatch.record_sampled, "record_sampled")
    smp.Sampler.forward = timed(smp.Sampler.forward, "sampler")
    execute = runner.execute_model

    def step(self, so, non_block=False):
        if not getattr(self, "_timed_forward", False):
            self._timed_forward = True
            forward = self.model.forward

            def model_forward(*a, **k):
                inside[0] = True
                t0 = pc()
                try:
                    return forward(*a, **k)
                finally:
                    cur["model"] = cur.get("model", 0.0) + pc() - t0
                    inside[0] = False

            self.model.forward = model_forward
        cur.clear()
        t0 = pc()
        out = execute(self, so, non_block)
        total = pc() - t0
        n = so.total_num_scheduled_tokens
        if n == len(so.num_scheduled_tokens) and n > 0:  # a decode step
            cur["total"] = total
            cur["host_and_sampler"] = total - cur.get("model", 0.0) - cur.get("lm_head_mm", 0.0)
            for k, v in cur.items():
                times[(n, k)].append(v)
        return out

    runner.execute_model = step


def main() -> None:
    install()
    model = get_checkpoint("qwen2", size="100m")
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    llm = LLM(model=model, dtype="auto", max_model_len=512, max_num_seqs=64, multiprocess=False)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [11, 12, 13]}], SamplingParams(max_tokens=2), use_tqdm=False)
    times.clear()
    outs = llm.generate([{"prompt_token_ids": q} for q in make_prompts(32, 32, 256, vocab, 0)], params, use_tqdm=False)
    tokens = [hash(tuple(tuple(o.outputs[0].token_ids) for o in outs)) % 10**8]
    outs = llm.generate([{"prompt_token_ids": list(range(100, 228))}], params, use_tqdm=False)
    tokens.append(hash(tuple(outs[0].outputs[0].token_ids)) % 10**8)
    result = {"tree": os.path.dirname(os.path.dirname(mr.__file__)), "load": os.getloadavg()[0], "tokens": tokens}
    for batch in (32, 1):
        parts = {k: round(1e3 * statistics.median(v), 3) for (b, k), v in sorted(times.items()) if b == batch}
        result[f"b{batch}_ms"] = {"steps": len(times[(batch, "total")]), **parts}
    print(bench_json(result))
    llm.shutdown()


if __name__ == "__main__":
    main()
