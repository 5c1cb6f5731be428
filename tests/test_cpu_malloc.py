"""The CPU malloc policy (worker/cpu_malloc.py) is in force in the process that runs the model.

Each case runs in its own interpreter: the policy changes process-wide glibc malloc state that cannot be put back.
The probe is glibc's own accounting (mallinfo2): a 100 MiB block is mmapped and unmapped on free under glibc's
defaults, and comes from the heap and stays there after free under the policy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None, reason="glibc malloc only"
)

SCRIPT = textwrap.dedent(
    """
    import ctypes, json, sys

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    SIZE = 100 << 20

    def probe():
        before = libc.mallinfo2()
        p = libc.malloc(SIZE)
        held = libc.mallinfo2()
        libc.free(p)
        after = libc.mallinfo2()
        return {"mmapped": held.hblkhd - before.hblkhd >= SIZE, "kept_after_free": after.fordblks >= SIZE}

    from vllm_lite import LLM, SamplingParams
    from vllm_lite.testing.checkpoints import get_checkpoint

    result = {"before_engine": probe()}
    llm = LLM(model=get_checkpoint("llama"), dtype="float32", max_model_len=64, multiprocess=False)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False)
    result["tokens"] = len(out[0].outputs[0].token_ids)
    result["with_engine"] = probe()
    llm.shutdown()
    print("RESULT " + json.dumps(result), flush=True)
    """
)


def _run(policy: str) -> dict:
    env = dict(os.environ, VLLM_LITE_CPU_MALLOC_POLICY=policy)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_cpu_engine_process_keeps_large_blocks_on_the_heap():
    got = _run("1")
    assert got["tokens"] == 4
    # glibc's defaults before the engine starts (so the probe can tell the two apart) ...
    assert got["before_engine"] == {"mmapped": True, "kept_after_free": False}
    # ... and the policy once an in-process CPU engine runs the model in this process.
    assert got["with_engine"] == {"mmapped": False, "kept_after_free": True}


def test_policy_off_leaves_malloc_alone():
    got = _run("0")
    assert got["tokens"] == 4
    assert got["with_engine"] == {"mmapped": True, "kept_after_free": False}
