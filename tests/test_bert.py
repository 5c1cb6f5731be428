"""BERT (encoder) equals Hugging Face: hidden states, sentence-transformers pooled embeddings, cross-encoder scores.

Prompts of different lengths share one packed batch, so attending across prompts (or to padding) would show.
The oracle is transformers' BertModel / BertForSequenceClassification on the same float32 weights, one
unpadded prompt at a time, with the checkpoint's sentence-transformers pooling (mean + Normalize) by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_lite import LLM
from vllm_lite.testing.devices import requires_cuda_devices
from vllm_lite.testing.paged import make_attention_metadata
from vllm_lite.testing.pooling_checkpoints import get_pooling_checkpoint

PROMPTS = [
    "The for statement iterates over a sequence.",
    "a",
    "Exceptions are raised by the raise statement, and handled by try statements with except clauses "
    "that name the exception classes they catch.",
]
ATOL = 1e-5
_ENGINE = dict(dtype="float32", multiprocess=False, max_model_len=256)


@pytest.fixture(scope="module")
def embed_dir() -> str:
    return get_pooling_checkpoint("bert-embed-mean")


@pytest.fixture(scope="module")
def rerank_dir() -> str:
    return get_pooling_checkpoint("bert-cross-encoder")


def _hf(model_dir: str, ids: list[int], classifier: bool = False) -> torch.Tensor:
    """HF's last hidden states [tokens, hidden] (or classifier logits [labels]) of one unpadded prompt."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if classifier else AutoModel
    model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]))
    return out.logits[0] if classifier else out.last_hidden_state[0]


def _our_model(model_dir: str) -> torch.nn.Module:
    """Our model for the checkpoint, loaded as the runner's loader does (meta build, then the weights)."""
    from transformers import AutoConfig

    from vllm_lite.worker.model_loader import iterate_weights, materialize
    from vllm_lite.worker.models.registry import get_model_class

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = get_model_class(config.architectures)(config)
    materialize(model, torch.float32, torch.device("cpu"))
    assert model.load_weights(iterate_weights(model_dir)) == {n for n, _ in model.named_parameters()}
    return model.eval()


def _run_packed(model, prompts: list[list[int]], query_lens: list[int] | None = None) -> torch.Tensor:
    from vllm_lite.worker.forward_context import set_forward_context

    lens = [len(p) for p in prompts]
    qlens = query_lens or lens
    ids = torch.tensor([t for p, q in zip(prompts, qlens) for t in p[len(p) - q :]])
    pos = torch.cat([torch.arange(n - q, n) for n, q in zip(lens, qlens)])
    md = make_attention_metadata(qlens, lens, [[0]] * len(prompts), 1024)
    with set_forward_context(md, None), torch.no_grad():
        return model(ids, pos)


def test_hidden_states_equal_hf_over_a_packed_batch(embed_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embed_dir)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    hidden = _run_packed(_our_model(embed_dir), prompts)
    for p, got in zip(prompts, hidden.split([len(p) for p in prompts])):
        torch.testing.assert_close(got, _hf(embed_dir, p), atol=ATOL, rtol=0)


def test_a_prompt_split_across_steps_is_refused(embed_dir: str) -> None:
    """Bidirectional attention needs the whole prompt at once: a chunk must fail, not answer differently."""
    with pytest.raises(ValueError, match="whole in one step"):
        _run_packed(_our_model(embed_dir), [[1, 5, 6, 7], [1, 8, 9]], query_lens=[4, 2])


def test_embed_equals_sentence_transformers_mean_normalize(embed_dir: str) -> None:
    with LLM(model=embed_dir, **_ENGINE) as llm:  # runner "auto": pooling, from the sentence-transformers files
        mc = llm.llm_engine.vllm_config.model_config
        assert (mc.runner_type, mc.pooler_config.pooling_type, mc.pooler_config.normalize) == ("pooling", "MEAN", True)
        outs = llm.embed(PROMPTS, use_tqdm=False)
    assert len({len(o.prompt_token_ids) for o in outs}) == len(PROMPTS)
    for o in outs:
        want = F.normalize(_hf(embed_dir, o.prompt_token_ids).mean(0), dim=-1)
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), want, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def cross_encoder(rerank_dir: str):
    """One in-process engine over the cross-encoder, shared by its tests."""
    with LLM(model=rerank_dir, **_ENGINE) as llm:
        yield llm


def test_cross_encoder_classify_equals_hf_sigmoid_of_its_logit(rerank_dir: str, cross_encoder: LLM) -> None:
    """BertForSequenceClassification: [CLS] -> tanh pooler -> classifier, one label through a sigmoid."""
    outs = cross_encoder.classify(PROMPTS, use_tqdm=False)
    for o in outs:
        want = torch.sigmoid(_hf(rerank_dir, o.prompt_token_ids, classifier=True))
        torch.testing.assert_close(torch.tensor(o.outputs.probs), want, atol=ATOL, rtol=0)


def _hf_pair_scores(model_dir: str, pairs: list[tuple[str, str]], types: bool = True, keep: int = 0) -> list[float]:
    """HF's sigmoid(logit) of `model(**tokenizer(a, b))` per pair; `types=False` zeroes the token types, `keep`
    keeps the last `keep` tokens (truncate_prompt_tokens)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for a, b in pairs:
        enc = {k: torch.tensor([v[-keep:]]) for k, v in tok(a, b).items()}
        if not types:
            enc["token_type_ids"].zero_()
        with torch.no_grad():
            out.append(float(torch.sigmoid(hf(**enc).logits[0, 0])))
    return out


def test_cross_encoder_score_runs_the_second_text_as_token_type_1(rerank_dir: str, cross_encoder: LLM) -> None:
    """LLM.score equals HF over the tokenizer's pair encoding, token types included (one batch, several
    boundaries); with every token type 0 HF scores visibly differently, so an ignored boundary fails here."""
    from transformers import AutoTokenizer

    query = "How is a sequence iterated?"
    pairs = [(query, p) for p in PROMPTS]
    types = AutoTokenizer.from_pretrained(rerank_dir)(query, PROMPTS[0])["token_type_ids"]
    assert types[0] == 0 and types[-1] == 1, types  # the checkpoint's tokenizer types its pairs, as BERT's does
    want = _hf_pair_scores(rerank_dir, pairs)
    untyped = _hf_pair_scores(rerank_dir, pairs, types=False)
    assert min(abs(w - u) for w, u in zip(want, untyped)) > 1e-3, (want, untyped)
    got = [o.outputs.score for o in cross_encoder.score(query, PROMPTS, use_tqdm=False)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=ATOL, rtol=0)
    # Truncation keeps the last tokens, and the boundary moves with them.
    got = cross_encoder.score(query, PROMPTS[0], truncate_prompt_tokens=6, use_tqdm=False)[0].outputs.score
    assert abs(got - _hf_pair_scores(rerank_dir, pairs[:1], keep=6)[0]) < ATOL


def test_token_types_compress_to_where_type_1_begins_and_expand_per_token() -> None:
    import numpy as np

    from vllm_lite.client.token_types import compress_token_type_ids, encode_pair, prompt_token_type_boundary
    from vllm_lite.worker.token_types import build_token_type_ids

    assert [compress_token_type_ids(t) for t in ([0, 0, 1, 1], [0, 0], [1, 1], [])] == [2, 2, 0, 0]
    for bad in ([0, 1, 0], [1, 0], [0, 2]):
        with pytest.raises(ValueError, match="token_type_ids"):
            compress_token_type_ids(bad)

    class Interleaved:  # a tokenizer whose pair types are not one 0s-then-1s split
        def __call__(self, a: str, b: str) -> dict:
            return {"input_ids": [1, 2, 3, 4], "token_type_ids": [0, 1, 0, 1]}

    with pytest.raises(ValueError, match="contiguous"):
        prompt_token_type_boundary(encode_pair(Interleaved(), "a", "b"), 4, True)
    # Three requests in one step: types from position 2, none (never reached), from position 0.
    bounds = np.array([2, np.iinfo(np.int64).max, 0])
    got = build_token_type_ids(bounds, np.array([4, 2, 3]), np.array([0, 1, 2, 3, 0, 1, 0, 1, 2]))
    assert got.tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 1]


def test_core_refuses_a_token_type_boundary_outside_the_prompt() -> None:
    from vllm_lite.core.messages import EngineCoreRequest
    from vllm_lite.core.request_validation import RequestLimits, validate_request
    from vllm_lite.pooling_params import PoolingParams
    from vllm_lite.sampling_params import SamplingParams

    limits = RequestLimits(vocab_size=100, max_model_len=64, runner_type="pooling")

    def request(boundary, pooling: bool = True) -> EngineCoreRequest:
        params = PoolingParams(task="score") if pooling else None
        sampling = None if pooling else SamplingParams()
        return EngineCoreRequest(
            "r", [1, 2, 3], sampling, None, 0.0, pooling_params=params, compressed_token_type_ids=boundary
        )

    for ok in (None, 0, 3):
        validate_request(request(ok), limits)
    for bad in (-1, 4, True):
        with pytest.raises(ValueError, match="compressed_token_type_ids"):
            validate_request(request(bad), limits)
    with pytest.raises(ValueError, match="pooling requests only"):
        validate_request(request(1, pooling=False), RequestLimits(vocab_size=100, max_model_len=64))


@requires_cuda_devices(1)
def test_cuda_half_precision_varlen_attention_equals_the_padded_path() -> None:
    """On CUDA in bfloat16 the flash varlen kernel replaces the padded SDPA: same attention, to bf16 rounding."""
    from vllm_lite.worker.models.bert import EncoderBatch, encoder_attention

    lens = [7, 1, 30]
    md = make_attention_metadata(lens, lens, [[0]] * len(lens), 1024, device="cuda")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), 4, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    batch = EncoderBatch.from_metadata(md, torch.device("cuda"))
    got = encoder_attention(q, k, v, batch, 0.125).float()
    want = encoder_attention(q.float(), k.float(), v.float(), batch, 0.125)  # float32: the padded path
    torch.testing.assert_close(got, want, atol=3e-2, rtol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda_devices(2))])
def test_tensor_parallel_2_embeddings_equal_sentence_transformers_pooling(embed_dir: str, device: str) -> None:
    """TP=2 (two worker processes; gloo on CPU): BERT's sharded attention and MLP, summed by the row-parallel
    all-reduce, pool to HF's mean + Normalize embedding of the whole model."""
    kw = dict(_ENGINE, multiprocess=True, tensor_parallel_size=2, device=device, kv_cache_memory_bytes=1 << 21)
    with LLM(model=embed_dir, **kw) as llm:
        assert llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2
        outs = llm.embed(PROMPTS, use_tqdm=False)
    for o in outs:
        want = F.normalize(_hf(embed_dir, o.prompt_token_ids).mean(0), dim=-1)
        torch.testing.assert_close(torch.tensor(o.outputs.embedding).cpu(), want, atol=ATOL, rtol=0)


def test_float32_cpu_linears_run_packed_with_gelu_and_residual_fused(monkeypatch) -> None:
    """The encoder's float32 CPU linears go through oneDNN-packed weights (faster at prefill sizes), with GELU
    (exact and tanh) and the residual add in the same call; results equal the plain ops within float32 rounding.
    $VLLM_LITE_CPU_ENCODER_PACK=0 leaves them plain."""
    from vllm_lite.worker.models.bert import linear_act, linear_add, pack_cpu_float32_linears
    from vllm_lite.worker.models.layers import get_activation
    from vllm_lite.worker.models.parallel_linear import ColumnParallelLinear, RowParallelLinear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    torch.manual_seed(0)
    model = torch.nn.Sequential(ColumnParallelLinear(64, 256, True), RowParallelLinear(256, 64, True))
    up, down = model[0], model[1]
    w_up, w_down = up.weight.detach().clone(), down.weight.detach().clone()
    x, residual = torch.randn(37, 64), torch.randn(37, 64)
    monkeypatch.setenv("VLLM_LITE_CPU_ENCODER_PACK", "0")
    assert pack_cpu_float32_linears(model) == 0 and getattr(up, "packed_weight", None) is None
    monkeypatch.setenv("VLLM_LITE_CPU_ENCODER_PACK", "1")
    assert pack_cpu_float32_linears(model) == 2
    assert up.weight.numel() == 0  # the plain copy is dropped: only the packed one is read
    for name in ("gelu", "gelu_new", "relu"):
        act = get_activation(name)
        want = act(F.linear(x, w_up, up.bias))
        torch.testing.assert_close(linear_act(up, act, name, x), want, atol=1e-5, rtol=1e-5)
    h = torch.randn(37, 256)
    want = F.linear(h, w_down, down.bias) + residual
    torch.testing.assert_close(linear_add(down, h, residual), want, atol=1e-5, rtol=1e-5)


def test_the_loaded_encoder_runs_packed_and_equals_hf_either_way(embed_dir: str, monkeypatch) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embed_dir)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    want = [_hf(embed_dir, p) for p in prompts]
    for flag in ("1", "0"):
        monkeypatch.setenv("VLLM_LITE_CPU_ENCODER_PACK", flag)
        model = _our_model(embed_dir)
        packed = getattr(model.model.layer[0].intermediate, "packed_weight", None) is not None
        assert packed == (flag == "1" and torch.backends.mkldnn.is_available())
        hidden = _run_packed(model, prompts)
        for w, got in zip(want, hidden.split([len(p) for p in prompts])):
            torch.testing.assert_close(got, w, atol=ATOL, rtol=0)
