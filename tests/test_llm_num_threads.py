"""num_threads=N on an in-process engine (LLM(multiprocess=False), LLMEngine(multiprocess_mode=False): both run
through InprocClient, which owns the rule): the engine computes on N torch threads (as a private core process
does), and shutdown(), collection of an engine never shut down, or a failed start gives the caller its own count
back. Run in child interpreters: torch's thread count is process-wide, and this process's is not touched."""

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


ENGINE_CHILD = """
import gc, json, torch
from vllm_lite.client.llm_engine import LLMEngine
from vllm_lite.engine_args import EngineArgs
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint

torch.set_num_threads(3)
args = dict(model=get_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=64)


def start(**kw):
    return LLMEngine.from_engine_args(EngineArgs(**args, **kw), multiprocess_mode=False)


engine = start(num_threads=1)
model = engine.engine_core.engine_core.executor.worker.model_runner.model
during = []
model.register_forward_pre_hook(lambda module, inputs: during.append(torch.get_num_threads()))
engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, temperature=0.0))
tokens = 0
while engine.has_unfinished_requests():
    tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
second = start(num_threads=2)  # two in-process engines at once: the one started last sets the count
overlapping = torch.get_num_threads()
engine.shutdown()
second_still = torch.get_num_threads()  # the second still holds it
del second  # never shut down: collected, it gives the count back
gc.collect()
after_collected = torch.get_num_threads()
default = start()  # no num_threads: this process's count is left alone
untouched = torch.get_num_threads()
default.shutdown()
failed = ""
try:
    start(num_threads=2, kv_cache_memory_bytes=1)  # fails inside the in-process engine core, after the threads are set
except Exception as e:
    failed = str(e)
    after_failure = torch.get_num_threads()  # at once: the failed client is not collected yet (the traceback holds it)
print(json.dumps(dict(during=sorted(set(during)), tokens=tokens, overlapping=overlapping, second_still=second_still,
                      after_collected=after_collected, untouched=untouched, failed=failed,
                      after_failure=after_failure)))
"""


def test_in_process_llm_engine_runs_on_num_threads_and_gives_them_back_on_shutdown_collection_and_failure():
    proc = subprocess.run([sys.executable, "-c", ENGINE_CHILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["tokens"] == 3 and got["during"] == [1], got
    assert got["overlapping"] == 2 and got["second_still"] == 2, got
    assert got["after_collected"] == 3 and got["untouched"] == 3, got
    assert "KV cache" in got["failed"] and got["after_failure"] == 3, got
