"""BERT encoder (BertModel, BertForSequenceClassification) for pooling runners.

Same call as the decoders here, `model(input_ids, positions) -> hidden [T, hidden]`, over the
runner's packed batch; but attention is bidirectional and sees only the other tokens of the
same prompt, so every prompt must arrive whole in one step (a chunked prompt is an error, not a
silently different answer). No KV cache: the model has no `Attention` layer, so the runner binds
none and sizes none for it. Attention runs as one batched SDPA over the prompts padded to the
longest, with a key-padding mask (exactly HF's math); on CUDA in half precision, flash varlen
attention over the packed rows instead; on the CPU, float32, csrc's encoder_attention_cpu over the
whole packed batch in one call (csrc/encoder_attn_cpu.cpp), else one unpadded bmm/SDPA per prompt over
views of the packed rows. Tensor parallel splits heads and the MLP as GPT-2 does.

Parameters are HF's, renamed on load by `_hf_to_ours` (`encoder.layer.N.*` -> `model.layer.N.*` with the
attention/intermediate/output names flattened, q/k/v fused into `qkv_proj`); a BertForSequenceClassification
checkpoint's `bert.` prefix is dropped. Token types are 0 unless `token_type_ids` is passed: the runner passes
them for a cross-encoder pair (its second text type 1, as BERT tokenizers mark it), rebuilt from the request's
`compressed_token_type_ids` (worker/token_types.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite import envs
from vllm_lite.worker.attention.backend import AttentionMetadata
from vllm_lite.worker.forward_context import get_forward_context
from vllm_lite.worker.models.layers import ColumnParallelLinear, QKVLinear, RowParallelLinear, get_activation
from vllm_lite.worker.models.loading import load_hf_weights
from vllm_lite.worker.models.vocab_parallel import VocabParallelEmbedding

logger = logging.getLogger(__name__)

STACKED = (
    (".qkv_proj.", ".self.query.", "q"),
    (".qkv_proj.", ".self.key.", "k"),
    (".qkv_proj.", ".self.value.", "v"),
)
# Buffers older checkpoints saved (position ids) and the MLM/NSP heads of pre-training checkpoints.
_SKIP_PREFIXES = ("cls.",)
_SKIP_SUFFIXES = ("embeddings.position_ids", "embeddings.token_type_ids")


def _varlen_attn():
    """torch's flash varlen attention (CUDA, fp16/bf16), or None where this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # older torch
        return None
    return varlen_attn


PACK_BATCH_HINT = 2048  # rows a pooling step usually brings (oneDNN picks its blocking for it; any count works)
_PACKED = "packed_weight"  # the attribute cpu_prepack.linear reads


def pack_cpu_float32_linears(model: nn.Module) -> int:
    """Give every float32 CPU parallel linear of `model` a oneDNN-packed weight copy (and drop the plain one).

    Why: F.linear (MKL sgemm) re-reads the weight in its own layout every call and ran these prefill-sized
    products (1-4k rows, 384-1536 wide) at 100-130 GFLOP/s on 2 Zen 4 cores, oneDNN on packed weights at
    145-200. Its sums run in another order, so outputs differ in the last bits (~1e-6 relative): fine for
    embeddings (compared within 1e-5), which is why only the encoder takes it; decoders keep float32 bit-exact.
    Checked once on this CPU against F.linear; a refusal or mismatch leaves every weight plain (one log line).
    $VLLM_LITE_CPU_ENCODER_PACK=0 turns it off."""
    if not envs.VLLM_LITE_CPU_ENCODER_PACK or not torch.backends.mkldnn.is_available():
        return 0
    todo = [
        m
        for m in model.modules()
        if getattr(m, "supports_prepack", False)
        and getattr(m, "quant_method", None) is None
        and getattr(m, _PACKED, None) is None
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.dim() == 2
        and m.weight.dtype == torch.float32
        and m.weight.device.type == "cpu"
    ]
    if not todo:
        return 0
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PACK_BATCH_HINT) for m in todo]
        w = todo[0].weight.detach()
        x = torch.randn(8, w.shape[1], generator=torch.Generator().manual_seed(0))
        got = torch.ops.mkldnn._linear_pointwise(x, packed[0], None, "none", [], "")
        want = F.linear(x, w)
        ok = torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    except (RuntimeError, AttributeError) as e:
        logger.info("float32 encoder linears stay on F.linear (oneDNN packing unavailable here: %s)", e)
        return 0
    if not ok:
        logger.warning("float32 encoder linears stay on F.linear (oneDNN's packed product disagrees here)")
        return 0
    for m, p in zip(todo, packed):
        setattr(m, _PACKED, p)
        m.weight.data = torch.empty((0, m.weight.shape[1]), dtype=m.weight.dtype)
    logger.info("packed %d float32 encoder linear weights for oneDNN (GELU and residual adds fused)", len(todo))
    return len(todo)


def _packed_2d(module: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The module's packed weight when its fused oneDNN op applies to x, else None."""
    packed = getattr(module, _PACKED, None)
    if packed is None or x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    return packed


def linear_add(module: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """module(x) + residual: in one oneDNN call on a packed weight (tensor parallel 1), else two ops."""
    packed = _packed_2d(module, x)
    if packed is not None and getattr(module, "tp_size", 1) == 1 and residual.is_contiguous():
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, module.bias, "add")
    return module(x) + residual


_GELU_ALGO = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


def linear_act(module: nn.Module, act: nn.Module, act_name: str, x: torch.Tensor) -> torch.Tensor:
    """act(module(x)): GELU fused into the oneDNN call on a packed weight, else two ops."""
    packed = _packed_2d(module, x)
    if packed is not None and act_name in _GELU_ALGO:
        return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "gelu", [], _GELU_ALGO[act_name])
    return act(module(x))


@dataclass
class EncoderBatch:
    """How one step's packed prompts are laid out for attention; computed once per forward pass.

    Prompt b owns packed rows `query_bounds[b]` (host ints, for the CPU per-prompt path). On CUDA also the padded
    [B, L] layout: row b of the padded batch holds prompt b's tokens qsl[b] .. qsl[b+1]-1, then padding (masked
    as keys); none of it is built on the CPU, which never pads.
    """

    metadata: AttentionMetadata
    num_reqs: int
    longest: int
    query_bounds: list[tuple[int, int]]
    cu_seqlens_cpu: Optional[torch.Tensor] = None  # int32/int64 [B+1], host (csrc's encoder_attention_cpu)
    cu_seqlens: Optional[torch.Tensor] = None  # int32 [B+1] (the varlen kernel's)
    key_mask: Optional[torch.Tensor] = None  # bool [B, 1, 1, L]
    gather: Optional[torch.Tensor] = None  # int64 [B*L]: packed row of each padded slot (clamped for padding)
    scatter: Optional[torch.Tensor] = None  # int64 [T]: padded slot of each packed row

    @staticmethod
    def from_metadata(md: AttentionMetadata, device: torch.device, padded: Optional[bool] = None) -> "EncoderBatch":
        """Requires every request's query to be its whole sequence (nothing computed before this step).
        `padded`: build the padded layout (default: off the CPU only)."""
        query_lens = md.query_start_loc_cpu[1:] - md.query_start_loc_cpu[:-1]
        if not torch.equal(query_lens, md.seq_lens_cpu):
            raise ValueError(
                "encoder-only (bidirectional) models need each prompt whole in one step; a prompt was split "
                "across steps (raise max_num_batched_tokens to at least the longest prompt)."
            )
        n, b, longest = md.num_actual_tokens, md.num_reqs, md.max_query_len
        starts = md.query_start_loc_cpu[: b + 1].tolist()
        batch = EncoderBatch(md, b, longest, list(zip(starts[:-1], starts[1:])), md.query_start_loc_cpu[: b + 1])
        if not (device.type != "cpu" if padded is None else padded):
            return batch
        qsl = md.query_start_loc[: b + 1].to(device=device, dtype=torch.int64)
        lens = qsl[1:] - qsl[:-1]
        cols = torch.arange(longest, device=device)
        valid = cols.unsqueeze(0) < lens.unsqueeze(1)  # [B, L]
        batch.gather = (qsl[:-1].unsqueeze(1) + cols.unsqueeze(0)).clamp_(max=max(n - 1, 0)).view(-1)
        # Token t of request r sits at padded slot r*L + (t - qsl[r]).
        req = torch.repeat_interleave(torch.arange(b, device=device), lens, output_size=n)
        batch.scatter = req * longest + (torch.arange(n, device=device) - qsl.index_select(0, req))
        batch.cu_seqlens, batch.key_mask = qsl.to(torch.int32), valid.view(b, 1, 1, longest)
        return batch


_ENCODER_ATTN_OP: list[Optional[Callable[..., torch.Tensor]]] = []


def encoder_attention_op() -> Optional[Callable[..., torch.Tensor]]:
    """torch.ops.vllm_lite.encoder_attention_cpu once csrc's CPU kernels load here and have it (and
    $VLLM_LITE_CPU_ENCODER_ATTN is on); None: torch only. Resolved once per process."""
    if not _ENCODER_ATTN_OP:
        from vllm_lite.worker.attention.cpu_kernels import cpu_op

        _ENCODER_ATTN_OP.append(cpu_op("encoder_attention_cpu") if envs.VLLM_LITE_CPU_ENCODER_ATTN else None)
    return _ENCODER_ATTN_OP[0]


def set_encoder_attention_op(op: Optional[Callable[..., torch.Tensor]]) -> None:
    """Use this op as csrc's kernel (None: torch's per-prompt path); for tests and benchmarks."""
    _ENCODER_ATTN_OP[:] = [op]


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: EncoderBatch, scale: float):
    """Bidirectional attention within each prompt of the packed batch: q/k/v [T, H, D] -> [T, H, D]."""
    if q.device.type == "cpu":
        if q.dtype == torch.float32 and batch.cu_seqlens_cpu is not None and (op := encoder_attention_op()) is not None:
            # The whole batch in one OpenMP region (csrc/encoder_attn_cpu.cpp); q/k/v stay strided views.
            return op(q, k, v, batch.cu_seqlens_cpu, scale)
        return per_prompt_attention(q, k, v, batch, scale)
    longest = batch.longest
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and (varlen := _varlen_attn()) is not None:
        cu = batch.cu_seqlens
        return varlen(q, k, v, cu, cu, longest, longest, scale=scale)
    return padded_attention(q, k, v, batch, scale)


def padded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: EncoderBatch, scale: float
) -> torch.Tensor:
    """One SDPA over the prompts padded to the longest, padding masked as keys (HF's math); device float32."""
    assert batch.gather is not None and batch.scatter is not None, "EncoderBatch built without the padded layout"
    n, heads, dim = q.shape
    b, longest = batch.num_reqs, batch.longest

    def padded(x: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, batch.gather).view(b, longest, heads, dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=batch.key_mask, scale=scale)
    return out.transpose(1, 2).reshape(b * longest, heads, dim).index_select(0, batch.scatter)


# CPU prompts up to this long attend by plain bmm + softmax, longer ones by torch's fused (flash) SDPA kernel.
# Measured (12 heads x 32, float32, 2 Zen 4 threads, us per prompt; SDPA / bmm): 16 tokens 69 / 39, 64: 164 / 122,
# 128: 432 / 360, 256: 1210 / 1800, 1024: 15.4k / 62k. The bmm path holds [H, len, len] scores (~0.8 MB at 128).
MATH_ATTENTION_MAX_LEN = 128


def per_prompt_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: EncoderBatch, scale: float
) -> torch.Tensor:
    """CPU: one unmasked attention per prompt over views of the packed rows, then one concatenation (short
    prompts by bmm + softmax, long ones by SDPA: MATH_ATTENTION_MAX_LEN).

    Why not the padded batch on CPU: it computes every prompt at the longest one's length (on mixed lengths 2-3x
    the scores the real tokens need) and gathers q/k/v into the padded layout and back. Here each prompt costs a
    few microseconds of Python per layer against milliseconds of math; on a device, where each call is a kernel
    launch, the padded batch (float32) or flash varlen (half precision) stays."""
    outs = []
    for start, end in batch.query_bounds:
        if end - start <= MATH_ATTENTION_MAX_LEN:  # [H, len, D] views: two bmm and a softmax
            qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))
            probs = torch.bmm(qs, ks.transpose(1, 2)).mul_(scale).softmax(-1)
            outs.append(torch.bmm(probs, vs).transpose(0, 1))
            continue
        # [1, H, len, D] views of the prompt's rows (4-D: the fused CPU kernel's)
        qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, scale=scale)[0].transpose(0, 1))
    return torch.cat(outs) if len(outs) != 1 else outs[0]


class BertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: Optional[torch.Tensor]
    ) -> torch.Tensor:
        # Summed in HF's order (word + token type + position).
        if token_type_ids is None:  # segment 0 everywhere, as HF's default
            hidden = self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]
        else:
            hidden = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(hidden + self.position_embeddings(positions))


class BertSelfAttention(nn.Module):
    """q/k/v + bidirectional attention + output dense, with HF's post-LayerNorm residual."""

    def __init__(self, config) -> None:
        super().__init__()
        d, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = d // heads
        self.qkv_proj = QKVLinear(d, self.head_dim, heads, heads, True)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.scale = self.head_dim**-0.5
        self.dense = RowParallelLinear(d, d, True, "num_attention_heads*head_dim")
        self.LayerNorm = nn.LayerNorm(d, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        n = batch.metadata.num_actual_tokens
        q, k, v = (x[:n].view(n, self.num_heads, self.head_dim) for x in self.qkv_proj.split(self.qkv_proj(hidden)))
        attn = encoder_attention(q, k, v, batch, self.scale).reshape(n, -1)
        if hidden.shape[0] > n:  # rows padded past the real tokens (never attended)
            attn = torch.cat([attn, attn.new_zeros(hidden.shape[0] - n, attn.shape[1])])
        return self.LayerNorm(linear_add(self.dense, attn, hidden))


class BertLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d = config.hidden_size
        self.attention = BertSelfAttention(config)
        self.intermediate = ColumnParallelLinear(d, config.intermediate_size, True, "intermediate_size")
        self.act_name = config.hidden_act
        self.act = get_activation(config.hidden_act)
        self.output = RowParallelLinear(config.intermediate_size, d, True, "intermediate_size")
        self.output_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        hidden = self.attention(hidden, batch)
        return self.output_norm(
            linear_add(self.output, linear_act(self.intermediate, self.act, self.act_name, hidden), hidden)
        )


class BertEncoderModel(nn.Module):
    """Embeddings + encoder layers (+ HF's optional tanh pooler over the first token)."""

    def __init__(self, config, with_pooler: bool) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"BERT position_embedding_type {config.position_embedding_type!r} is not supported; "
                "only 'absolute' position embeddings are."
            )
        if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
            raise ValueError("BERT as a decoder (is_decoder / add_cross_attention) is not supported.")
        self.embeddings = BertEmbeddings(config)
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size) if with_pooler else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        batch = EncoderBatch.from_metadata(get_forward_context().metadata, input_ids.device)
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.layer:
            hidden = layer(hidden, batch)
        return hidden

    def pooler_output(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        """HF's BertPooler: tanh(dense(h_CLS)); [B, hidden] -> [B, hidden]."""
        if self.pooler is None:
            raise ValueError("this BERT checkpoint has no pooler layer (pooler.dense).")
        return torch.tanh(self.pooler(first_token_hidden))


def _hf_to_ours(weights: Iterable[tuple[str, Any]], prefix: str) -> Iterator[tuple[str, Any]]:
    """HF BERT tensor names -> ours: strip `prefix` (e.g. "bert."), flatten encoder.layer / output names."""
    renames = (
        ("encoder.layer.", "layer."),
        (".attention.output.dense.", ".attention.dense."),
        (".attention.output.LayerNorm.", ".attention.LayerNorm."),
        (".intermediate.dense.", ".intermediate."),
        (".output.dense.", ".output."),
        (".output.LayerNorm.", ".output_norm."),
        ("pooler.dense.", "pooler."),
    )
    for name, tensor in weights:
        if prefix and name.startswith(prefix):
            name = name[len(prefix) :]
        if name.startswith(_SKIP_PREFIXES) or name.endswith(_SKIP_SUFFIXES):
            continue
        for old, new in renames:
            name = name.replace(old, new)
        if name.endswith((".gamma", ".beta")):  # TF-era LayerNorm names
            name = name.rsplit(".", 1)[0] + (".weight" if name.endswith(".gamma") else ".bias")
        yield name, tensor


class BertModel(nn.Module):
    """BERT as sentence-transformers embedding checkpoints save it (no prefix, pooler optional)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        # Built with the pooler; dropped on load when the checkpoint has none.
        self.model = BertEncoderModel(config, with_pooler=True)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return self.model(input_ids, positions, token_type_ids)

    def _weights(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in _hf_to_ours(weights, "bert."):
            if name.startswith("pooler.") and self.model.pooler is None:
                continue
            yield (name if name.startswith("classifier.") else "model." + name), tensor

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        loaded = load_hf_weights(self, self._weights(weights), STACKED)
        if self.model.pooler is not None and not any(n.startswith("model.pooler.") for n in loaded):
            # Many embedding checkpoints are saved without the pooler; token pooling never uses it.
            self.model.pooler = None
        pack_cpu_float32_linears(self.model)
        return loaded


class _BertClassifierHead(nn.Module):
    """[CLS] hidden states [B, hidden] -> logits [B, num_labels]: HF's tanh pooler, then the classifier."""

    def __init__(self, encoder: BertEncoderModel, classifier: nn.Linear) -> None:
        super().__init__()
        self.encoder, self.classifier = encoder, classifier

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder.pooler_output(cls_hidden))


class BertForSequenceClassification(BertModel):
    """BERT + tanh pooler over [CLS] + linear classifier (cross-encoders, rerankers, classifiers).

    The runner's pooler picks each prompt's [CLS] row and applies `classifier_head` to it."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.classifier = nn.Linear(config.hidden_size, int(config.num_labels))

    @property
    def classifier_head(self) -> nn.Module:
        return _BertClassifierHead(self.model, self.classifier)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        loaded = load_hf_weights(self, self._weights(weights), STACKED)
        pack_cpu_float32_linears(self.model)
        return loaded
