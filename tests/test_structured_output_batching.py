"""Mixed batches: constrained and free requests together, prefix caching on and preemption forced, give every
request the output it gets alone (greedy, float32).

The KV cache holds little more than one max_model_len sequence, so the batch preempts (by recompute) again and
again, and prompts share prefixes (some are the same prompt, once constrained and once free), so blocks are
reused across requests with different constraints. A matcher that drifted from its request's tokens, a bitmask
row given to the wrong request, or a cached block mixed up between them shows as a different output.
"""

from __future__ import annotations

import json

from vllm_lite import LLM, SamplingParams
from vllm_lite.sampling_params import StructuredOutputsParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.core_harness import assert_no_leak
from vllm_lite.testing.hf_match import record_preemptions, record_prefix_hits
from vllm_lite.testing.hf_oracle import PROMPT_TEXT
from vllm_lite.testing.json_schemas import GRAMMARS, JSON_SCHEMAS, REGEXES, ConstraintCase, check_output

BLOCK_SIZE = 4
MAX_MODEL_LEN = 100
NUM_BLOCKS = 26  # one max_model_len sequence (25 blocks) and one more: nine requests must take turns

_BY_NAME = {c.name: c for c in JSON_SCHEMAS + REGEXES}
# Under backend "auto" JSON and regexes compile on xgrammar and the Lark grammar (xgrammar refuses it) on guidance.
CONSTRAINED = [
    _BY_NAME["everything"],
    _BY_NAME["array_of_objects"],
    _BY_NAME["date"],
    GRAMMARS["lark"],
    ConstraintCase("choice", "choice", ["for", "for statement", "while", "with"]),
]
NUM_FREE = 4


def _per_block_bytes(path: str) -> int:
    """KV bytes of one block of this checkpoint in float32: K and V, every layer."""
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * BLOCK_SIZE * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4


def _requests(tokenizer) -> list[tuple[list[int], SamplingParams]]:
    """Constrained requests and free ones; prompts overlap (shared prefixes, and two identical prompts)."""
    ids = tokenizer(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
    out = []
    for i, case in enumerate(CONSTRAINED):
        compact = {"disable_any_whitespace": True} if case.kind == "json" else {}
        so = StructuredOutputsParams(**{case.kind: case.spec}, **compact)
        prompt = ids[: 20 + 3 * i]  # every prompt extends the same 20-token prefix
        out.append((prompt, SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=so)))
    for i in range(NUM_FREE):
        prompt = ids[: 20 + 3 * i] if i < 2 else ids[i : i + 40]  # two free prompts equal constrained ones
        out.append((prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)))
    return out


def test_mixed_batch_under_preemption_and_prefix_caching_matches_each_request_alone(monkeypatch) -> None:
    preempted = record_preemptions(monkeypatch)
    hits = record_prefix_hits(monkeypatch)
    path = get_checkpoint("llama")
    with LLM(
        model=path,
        dtype="float32",
        multiprocess=False,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=24,  # chunked prefills beside decodes
        enable_prefix_caching=True,
        kv_cache_memory_bytes=_per_block_bytes(path) * NUM_BLOCKS,
        structured_outputs_config={"backend": "auto"},
    ) as llm:
        core = llm.llm_engine.engine_core.engine_core
        assert core.scheduler.num_total_blocks <= NUM_BLOCKS, "the KV cache is bigger than planned"
        requests = _requests(llm.get_tokenizer())
        prompts = [{"prompt_token_ids": p} for p, _ in requests]
        batch = llm.generate(prompts, [sp for _, sp in requests], use_tqdm=False)
        num_preempted, num_hit_tokens = len(preempted), sum(hits)
        alone = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, [sp for _, sp in requests])]
        assert_no_leak(core)
    for i, (b, a) in enumerate(zip(batch, alone)):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, (
            f"request {i} differs in the mixed batch: {b.outputs[0].text!r} vs alone {a.outputs[0].text!r}"
        )
    stopped = 0
    for case, out, (_, sp) in zip(CONSTRAINED, batch, requests):
        # A random-weight model may keep extending an open-ended grammar (an array of objects) to max_tokens on
        # some devices; a finished output must be complete and valid, a cut one exactly max_tokens long.
        done = out.outputs[0]
        if done.finish_reason == "stop":
            check_output(case, done.text)
            stopped += 1
        else:
            assert done.finish_reason == "length" and len(done.token_ids) == sp.max_tokens, f"{case.name}: {done}"
    assert stopped >= len(CONSTRAINED) - 1, "the constrained requests were meant to finish on their grammar"
    assert num_preempted >= 3, f"only {num_preempted} preemptions: the cache was not small enough"
    assert num_hit_tokens > 0, "no prefix-cache hit: the shared prefixes were not reused"
