"""The pooling endpoints over HTTP: the official `openai` client's embeddings equal `LLM.embed`, and /score,
/rerank and /pooling answer in vLLM's shapes with the same numbers.

One live server (real AsyncLLM) over a tiny sentence-transformers BERT (mean pooling + Normalize); the offline
reference runs first, in process. A generate model's refusal uses the model-free fake engine.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from vllm_lite.entrypoints.openai.serving_pooling import decode_base64_vector
from vllm_lite.testing.openai_server import ServerThread
from vllm_lite.testing.pooling_checkpoints import get_pooling_checkpoint

MODEL = "tiny-bert"
PROMPTS = ["Hello world", "The for statement iterates over a sequence.", "a"]
QUERY = "How is a sequence iterated?"
ENGINE_KW = dict(dtype="float32", max_model_len=256)
ATOL = 1e-5  # batch composition changes the padded attention's length, not the math


@pytest.fixture(scope="module")
def embed_dir() -> str:
    return get_pooling_checkpoint("bert-embed-mean")


@pytest.fixture(scope="module")
def reference(embed_dir: str) -> dict:
    """Offline LLM.embed of PROMPTS and QUERY, and their prompt token ids."""
    from vllm_lite import LLM

    with LLM(model=embed_dir, multiprocess=False, **ENGINE_KW) as llm:
        outs = llm.embed(PROMPTS + [QUERY], use_tqdm=False)
    return {
        "vectors": [torch.tensor(o.outputs.embedding) for o in outs],
        "ids": [list(o.prompt_token_ids) for o in outs],
    }


@pytest.fixture(scope="module")
def server(embed_dir: str, reference: dict):
    from vllm_lite.client.async_llm import AsyncLLM
    from vllm_lite.engine_args import EngineArgs

    srv = ServerThread(
        lambda: AsyncLLM.from_engine_args(EngineArgs(model=embed_dir, **ENGINE_KW)), served_model_name=MODEL
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _close(got: list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want, atol=ATOL, rtol=0)


def test_openai_client_embeddings_equal_llm_embed_as_floats(client: openai.OpenAI, reference: dict) -> None:
    resp = client.embeddings.create(model=MODEL, input=PROMPTS, encoding_format="float")
    assert (resp.object, resp.model, [d.index for d in resp.data]) == ("list", MODEL, [0, 1, 2])
    for d, want in zip(resp.data, reference["vectors"]):
        assert d.object == "embedding"
        _close(d.embedding, want)
    n = sum(len(ids) for ids in reference["ids"][:3])
    assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (n, n)


def test_openai_client_default_base64_decodes_to_the_same_vectors(
    client: openai.OpenAI, server: ServerThread, reference: dict
) -> None:
    resp = client.embeddings.create(model=MODEL, input=PROMPTS[1])  # the client asks for base64 and decodes it
    _close(resp.data[0].embedding, reference["vectors"][1])
    raw = httpx.post(
        server.base_url + "/v1/embeddings",
        json={"model": MODEL, "input": PROMPTS[1], "encoding_format": "base64", "user": "u1"},
        timeout=60,
    ).json()
    assert isinstance(raw["data"][0]["embedding"], str)
    _close(decode_base64_vector(raw["data"][0]["embedding"]).tolist(), reference["vectors"][1])


def test_token_id_input_and_dimensions_truncate_before_normalising(client: openai.OpenAI, reference: dict) -> None:
    resp = client.embeddings.create(model=MODEL, input=[reference["ids"][1]], dimensions=16, encoding_format="float")
    got = resp.data[0].embedding
    assert len(got) == 16 and abs(float(torch.tensor(got).norm()) - 1.0) < 1e-5
    assert resp.usage.prompt_tokens == len(reference["ids"][1])


def test_score_is_the_cosine_of_the_embeddings(server: ServerThread, reference: dict) -> None:
    body = {"model": MODEL, "text_1": QUERY, "text_2": PROMPTS}
    resp = httpx.post(server.base_url + "/score", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["object"] == "list" and out["id"].startswith("score-") and out["model"] == MODEL
    q = reference["vectors"][3]
    for i, d in enumerate(out["data"]):
        assert (d["index"], d["object"]) == (i, "score")
        assert abs(d["score"] - float(F.cosine_similarity(q, reference["vectors"][i], dim=0))) < ATOL
    assert out["usage"]["prompt_tokens"] == len(PROMPTS) * len(reference["ids"][3]) + sum(
        len(ids) for ids in reference["ids"][:3]
    )


def test_rerank_orders_documents_by_relevance_and_keeps_top_n(server: ServerThread, reference: dict) -> None:
    body = {"model": MODEL, "query": QUERY, "documents": PROMPTS, "top_n": 2}
    resp = httpx.post(server.base_url + "/v1/rerank", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    q = reference["vectors"][3]
    cos = [float(F.cosine_similarity(q, v, dim=0)) for v in reference["vectors"][:3]]
    best = sorted(range(3), key=lambda i: cos[i], reverse=True)[:2]
    assert [r["index"] for r in out["results"]] == best
    for r in out["results"]:
        assert r["document"] == {"text": PROMPTS[r["index"]]}
        assert abs(r["relevance_score"] - cos[r["index"]]) < ATOL
    assert out["id"].startswith("rerank-") and out["usage"]["total_tokens"] > 0


def test_pooling_returns_the_pooled_vectors(server: ServerThread, reference: dict) -> None:
    resp = httpx.post(server.base_url + "/pooling", json={"model": MODEL, "input": PROMPTS[:2]}, timeout=60)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert [(d["index"], d["object"]) for d in out["data"]] == [(0, "pooling"), (1, "pooling")]
    for d, want in zip(out["data"], reference["vectors"]):
        _close(d["data"], want)


def test_bad_pooling_requests_are_openai_400s(server: ServerThread) -> None:
    for path, body, param in [
        ("/v1/embeddings", {"model": MODEL, "input": "x", "dimensions": 100000}, None),
        ("/v1/embeddings", {"model": MODEL, "input": []}, "input"),
        ("/v1/embeddings", {"model": MODEL, "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ("/score", {"model": MODEL, "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ]:
        resp = httpx.post(server.base_url + path, json=body, timeout=60)
        assert resp.status_code == 400, (path, body, resp.text)
        err = resp.json()["error"]
        assert err["code"] == 400 and err["message"]
        if param is not None:
            assert err["param"] == param, err


def test_cross_encoder_score_and_rerank_equal_hf_over_the_pair_encoding() -> None:
    """A BertForSequenceClassification (one label): each pair read as one prompt with its token types (the
    checkpoint's tokenizer types the second text 1, and the types change every score), sigmoid of the classifier."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from vllm_lite.client.async_llm import AsyncLLM
    from vllm_lite.engine_args import EngineArgs

    path = get_pooling_checkpoint("bert-cross-encoder")
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [float(torch.sigmoid(hf(**tok(QUERY, d, return_tensors="pt")).logits[0, 0])) for d in PROMPTS]
    srv = ServerThread(lambda: AsyncLLM.from_engine_args(EngineArgs(model=path, **ENGINE_KW)), served_model_name=MODEL)
    try:
        score = httpx.post(srv.base_url + "/score", json={"text_1": QUERY, "text_2": PROMPTS}, timeout=60).json()
        rerank = httpx.post(srv.base_url + "/rerank", json={"query": QUERY, "documents": PROMPTS}, timeout=60).json()
    finally:
        srv.stop()
    assert [abs(d["score"] - w) < ATOL for d, w in zip(score["data"], want)] == [True] * len(PROMPTS), (score, want)
    assert [r["index"] for r in rerank["results"]] == sorted(range(len(PROMPTS)), key=lambda i: -want[i])
    assert all(abs(r["relevance_score"] - want[r["index"]]) < ATOL for r in rerank["results"])


def test_embeddings_on_a_generate_model_is_a_400_in_vllms_words() -> None:
    from vllm_lite.entrypoints.openai.api_server import build_app
    from vllm_lite.testing.checkpoints import get_checkpoint
    from vllm_lite.testing.openai_fake_engine import FakeAsyncLLM

    app = build_app(FakeAsyncLLM(get_checkpoint("llama")), served_model_name=MODEL)

    async def post(path: str, body: dict) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.post(path, json=body)

    for path, body, api in [
        ("/v1/embeddings", {"model": MODEL, "input": "hi"}, "Embeddings"),
        ("/score", {"model": MODEL, "text_1": "a", "text_2": "b"}, "Score"),
        ("/rerank", {"model": MODEL, "query": "a", "documents": ["b"]}, "Rerank (Score)"),
        ("/pooling", {"model": MODEL, "input": "hi"}, "Pooling"),
    ]:
        resp = asyncio.run(post(path, body))
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["message"].startswith(f"The model does not support {api} API")
