"""LLM(num_threads=N, multiprocess=False): the in-process engine computes on N torch threads (as a private core
process does), and shutdown() gives the caller its own count back. Run in a child interpreter: torch's thread
count is process-wide, and this process's is not touched."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = """
import json, torch
from vllm_lite import LLM, SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint

torch.set_num_threads(3)
args = dict(model=get_checkpoint("llama"), dtype="float32", device="cpu", multiprocess=False, max_model_len=64)
llm = LLM(num_threads=1, **args)
model = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
during = []
model.register_forward_pre_hook(lambda module, inputs: during.append(torch.get_num_threads()))
out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
tokens = len(out[0].outputs[0].token_ids)
llm.shutdown()
after = torch.get_num_threads()
default = LLM(**args)  # no num_threads: this process's count is left alone
untouched = torch.get_num_threads()
default.shutdown()
try:
    LLM(num_threads=2, **dict(args, model="/nonexistent/checkpoint"))
except Exception:
    pass
after_failure = torch.get_num_threads()
print(json.dumps(dict(during=sorted(set(during)), tokens=tokens, after=after, untouched=untouched,
                      after_failure=after_failure)))
"""


def test_inprocess_engine_runs_on_num_threads_and_restores_the_callers_count():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["tokens"] == 3 and got["during"] == [1], got  # every forward on the 1 thread asked for
    assert got["after"] == 3 and got["untouched"] == 3 and got["after_failure"] == 3, got
