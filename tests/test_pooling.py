"""Pooling models end to end: `LLM.embed/encode/classify/score` against Hugging Face pooled hidden states.

One in-process LLM per checkpoint for the whole module (LAST + Normalize embeddings; a classifier), and one
multiprocess LLM (MEAN, not normalised), so the pooled tensor also crosses the core's socket. Float32: the
oracle is transformers' forward on the same weights with the sentence-transformers pooling done by hand.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from vllm_lite import LLM, AsyncLLM, EngineArgs, SamplingParams
from vllm_lite.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from vllm_lite.pooling_params import PoolingParams
from vllm_lite.testing.pooling_checkpoints import get_pooling_checkpoint

PROMPTS = [
    "The for statement iterates over a sequence.",
    "a",
    "Exceptions are raised by the raise statement, and handled by try statements with except clauses "
    "that name the exception classes they catch.",
]
# Pooled vectors equal HF's within this (float32, same weights).
ATOL = 1e-5
_ENGINE = dict(dtype="float32", kv_cache_memory_bytes=1 << 21, max_model_len=256)


def _hf_hidden(model_dir: str, ids: list[int]) -> torch.Tensor:
    """HF's last hidden states [tokens, hidden] of one unpadded prompt."""
    from transformers import AutoModel

    model = _HF.get(model_dir)
    if model is None:
        model = _HF[model_dir] = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).last_hidden_state[0]


_HF: dict = {}


@pytest.fixture(scope="module")
def last_dir() -> str:
    return get_pooling_checkpoint("qwen3-embed-last")


@pytest.fixture(scope="module")
def embed_llm(last_dir: str):
    llm = LLM(model=last_dir, multiprocess=False, **_ENGINE)
    yield llm
    llm.shutdown()


def test_auto_runner_reads_sentence_transformers_files(embed_llm: LLM) -> None:
    mc = embed_llm.llm_engine.vllm_config.model_config
    assert mc.runner_type == "pooling"
    assert (mc.pooler_config.pooling_type, mc.pooler_config.normalize) == ("LAST", True)


def test_embed_equals_hf_last_token_normalized_over_a_mixed_batch(embed_llm: LLM, last_dir: str) -> None:
    outs = embed_llm.embed(PROMPTS, use_tqdm=False)
    assert [type(o) for o in outs] == [EmbeddingRequestOutput] * len(PROMPTS)
    assert len({len(o.prompt_token_ids) for o in outs}) == len(PROMPTS)  # different lengths in one batch
    for o in outs:
        want = F.normalize(_hf_hidden(last_dir, o.prompt_token_ids)[-1], dim=-1)
        got = torch.tensor(o.outputs.embedding)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert abs(float(got.norm()) - 1.0) < 1e-5


def test_encode_returns_pooling_request_outputs_and_per_request_options(embed_llm: LLM, last_dir: str) -> None:
    params = [PoolingParams(normalize=False), PoolingParams(dimensions=16), PoolingParams()]
    outs = embed_llm.encode(PROMPTS, params, use_tqdm=False)
    assert [type(o) for o in outs] == [PoolingRequestOutput] * 3
    assert all(o.finished and o.error is None and isinstance(o.outputs, PoolingOutput) for o in outs)
    assert outs[0].prompt_token_ids == embed_llm.get_tokenizer().encode(PROMPTS[0])
    raw = [_hf_hidden(last_dir, o.prompt_token_ids)[-1] for o in outs]
    torch.testing.assert_close(outs[0].outputs.data, raw[0], atol=ATOL, rtol=0)  # normalize=False: raw state
    # Matryoshka: the first 16 dimensions, normalised after truncation.
    assert outs[1].outputs.data.shape == (16,)
    torch.testing.assert_close(outs[1].outputs.data, F.normalize(raw[1][:16], dim=-1), atol=ATOL, rtol=0)
    torch.testing.assert_close(outs[2].outputs.data, F.normalize(raw[2], dim=-1), atol=ATOL, rtol=0)


def test_score_is_the_cosine_of_the_two_embeddings(embed_llm: LLM) -> None:
    scores = embed_llm.score(PROMPTS[0], PROMPTS, use_tqdm=False)
    assert [type(s) for s in scores] == [ScoringRequestOutput] * 3
    emb = torch.tensor([o.outputs.embedding for o in embed_llm.embed(PROMPTS, use_tqdm=False)])
    want = F.cosine_similarity(emb[0:1], emb, dim=-1)
    got = torch.tensor([s.outputs.score for s in scores])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert abs(scores[0].outputs.score - 1.0) < 1e-5


def test_pooler_config_overrides_the_checkpoint_cls_pooling_equals_hf(last_dir: str) -> None:
    with LLM(model=last_dir, multiprocess=False, pooler_config={"pooling_type": "CLS"}, **_ENGINE) as llm:
        mc = llm.llm_engine.vllm_config.model_config
        assert (mc.pooler_config.pooling_type, mc.pooler_config.normalize) == ("CLS", True)  # Normalize: the ST files'
        outs = llm.embed(PROMPTS, use_tqdm=False)
    for o in outs:
        want = F.normalize(_hf_hidden(last_dir, o.prompt_token_ids)[0], dim=-1)
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), want, atol=ATOL, rtol=0)


def test_pooling_frees_every_kv_block(embed_llm: LLM) -> None:
    engine = embed_llm.llm_engine
    total = engine.call_utility("get_num_total_blocks")
    embed_llm.embed(PROMPTS * 3, use_tqdm=False)
    assert engine.call_utility("get_num_free_blocks") == total
    assert not engine.has_unfinished_requests()


def test_generate_on_a_pooling_model_is_a_clear_error(embed_llm: LLM) -> None:
    with pytest.raises(
        ValueError, match=r"LLM.generate\(\) is only supported for generative models.*--runner generate"
    ):
        embed_llm.generate("hello", SamplingParams(max_tokens=2))
    # The engine API refuses it too (what the HTTP layer calls), before anything reaches the core.
    with pytest.raises(ValueError, match="only supported for generative models"):
        embed_llm.llm_engine.add_request("x", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="classification head"):
        embed_llm.classify("hello", use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(dimensions=0), "dimensions"),
        (dict(dimensions=True), "dimensions"),
        (dict(normalize="yes"), "normalize"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(task="generate"), "task"),
    ],
)
def test_bad_pooling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PoolingParams(**kwargs)


def test_pooling_params_checked_against_the_model(embed_llm: LLM) -> None:
    hidden = embed_llm.llm_engine.vllm_config.model_config.hf_config["hidden_size"]
    with pytest.raises(ValueError, match=f"dimensions must be at most the model's embedding size {hidden}"):
        embed_llm.embed("hello", pooling_params=PoolingParams(dimensions=hidden + 1), use_tqdm=False)
    with pytest.raises(ValueError, match="task"):
        embed_llm.embed("hello", pooling_params=PoolingParams(task="classify"), use_tqdm=False)
    out = embed_llm.embed(PROMPTS[2], truncate_prompt_tokens=4, use_tqdm=False)[0]
    assert out.prompt_token_ids == embed_llm.get_tokenizer().encode(PROMPTS[2])[-4:]


def test_async_llm_encode_mean_pooling_over_the_socket_equals_hf() -> None:
    """AsyncLLM.encode (what the HTTP layer uses) with its core in another process: MEAN, not normalised."""
    model_dir = get_pooling_checkpoint("qwen3-embed-mean")
    engine = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, **_ENGINE))

    async def run() -> list[PoolingRequestOutput]:
        async def one(i: int, prompt: str) -> PoolingRequestOutput:
            outs = [o async for o in engine.encode(prompt, PoolingParams(task="embed"), f"req-{i}")]
            assert len(outs) == 1
            return outs[0]

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
        free = await engine.call_utility_async("get_num_free_blocks")
        assert free == await engine.call_utility_async("get_num_total_blocks")
        engine.shutdown()
        return list(results)

    try:
        mc = engine.vllm_config.model_config
        assert (mc.pooler_config.pooling_type, mc.pooler_config.normalize) == ("MEAN", False)
        outs = asyncio.run(run())
    finally:
        engine.shutdown()
    for o in outs:
        assert o.finished and o.error is None
        want = _hf_hidden(model_dir, o.prompt_token_ids).mean(0)
        torch.testing.assert_close(o.outputs.data, want, atol=ATOL, rtol=0)


def test_classify_and_cross_encoder_score_equal_hf_on_a_one_label_classifier() -> None:
    """classify: the score head's sigmoid (raw logit with use_activation=False); score: each (text_1, text_2) pair
    tokenized together and classified, as vLLM scores with a cross-encoder; reward: the head on every token. (Softmax over several labels is
    checked on the Pooler in test_pooling_config.)"""
    from transformers import AutoModelForSequenceClassification

    model_dir = get_pooling_checkpoint("qwen3-rerank")
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with LLM(model=model_dir, multiprocess=False, **_ENGINE) as llm:
        assert llm.llm_engine.vllm_config.model_config.runner_type == "pooling"
        outs = llm.classify(PROMPTS, use_tqdm=False)
        raw = llm.classify(PROMPTS[0], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)[0]
        scores = llm.score(PROMPTS[0], PROMPTS[1:], use_tqdm=False)
        rewards = llm.reward(PROMPTS[:2], use_tqdm=False)
        pair_ids = [llm.get_tokenizer()(PROMPTS[0], t)["input_ids"] for t in PROMPTS[1:]]

    def logit(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(input_ids=torch.tensor([ids])).logits[0]

    assert [type(o) for o in outs] == [ClassificationRequestOutput] * 3
    for o in outs:
        assert o.outputs.num_classes == 1
        torch.testing.assert_close(
            torch.tensor(o.outputs.probs), logit(o.prompt_token_ids).sigmoid(), atol=ATOL, rtol=0
        )
    torch.testing.assert_close(torch.tensor(raw.outputs.probs), logit(raw.prompt_token_ids), atol=ATOL, rtol=0)
    assert [type(s) for s in scores] == [ScoringRequestOutput] * 2
    for s, ids in zip(scores, pair_ids):
        assert s.prompt_token_ids == ids
        assert abs(s.outputs.score - float(logit(ids)[0].sigmoid())) < ATOL
    for r in rewards:  # reward: the head over every token
        with torch.no_grad():
            states = hf.model(input_ids=torch.tensor([r.prompt_token_ids])).last_hidden_state[0]
            want = hf.score(states).sigmoid()
        assert r.outputs.data.shape == (len(r.prompt_token_ids), 1)
        torch.testing.assert_close(r.outputs.data, want, atol=ATOL, rtol=0)
