"""`LLM.encode` / `embed` / `classify` / `score` for pooling models, with vLLM's signatures and semantics.

Each runs its prompts as pooling requests through the same engine loop as `generate` (the LLM's `_run`), then
views the `PoolingRequestOutput`s by task. `score` on an embedding model is the cosine similarity of the two
texts' embeddings (vLLM's embedding-model scoring); on a one-label `*ForSequenceClassification` model
(a cross-encoder / reranker) it classifies each (text_1, text_2) pair tokenized together, with the token types
the tokenizer gives the pair (BERT: the second text is type 1).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from vllm_lite.client.token_types import encode_pair
from vllm_lite.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from vllm_lite.pooling_config import is_classifier_architecture, is_reward_architecture
from vllm_lite.pooling_params import PoolingParams

# (prompts, params per prompt, use_tqdm) -> finished outputs in prompt order (LLM._run).
RunFn = Callable[[list[Any], list[PoolingParams], bool], list[Any]]
ParamsArg = Optional[Union[PoolingParams, Sequence[PoolingParams]]]


def check_runner(model_config: Any, method: str, needed: str) -> None:
    """vLLM's error for calling a method the model's runner does not serve."""
    runner = model_config.runner_type
    if runner == needed:
        return
    kind = "pooling models" if needed == "pooling" else "generative models"
    raise ValueError(
        f"LLM.{method}() is only supported for {kind}. Try passing `--runner {needed}` "
        f"(LLM(..., runner={needed!r})) to use the model as a {needed.replace('generate', 'generative')} model."
    )


def params_for(
    n: int, pooling_params: ParamsArg, task: str, truncate_prompt_tokens: Optional[int] = None
) -> list[PoolingParams]:
    """One PoolingParams per prompt with the method's task set (the caller's objects are not changed)."""
    if pooling_params is None:
        given = [PoolingParams()] * n
    elif isinstance(pooling_params, PoolingParams):
        given = [pooling_params] * n
    else:
        given = list(pooling_params)
        if len(given) != n:
            raise ValueError(f"got {len(given)} PoolingParams for {n} prompts; pass one or one per prompt")
    out = []
    for i, p in enumerate(given):
        if not isinstance(p, PoolingParams):
            raise TypeError(f"pooling_params[{i}] must be PoolingParams, got {type(p).__name__}")
        if p.task is not None and p.task != task:
            raise ValueError(f"pooling_params[{i}].task is {p.task!r}, but this call runs task {task!r}")
        q = p.clone()
        q.task = task
        if truncate_prompt_tokens is not None:
            q.truncate_prompt_tokens = truncate_prompt_tokens
        q.verify()
        out.append(q)
    return out


def raise_errors(outputs: list[PoolingRequestOutput]) -> list[PoolingRequestOutput]:
    for i, out in enumerate(outputs):
        if out.error is not None or out.outputs is None:
            raise RuntimeError(f"prompt {i}: {out.error or 'no pooled output'}")
    return outputs


def encode(run: RunFn, prompts: list[Any], params: list[PoolingParams], use_tqdm: bool) -> list[PoolingRequestOutput]:
    return raise_errors(run(prompts, params, use_tqdm))


def embed(run: RunFn, prompts: list[Any], params: list[PoolingParams], use_tqdm: bool) -> list[EmbeddingRequestOutput]:
    return [EmbeddingRequestOutput.from_base(o) for o in encode(run, prompts, params, use_tqdm)]


def classify(
    run: RunFn, model_config: Any, prompts: list[Any], params: list[PoolingParams], use_tqdm: bool
) -> list[ClassificationRequestOutput]:
    if not is_classifier_architecture([model_config.architecture]):
        raise ValueError(
            f"LLM.classify() needs a model with a classification head (*ForSequenceClassification); "
            f"{model_config.architecture} has none."
        )
    return [ClassificationRequestOutput.from_base(o) for o in encode(run, prompts, params, use_tqdm)]


def classify_tokens(
    run: RunFn, model_config: Any, prompts: list[Any], params: list[PoolingParams], use_tqdm: bool
) -> list[PoolingRequestOutput]:
    """`LLM.reward`: the classification head over every token (vLLM's token_classify), one [tokens, labels] each;
    a model converted with convert='reward' has no head and returns every token's hidden state, as vLLM's."""
    archs = [model_config.architecture]
    if not is_classifier_architecture(archs) and not is_reward_architecture(archs):
        raise ValueError(
            f"LLM.reward() needs a model with a classification head (*ForSequenceClassification); "
            f"{model_config.architecture} has none."
        )
    return encode(run, prompts, params, use_tqdm)


def score(
    run: RunFn,
    model_config: Any,
    tokenizer: Any,
    text_1: Union[str, Sequence[str]],
    text_2: Union[str, Sequence[str]],
    pooling_params: ParamsArg,
    truncate_prompt_tokens: Optional[int],
    use_tqdm: bool,
) -> list[ScoringRequestOutput]:
    """One score per pair: text_1[i] with text_2[i], or one text_1 against every text_2 (vLLM's 1:N and N:N)."""
    t1 = [text_1] if isinstance(text_1, (str, dict)) else list(text_1)
    t2 = [text_2] if isinstance(text_2, (str, dict)) else list(text_2)
    if not t1 or not t2:
        raise ValueError("score needs at least one text on each side")
    if len(t1) == 1:
        t1 = t1 * len(t2)
    if len(t1) != len(t2):
        raise ValueError(f"score: text_1 has {len(t1)} items and text_2 {len(t2)}; pass one text_1 or as many")
    if is_classifier_architecture([model_config.architecture]):
        return _cross_encoder_score(
            run, model_config, tokenizer, t1, t2, pooling_params, truncate_prompt_tokens, use_tqdm
        )
    n = len(t1)
    params = params_for(2 * n, pooling_params, "embed", truncate_prompt_tokens)
    outs = encode(run, t1 + t2, params, use_tqdm)
    a = torch.stack([o.outputs.data for o in outs[:n]])
    b = torch.stack([o.outputs.data for o in outs[n:]])
    sims = F.cosine_similarity(a, b, dim=-1)
    return [
        ScoringRequestOutput(
            request_id=f"{x.request_id}_{y.request_id}",
            outputs=ScoringOutput(float(s)),
            prompt_token_ids=list(x.prompt_token_ids) + list(y.prompt_token_ids),
            finished=True,
        )
        for x, y, s in zip(outs[:n], outs[n:], sims.tolist())
    ]


def _cross_encoder_score(
    run: RunFn,
    model_config: Any,
    tokenizer: Any,
    t1: list[Any],
    t2: list[Any],
    pooling_params: ParamsArg,
    truncate_prompt_tokens: Optional[int],
    use_tqdm: bool,
) -> list[ScoringRequestOutput]:
    num_labels = len(model_config.hf_config.get("id2label") or {}) or model_config.hf_config.get("num_labels", 2)
    if num_labels != 1:
        raise ValueError(
            f"LLM.score() on a classification model needs one label (a cross-encoder); it has {num_labels}."
        )
    if tokenizer is None:
        raise ValueError("LLM.score() on a cross-encoder needs a tokenizer to encode the text pairs.")
    if not all(isinstance(x, str) for x in t1 + t2):
        raise TypeError("LLM.score() on a cross-encoder takes text pairs (str).")
    prompts = [encode_pair(tokenizer, a, b) for a, b in zip(t1, t2)]  # with the pair's token types
    params = params_for(len(prompts), pooling_params, "score", truncate_prompt_tokens)
    return [ScoringRequestOutput.from_base(o) for o in encode(run, prompts, params, use_tqdm)]
