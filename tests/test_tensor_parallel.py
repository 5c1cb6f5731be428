"""Tensor parallelism: sharded layers against their unsharded selves, TP=2 engines against TP=1, worker death.

Layer tests emulate the ranks in this process (build each rank's shard, combine
the partial results the way the collective would). Engine tests spawn real
worker processes over gloo.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from typing import Any

import pytest
import torch

from vllm_lite import LLM, SamplingParams, launcher
from vllm_lite.client.exceptions import EngineDeadError
from vllm_lite.engine_args import EngineArgs
from vllm_lite.testing.checkpoints import ARCHS, get_checkpoint
from vllm_lite.testing.devices import requires_cuda_devices
from vllm_lite.testing.processes import process_gone, rank_children
from vllm_lite.testing.waiting import wait_until
from vllm_lite.worker import parallel_state
from vllm_lite.worker.models.parallel_linear import MergedLinear, QKVLinear, RowParallelLinear
from vllm_lite.worker.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

PROMPTS = [
    "The quick brown fox jumps over",
    "def fibonacci(n):\n    return",
    "In the beginning there was a long prompt that spans more than one KV block of sixteen tokens, so",
]
# CPU ranks (gloo) run everywhere; the CUDA variants need one device per rank.
ENGINE_KW = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 24, max_num_seqs=8, device="cpu")
# Generous: a loaded 2-core machine only makes these tests slower, never wrong.
DEADLINE_S = 120.0


@pytest.fixture(autouse=True)
def _reset_tp_state():
    yield
    parallel_state.set_tp_state_for_testing(0, 1)


def _as_rank(rank: int, size: int) -> None:
    parallel_state.set_tp_state_for_testing(rank, size)


# ---------------------------------------------------------------------------- layers, ranks emulated


@pytest.mark.parametrize("tp", [2, 4])
def test_qkv_shards_hold_each_ranks_heads_and_replicate_kv_heads_when_fewer_than_ranks(tp):
    hidden, head_dim, heads, kv_heads = 32, 8, 4, 2
    g = torch.Generator().manual_seed(0)
    wq, wk, wv = (torch.randn(n * head_dim, hidden, generator=g) for n in (heads, kv_heads, kv_heads))
    bq, bk, bv = (torch.randn(n * head_dim, generator=g) for n in (heads, kv_heads, kv_heads))
    x = torch.randn(5, hidden, generator=g)
    full = QKVLinear(hidden, head_dim, heads, kv_heads, bias=True)
    for sid, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
        full.weight_loader(full.weight, w, sid)
        full.weight_loader(full.bias, b, sid)
    q_full, k_full, v_full = (t.view(5, -1, head_dim) for t in full.split(full(x)))
    for rank in range(tp):
        _as_rank(rank, tp)
        part = QKVLinear(hidden, head_dim, heads, kv_heads, bias=True)
        for sid, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            part.weight_loader(part.weight, w, sid)
            part.weight_loader(part.bias, b, sid)
        q, k, v = (t.view(5, -1, head_dim) for t in part.split(part(x)))
        q_per = heads // tp
        assert part.num_heads == q_per and part.num_kv_heads == max(1, kv_heads // tp)
        torch.testing.assert_close(q, q_full[:, rank * q_per : (rank + 1) * q_per])
        # The KV heads this rank holds are the ones its query heads attend with (GQA groups).
        group = heads // kv_heads
        want_kv = sorted({h // group for h in range(rank * q_per, (rank + 1) * q_per)})
        torch.testing.assert_close(k, k_full[:, want_kv])
        torch.testing.assert_close(v, v_full[:, want_kv])


def test_row_parallel_partials_sum_to_the_full_product_with_bias_added_once():
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(6, 8, generator=g), torch.randn(6, generator=g), torch.randn(3, 8, generator=g)
    want = torch.nn.functional.linear(x, w, b)
    total = torch.zeros_like(want)
    for rank in range(2):
        _as_rank(rank, 2)
        layer = RowParallelLinear(8, 6, bias=True)
        layer.load_weight(layer.weight, w)
        layer.load_weight(layer.bias, b)
        total += torch.nn.functional.linear(x[:, rank * 4 : (rank + 1) * 4], layer.weight)  # what each rank adds
    torch.testing.assert_close(total + layer.bias, want)


def test_merged_gate_up_shards_split_each_projection_by_rank():
    g = torch.Generator().manual_seed(2)
    gate, up, x = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g), torch.randn(2, 4, generator=g)
    for rank in range(2):
        _as_rank(rank, 2)
        layer = MergedLinear(4, [8, 8], False, [0, 1])
        layer.weight_loader(layer.weight, gate, 0)
        layer.weight_loader(layer.weight, up, 1)
        out = layer(x)
        torch.testing.assert_close(out[:, :4], x @ gate[rank * 4 : (rank + 1) * 4].T)
        torch.testing.assert_close(out[:, 4:], x @ up[rank * 4 : (rank + 1) * 4].T)


def test_vocab_parallel_embedding_and_lm_head_cover_an_uneven_vocab():
    vocab, dim, tp = 11, 4, 2  # 6 + 5 rows: the last shard is padded
    g = torch.Generator().manual_seed(3)
    table, ids, h = torch.randn(vocab, dim, generator=g), torch.arange(vocab), torch.randn(3, dim, generator=g)
    emb_sum = torch.zeros(vocab, dim)
    logits = []
    for rank in range(tp):
        _as_rank(rank, tp)
        emb = VocabParallelEmbedding(vocab, dim)
        emb.load_weight(emb.weight, table)
        outside = (ids < emb.vocab_start) | (ids >= emb.vocab_end)
        local = (ids - emb.vocab_start).masked_fill(outside, 0)
        emb_sum += torch.nn.functional.embedding(local, emb.weight).masked_fill(outside[:, None], 0)
        head = ParallelLMHead(vocab, dim)
        head.load_weight(head.weight, table)
        logits.append(h @ head.weight.T)
    torch.testing.assert_close(emb_sum, table)
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :vocab], h @ table.T)


def test_rank_loads_only_its_shard_of_the_checkpoint():
    from safetensors.torch import load_file

    from vllm_lite.worker.model_loader import load_model, safetensors_files

    path = get_checkpoint("llama")
    ckpt = {}
    for f in safetensors_files(path):
        ckpt.update(load_file(f))
    config = EngineArgs(model=path, dtype="float32").create_engine_config().model_config
    _as_rank(1, 2)
    model = load_model(config, torch.device("cpu"))
    attn = model.model.layers[0].self_attn
    assert attn.num_heads == 2 and attn.num_kv_heads == 1
    torch.testing.assert_close(attn.o_proj.weight, ckpt["model.layers.0.self_attn.o_proj.weight"][:, 32:])
    q, k, _ = attn.qkv_proj.weight.split([32, 16, 16])
    torch.testing.assert_close(q, ckpt["model.layers.0.self_attn.q_proj.weight"][32:])
    torch.testing.assert_close(k, ckpt["model.layers.0.self_attn.k_proj.weight"][16:])
    torch.testing.assert_close(model.model.embed_tokens.weight, ckpt["model.embed_tokens.weight"][1000:])
    torch.testing.assert_close(
        model.model.layers[0].mlp.down_proj.weight, ckpt["model.layers.0.mlp.down_proj.weight"][:, 64:]
    )


# ---------------------------------------------------------------------------- engines


Generation = tuple[list[int], list[list[int]], list[list[float]]]


def _greedy(llm: LLM) -> list[Generation]:
    """Per prompt: the tokens, and per step the logprob entries' token ids and values (in token-id order)."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
    res = []
    for o in outs:
        c = o.outputs[0]
        steps = [sorted(step.items()) for step in c.logprobs]
        res.append(
            (
                list(c.token_ids),
                [[tid for tid, _ in st] for st in steps],
                [[lp.logprob for _, lp in st] for st in steps],
            )
        )
    return res


def _assert_same_generations(got: list[Generation], want: list[Generation]) -> None:
    assert len(got) == len(want)
    for (g_ids, g_top, g_lp), (w_ids, w_top, w_lp) in zip(got, want, strict=True):
        assert g_ids == w_ids
        assert g_top == w_top, "the logprob entries name different tokens"
        torch.testing.assert_close(torch.tensor(g_lp), torch.tensor(w_lp), atol=1e-4, rtol=1e-4)


# One checkpoint per distinct sharding path: mistral, qwen2 and the sliding-window builds shard exactly as
# llama does (the window is per layer, not per rank), qwen3_moe's experts as mixtral's. Keeps CI time down.
TP_ARCHS = tuple(a for a in ARCHS if a not in ("mistral", "qwen2", "mistral_sw", "qwen2_sw", "qwen3_moe"))


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda_devices(2))])
@pytest.mark.parametrize("arch", TP_ARCHS)
def test_tp2_greedy_outputs_and_logprobs_equal_tp1(arch, device):
    path = get_checkpoint(arch)
    kw = dict(ENGINE_KW, device=device)
    with LLM(path, multiprocess=False, **kw) as ref_llm:
        want = _greedy(ref_llm)
    with LLM(path, tensor_parallel_size=2, **kw) as llm:
        got = _greedy(llm)
    _assert_same_generations(got, want)


def test_indivisible_head_count_is_a_clear_error(tmp_path, monkeypatch):
    src = get_checkpoint("llama")
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), tmp_path / name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(num_attention_heads=3, num_key_value_heads=1)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    started: list[str] = []

    def record_start(module: str, *args: Any, **kwargs: Any) -> Any:
        started.append(module)
        raise AssertionError(f"started {module} for a layout that was refused")

    with monkeypatch.context() as patched:
        patched.setattr(launcher, "start_child", record_start)
        with pytest.raises(ValueError, match=r"num_attention_heads=3 is not divisible by tensor_parallel_size=2"):
            LLM(str(tmp_path), tensor_parallel_size=2, dtype="float32", device="cpu")
    assert started == [], "the error must come before any process is started"
    _as_rank(0, 2)
    with pytest.raises(ValueError, match="num_attention_heads=3"):
        QKVLinear(48, 16, 3, 1, bias=False)


@pytest.mark.parametrize("victim", [0, 1])
def test_killing_a_tp_worker_mid_run_raises_engine_dead_error_and_no_rank_survives(victim):
    from vllm_lite.client.llm_engine import LLMEngine

    args = EngineArgs(model=get_checkpoint("llama"), tensor_parallel_size=2, **ENGINE_KW)
    engine = LLMEngine.from_engine_args(args)
    try:
        core_pid = engine.engine_core.proc.pid
        workers = rank_children(core_pid)
        assert len(workers) == 2, f"expected two TP worker processes under the core, found {workers}"
        engine.add_request("r0", "Once upon a time", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        produced = 0
        while produced < 3:  # the run is under way
            produced += sum(len(o.outputs[0].token_ids) > 0 for o in engine.step())
        os.kill(workers[victim], signal.SIGKILL)  # ranks are spawned in order
        deadline = time.monotonic() + DEADLINE_S  # a hang fails the test; how fast is not asserted here
        with pytest.raises(EngineDeadError):
            while time.monotonic() < deadline:
                engine.step()
        wait_until(
            lambda: all(process_gone(p) for p in workers),
            DEADLINE_S,
            "every worker process exits after the engine died",
        )
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_a_rank_that_fails_to_load_its_shard_fails_engine_startup_with_its_error(tmp_path):
    from safetensors.torch import load_file, save_file

    from vllm_lite.client.exceptions import EngineStartupError

    src = get_checkpoint("llama")
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), tmp_path / name)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        EngineStartupError,
        match=r"tensor-parallel rank \d: .*lacks parameters: "
        r"model\.layers\.1\.mlp\.down_proj\.weight",
    ):
        LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE_KW)
