"""LoRA adapters through the engine (issue 19): greedy float32 tokens equal Hugging Face + peft.

One in-process engine over a tiny Llama serves three adapters of ranks 4, 8 and 16 (different target modules,
lora_alpha != r, one rsLoRA, one saved as .bin) beside requests with no adapter, in one batch. A multiprocess
engine over a tiny Qwen2 (tied embeddings, q/k/v biases) with max_loras=2 runs the three at once, so slots are
evicted and reloaded mid-run. Outputs do not depend on the batch; prefix caching is keyed by adapter; bad
input is refused naming the field.
"""

from __future__ import annotations

import os

import pytest
import torch

from vllm_lite import LLM, SamplingParams
from vllm_lite.lora.request import LoRARequest
from vllm_lite.testing.checkpoints import get_checkpoint

# peft_greedy imports peft (the oracle, a dev extra) when first called: a missing peft fails the tests, never
# skips them, and collection of the whole suite does not pay for its import.
from vllm_lite.testing.lora_checkpoints import ATTN, MLP, AdapterSpec, build_lora_adapter, peft_greedy

NEW_TOKENS = 6
SPECS = (
    AdapterSpec(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), seed=1),
    AdapterSpec(r=8, lora_alpha=16, target_modules=ATTN + MLP, use_rslora=True, seed=2),
    AdapterSpec(r=16, lora_alpha=8, target_modules=("k_proj", "o_proj") + MLP, seed=3, bin_file=True),
)
PROMPTS = (
    [5, 17, 33, 90],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59],
    [300, 12, 7],
    [11, 22, 33, 44, 55, 66, 77, 88, 99],
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _adapters(base: str, root: str) -> list[LoRARequest]:
    return [
        LoRARequest(f"adapter{i + 1}", i + 1, build_lora_adapter(base, os.path.join(root, f"a{i + 1}"), spec))
        for i, spec in enumerate(SPECS)
    ]


def _mixed_batch(loras: list[LoRARequest]) -> tuple[list[list[int]], list[LoRARequest | None]]:
    """Every prompt under every adapter and under none, interleaved."""
    prompts, which = [], []
    for j, p in enumerate(PROMPTS):
        for k in range(len(loras) + 1):
            prompts.append(p)
            which.append(None if (j + k) % (len(loras) + 1) == 0 else loras[(j + k) % (len(loras) + 1) - 1])
    return prompts, which


def _oracle(base: str, prompts, which) -> list[list[int]]:
    """HF + peft per adapter (each model loaded once), in the batch's order."""
    out: dict[int, list[int]] = {}
    for lora in {w for w in which}:
        idx = [i for i, w in enumerate(which) if w == lora]
        toks = peft_greedy(base, None if lora is None else lora.lora_path, [prompts[i] for i in idx], NEW_TOKENS)
        out.update(zip(idx, toks))
    return [out[i] for i in range(len(prompts))]


def _generate(llm: LLM, prompts, which) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=which, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def llama() -> str:
    return get_checkpoint("llama")


@pytest.fixture(scope="module")
def llama_loras(llama: str, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    return _adapters(llama, str(tmp_path_factory.mktemp("llama-loras")))


@pytest.fixture(scope="module")
def llm(llama: str):
    with LLM(
        llama, multiprocess=False, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, max_model_len=128
    ) as engine:
        yield engine


def _manager(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.lora_manager


def test_mixed_batch_of_three_adapters_and_none_matches_hf_peft(llm, llama, llama_loras) -> None:
    prompts, which = _mixed_batch(llama_loras)
    ours = _generate(llm, prompts, which)
    assert ours == _oracle(llama, prompts, which)
    base = [o for o, w in zip(ours, which) if w is None]
    for lora in llama_loras:  # every adapter changes what the base model says
        assert [o for o, w in zip(ours, which) if w == lora] != base


def test_merged_adapter_gives_the_same_tokens(llm, llama, llama_loras) -> None:
    lora = llama_loras[1]
    ours = _generate(llm, list(PROMPTS), [lora] * len(PROMPTS))
    assert ours == peft_greedy(llama, lora.lora_path, PROMPTS, NEW_TOKENS, merged=True)


def test_a_request_output_does_not_depend_on_the_batch(llm, llama_loras) -> None:
    prompts, which = _mixed_batch(llama_loras)
    together = _generate(llm, prompts, which)
    alone = [_generate(llm, [p], [w])[0] for p, w in zip(prompts[:4], which[:4])]
    assert alone == together[:4]


def test_prefix_cache_is_keyed_by_adapter(llm, llama, llama_loras) -> None:
    llm.reset_prefix_cache()
    prompt = {"prompt_token_ids": list(range(100, 140))}  # two full 16-token blocks and more
    a, b = llama_loras[0], llama_loras[2]
    runs = [(a, 0), (b, 0), (None, 0), (a, 32)]
    for lora, cached in runs:
        (out,) = llm.generate([prompt], GREEDY, lora_request=lora, use_tqdm=False)
        assert out.num_cached_tokens == cached, (lora, out.num_cached_tokens)
        want = peft_greedy(llama, None if lora is None else lora.lora_path, [prompt["prompt_token_ids"]], NEW_TOKENS)
        assert list(out.outputs[0].token_ids) == want[0]


def test_add_list_pin_remove_lora(llm, llama_loras) -> None:
    engine = llm.llm_engine
    extra = LoRARequest("extra", 9, llama_loras[0].lora_path)
    assert engine.add_lora(extra) is True
    assert engine.add_lora(extra) is False
    assert 9 in engine.list_loras()
    assert engine.pin_lora(9) is True
    assert 9 in _manager(llm).pinned
    assert engine.remove_lora(9) is True
    assert 9 not in engine.list_loras()
    assert engine.remove_lora(9) is False


def test_bad_lora_input_is_refused_naming_the_field(llm, llama, llama_loras, tmp_path) -> None:
    def refused(lora, match, exc=ValueError):
        with pytest.raises(exc, match=match):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, lora_request=lora, use_tqdm=False)

    # The clash cases below need adapter1 (id 1) and adapter2 known to this engine, whichever tests ran before.
    llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 2, GREEDY, lora_request=llama_loras[:2], use_tqdm=False)
    refused(LoRARequest("nowhere", 20, str(tmp_path / "missing")), "lora_request.lora_path")
    big = build_lora_adapter(llama, str(tmp_path / "big"), AdapterSpec(r=32, lora_alpha=32))
    refused(LoRARequest("big", 21, big), "max_lora_rank")
    emb = build_lora_adapter(llama, str(tmp_path / "emb"), AdapterSpec(r=4, lora_alpha=8))
    with open(os.path.join(emb, "adapter_config.json")) as f:
        text = f.read().replace('"q_proj"', '"embed_tokens"')
    with open(os.path.join(emb, "adapter_config.json"), "w") as f:
        f.write(text)
    refused(LoRARequest("emb", 22, emb), "target_modules")
    refused(LoRARequest("adapter1", 23, llama_loras[0].lora_path), "lora_int_id")  # a known name, another id
    refused(LoRARequest("other", 1, llama_loras[1].lora_path), "lora_name")  # a known id, another name
    refused([llama_loras[0]] * 2, "lora_request entries")
    refused("adapter1", "lora_request", TypeError)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")


def test_lora_request_without_enable_lora_is_refused(llama, llama_loras) -> None:
    from vllm_lite.client.processor import Processor
    from vllm_lite.engine_args import EngineArgs

    config = EngineArgs(model=llama, dtype="float32", device="cpu").create_engine_config()
    assert config.lora_config is None
    processor = Processor(config.model_config, None)
    with pytest.raises(ValueError, match="enable_lora"):
        processor.process_inputs("r", [1, 2, 3], GREEDY, lora_request=llama_loras[0])


def test_engine_args_build_the_lora_config(llama) -> None:
    from vllm_lite.engine_args import EngineArgs

    config = EngineArgs(
        model=llama, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3
    ).create_engine_config()
    lc = config.lora_config
    assert (lc.max_loras, lc.max_lora_rank, lc.max_cpu_loras) == (2, 8, 3)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(model=llama, device="cpu", enable_lora=True, max_loras=2, max_cpu_loras=1).create_engine_config()


def test_multiprocess_qwen2_three_adapters_in_two_slots_match_hf_peft(tmp_path_factory) -> None:
    """max_loras=2 slots and max_cpu_loras=2 for three adapters in flight: slots and host cache evict and
    reload (from disk) mid-run; the tokens still match, through the msgpack wire."""
    base = get_checkpoint("qwen2")
    loras = _adapters(base, str(tmp_path_factory.mktemp("qwen2-loras")))
    prompts, which = _mixed_batch(loras)
    with LLM(
        base, dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16, max_model_len=128
    ) as engine:
        ours = _generate(engine, prompts, which)
    assert ours == _oracle(base, prompts, which)


def test_eviction_reloads_adapters_and_keeps_tokens_right(llama, llama_loras) -> None:
    prompts, which = _mixed_batch(llama_loras)
    with LLM(
        llama, multiprocess=False, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1, max_model_len=128
    ) as engine:
        ours = _generate(engine, prompts, which)
        manager = _manager(engine)
        assert manager.num_disk_loads == len(llama_loras)  # one slot: each adapter in turn
        first = [p for p, w in zip(prompts, which) if w == llama_loras[0]]
        again = _generate(engine, first, [llama_loras[0]] * len(first))
        assert manager.num_disk_loads == len(llama_loras) + 1  # evicted from the host cache: read again
        assert manager.list_loras() == {llama_loras[0].lora_int_id}
    assert ours == _oracle(llama, prompts, which)
    assert again == [o for o, w in zip(ours, which) if w == llama_loras[0]]


@pytest.mark.parametrize("gather_max", [0, 1 << 19], ids=["grouped", "gather-small"])
def test_torch_ops_match_a_per_token_reference(gather_max: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lite.lora import torch_ops

    monkeypatch.setattr(torch_ops, "GATHER_MAX_ELEMENTS", gather_max)

    g = torch.Generator().manual_seed(0)
    x, a, b = torch.randn(9, 12, generator=g), torch.randn(3, 4, 12, generator=g), torch.randn(3, 10, 4, generator=g)
    slots = torch.tensor([0, 2, -1, 2, 1, 0, -1, 1, 2], dtype=torch.int32)
    y = torch.randn(9, 14, generator=g)
    want = y.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[t, 3:13] += b[s] @ (a[s] @ x[t])
    for shrink, expand in (
        (torch_ops.lora_shrink, torch_ops.lora_expand),
        (torch_ops.lora_shrink_gather, torch_ops.lora_expand_gather),
    ):
        got = y.clone()
        buf = shrink(x, a, slots)
        assert buf.dtype == torch.float32 and not buf[2].any()
        expand(got, buf, b, slots, 3)
        torch.testing.assert_close(got, want)


def test_removing_an_adapter_a_running_request_uses_does_not_fail_it(llm, llama_loras) -> None:
    """remove_lora frees the engine's copy; a request still running with it reloads it from its path."""
    lora = llama_loras[0]
    prompt = list(PROMPTS[0])
    (want,) = _generate(llm, [prompt], [lora])
    engine = llm.llm_engine
    engine.add_request("running-while-removed", {"prompt_token_ids": prompt}, GREEDY, lora_request=lora)
    outputs = engine.step()  # the prefill ran with the adapter in a slot
    assert engine.remove_lora(lora.lora_int_id) is True
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = [o for o in outputs if o.finished]
    assert len(final) == 1 and final[0].outputs[0].finish_reason == "length"
    assert list(final[0].outputs[0].token_ids) == want
