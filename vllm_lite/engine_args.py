"""EngineArgs: every engine knob a user can set, with vLLM's names (as vLLM's ``arg_utils.py``).

Each field's metadata carries its CLI help, so ``add_cli_args`` generates one flag per field for every
subcommand; ``create_engine_config`` validates and builds the ``VllmConfig`` the engine runs on.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from vllm_lite import platform as _platform
from vllm_lite.config import (
    GENERATION_CONFIG_DEFAULTS,
    LOAD_FORMATS,
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    VllmConfig,
    _note_once,
    check_load_format,
    resolve_async_scheduling,
    verify_parallel_config,
)
from vllm_lite.device_layout import engine_device, verify_cuda_device_count
from vllm_lite.dtype_policy import STR_DTYPES as _STR_DTYPES
from vllm_lite.dtype_policy import resolve_dtype
from vllm_lite.platform import resolve_device
from vllm_lite.pooling_config import (
    CONVERTS,
    RUNNERS,
    PoolerConfig,
    resolve_convert,
    resolve_pooler_config,
    resolve_runner,
)
from vllm_lite.quantization.quant_config import resolve_quantization

_DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")
# vLLM's usage context of the offline `LLM` class: its default step budget on a large GPU is bigger than a server's.
LLM_CLASS = "LLM_CLASS"
# vLLM gives GPUs of at least this much memory (H100, H200, MI300x; not the A100, measured slower) a bigger budget.
LARGE_GPU_BYTES = 70 * 1024**3


def default_max_num_batched_tokens(device: Any, max_model_len: int, usage_context: Optional[str] = None) -> int:
    """The step budget when none is given: vLLM's per-device table where it differs, ours elsewhere.

    On a CUDA GPU of 70 GiB or more other than an A100, vLLM takes 16384 tokens a step for the offline LLM and
    8192 for a server: a GPU prefills thousands of tokens in the time the host spends on one step, so fewer, bigger
    prefill steps pay that host time fewer times. Elsewhere (CPU, smaller GPUs) max(2048, min(max_model_len, 8192)).
    """
    fallback = max(2048, min(max_model_len, 8192))
    if getattr(device, "type", None) != "cuda":
        return fallback
    index = device.index or 0
    try:
        name = _platform.cuda_device_names()[index].lower()
        memory = _platform.cuda_device_total_memory(index)
    except (RuntimeError, AssertionError, IndexError):  # no device to ask (vLLM falls back the same way)
        return fallback
    if memory >= LARGE_GPU_BYTES and "a100" not in name:
        return 16384 if usage_context == LLM_CLASS else 8192
    return fallback


# vLLM's --kv-cache-dtype choices; we run only "auto" (and "bfloat16" when the model computes in it).
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")


def check_kv_cache_dtype(kv_cache_dtype: str, model_dtype: Any) -> str:
    """ "auto" (the model's dtype) or a name for the model's own dtype; ValueError naming the field otherwise."""
    if kv_cache_dtype == "auto" or _STR_DTYPES.get(kv_cache_dtype) == model_dtype:
        return "auto"
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}.")
    raise ValueError(
        f"kv_cache_dtype={kv_cache_dtype!r} is not supported: vllm-lite keeps the KV cache in the model's dtype "
        f"({str(model_dtype).replace('torch.', '')}); use kv_cache_dtype='auto'."
    )


def resolve_chunked_prefill(enable_chunked_prefill: Optional[bool], runner_type: str) -> bool:
    """vLLM's enable_chunked_prefill for a runner: generative models chunk long prompts unless it is False
    (vLLM V1's default is on; off, each prompt runs whole in one step), pooling models never chunk (True is a
    ValueError there)."""
    if runner_type != "pooling":
        return enable_chunked_prefill is None or bool(enable_chunked_prefill)
    if enable_chunked_prefill:
        raise ValueError(
            "enable_chunked_prefill=True is not supported for pooling models (runner='pooling'): each prompt runs "
            "whole in one step; leave enable_chunked_prefill unset or False."
        )
    return False


def whole_prompt_max_num_batched_tokens(
    max_num_batched_tokens: Optional[int], max_model_len: int, max_num_seqs: int, long_prefill_token_threshold: int
) -> int:
    """The step budget of a generative model with chunked prefill off: each prompt runs whole in one step, so the
    budget must hold max_model_len tokens. Unset: max(max_model_len, 2048), at most max_num_seqs * max_model_len
    (vLLM's SchedulerConfig); given and smaller than max_model_len: ValueError, as vLLM."""
    if long_prefill_token_threshold:
        raise ValueError(
            f"long_prefill_token_threshold={long_prefill_token_threshold} cuts prompts into chunks, which "
            "enable_chunked_prefill=False forbids: leave one of them unset."
        )
    if max_num_batched_tokens is None:
        return min(max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS), max_num_seqs * max_model_len)
    if max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than max_model_len ({max_model_len}): "
            "with enable_chunked_prefill=False each prompt runs whole in one step, so longer prompts could never "
            "run; raise max_num_batched_tokens or lower max_model_len (or turn chunked prefill back on)."
        )
    return max_num_batched_tokens


# vLLM's DEFAULT_MAX_NUM_BATCHED_TOKENS: the least default step budget with chunked prefill off.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

# Default step budget of a pooling model when none is given (see create_engine_config).
POOLING_MIN_BATCHED_TOKENS = 4096


def parse_structured_outputs_config(text: str) -> StructuredOutputsConfig:
    """--structured-outputs-config's JSON value, e.g. '{"backend": "guidance"}'."""
    try:
        return StructuredOutputsConfig.from_value(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_speculative_config(text: str) -> Optional[SpeculativeConfig]:
    """--speculative-config's JSON value, e.g. '{"method": "ngram", "num_speculative_tokens": 3}'."""
    try:
        return SpeculativeConfig.from_value(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_compilation_config(text: str) -> CompilationConfig:
    """-O / --compilation-config: a mode (-O3) or JSON, e.g. '{"mode": 3}' or vLLM's older '{"level": 3}'."""
    try:
        return CompilationConfig.from_value(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_pooler_config(text: str) -> Optional[PoolerConfig]:
    """--pooler-config's JSON value, e.g. '{"pooling_type": "MEAN", "normalize": true}'."""
    try:
        return PoolerConfig.from_value(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object value, e.g. --override-generation-config '{"temperature": 0.5}'."""
    import json

    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a JSON object, e.g. '{{\"temperature\": 0.5}}', got {text!r}"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def check_override_generation_config(value: Any) -> dict[str, Any]:
    """vLLM's override_generation_config, checked: a dict of the generation_config keys that become request
    defaults (vLLM's), each a value SamplingParams takes; ValueError naming the field otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"override_generation_config must be a dict (JSON object), got {type(value).__name__}.")
    from vllm_lite.sampling_params import SamplingParams

    unknown = sorted(str(k) for k in value if k not in GENERATION_CONFIG_DEFAULTS)
    if unknown:
        raise ValueError(
            f"override_generation_config: unknown key(s) {', '.join(unknown)}; the request defaults it can set are "
            f"{', '.join(GENERATION_CONFIG_DEFAULTS)}."
        )
    try:
        SamplingParams(**{GENERATION_CONFIG_DEFAULTS[k]: v for k, v in value.items() if v is not None})
    except (TypeError, ValueError) as e:
        raise ValueError(f"override_generation_config {value!r}: {e}") from None
    return dict(value)


def parse_device_name(text: str) -> str:
    """The --device flag's value, checked for form (whether CUDA is there is checked at engine start)."""
    if not _DEVICE_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"invalid device {text!r} (auto, cpu, cuda or cuda:N)")
    return text


@dataclass
class EngineArgs:
    """Every engine knob a user can set, with vLLM's names.

    Each field's `help` (and `aliases`, `choices`) is its CLI flag's: `add_cli_args` generates
    `--field-name` for every field, so a new field is a new flag with nothing else to write.
    """

    model: str = field(
        metadata={
            "help": "Checkpoint directory or Hugging Face repo id (the HF cache is read; downloads unless "
            "HF_HUB_OFFLINE=1). Default: the bundled vllm-lite model.",
            "aliases": ("-m",),
        }
    )
    tokenizer: Optional[str] = field(
        default=None, metadata={"help": "Tokenizer directory or repo id (default: the model's)."}
    )
    revision: Optional[str] = field(
        default=None, metadata={"help": "Model revision (branch, tag or commit) when the model is a repo id."}
    )
    tokenizer_revision: Optional[str] = field(
        default=None,
        metadata={"help": "Tokenizer revision when the tokenizer is a repo id (default: the model's revision)."},
    )
    download_dir: Optional[str] = field(
        default=None,
        metadata={"help": "Hugging Face cache directory to read and download repo ids into (default: HF's own)."},
    )
    load_format: str = field(
        default="auto",
        metadata={
            "help": "How the weights are read, as vLLM: auto (*.safetensors, else PyTorch *.bin), safetensors, pt "
            "(PyTorch *.pt, else *.bin; tensors only, never pickled code) or dummy (no weight file read: small "
            "deterministic random values in the checkpoint's shapes, for benchmarks). vLLM's other formats are "
            "refused.",
            "metavar": "{" + ",".join(LOAD_FORMATS) + "}",
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Accepted for vLLM compatibility; True is refused: vllm-lite runs only its own model code."},
    )
    generation_config: str = field(
        default="auto",
        metadata={
            "help": "Request defaults: auto (the model's generation_config.json), vllm (vLLM's defaults) or a "
            "directory holding a generation_config.json."
        },
    )
    override_generation_config: Optional[dict[str, Any]] = field(
        default=None,
        metadata={
            "help": "Request defaults laid over --generation-config's, as vLLM: JSON, e.g. '{\"temperature\": "
            "0.5}' (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens); with "
            "--generation-config vllm only these. Python: a dict.",
            "type": parse_json_object,
            "metavar": "JSON",
        },
    )
    quantization: Optional[str] = field(
        default=None,
        metadata={
            "help": "Method the weights are quantized with: awq or gptq (int4 checkpoints). Default: what the "
            "checkpoint's quantization_config says; a method that contradicts it is refused.",
            "aliases": ("-q",),
        },
    )
    enforce_eager: bool = field(
        default=False,
        metadata={"help": "Run the model eager: no torch.compile (compilation_config is ignored), no CUDA graphs."},
    )
    compilation_config: Optional[CompilationConfig] = field(
        default=None,
        metadata={
            "help": "torch.compile of the model forward, as vLLM spells it: a mode (-O3) or JSON ('{\"mode\": 3}', "
            '\'{"level": 3}\', \'{"mode": "VLLM_COMPILE", "backend": "inductor"}\'). 0 (default): eager; '
            "1-3: each decoder layer's norms and MLP compiled with inductor (slower start-up). On CUDA, decode "
            "batches run as CUDA graphs; their sizes as vLLM: '{\"cudagraph_capture_sizes\": [1, 2, 4, 8]}' or "
            "'{\"max_cudagraph_capture_size\": 64}'. Python: an int, a dict or a CompilationConfig.",
            "type": parse_compilation_config,
            "metavar": "MODE|JSON",
            "aliases": ("-O",),
        },
    )
    max_logprobs: int = field(
        default=20, metadata={"help": "Most logprobs or prompt logprobs one request may ask for."}
    )
    disable_log_stats: bool = field(
        default=False, metadata={"help": "Turn off the engine core's periodic statistics log line."}
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "Compute dtype; auto follows the checkpoint and what the device computes fast.",
            "choices": ("auto", *_STR_DTYPES),
        },
    )
    seed: int = field(default=0, metadata={"help": "Engine seed (torch's RNG in the engine core)."})
    max_model_len: Optional[int] = field(
        default=None,
        metadata={"help": "Context length: prompt plus output tokens (default: the model's max_position_embeddings)."},
    )
    block_size: int = field(default=16, metadata={"help": "Tokens per KV-cache block (a power of two)."})
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "KV cache data type, as vLLM: auto (the model's dtype). vllm-lite has no fp8 KV cache: the "
            "fp8 kinds are refused, and bfloat16 only where the model computes in bfloat16.",
            "choices": KV_CACHE_DTYPES,
        },
    )
    kv_cache_memory_bytes: Optional[int] = field(
        default=None, metadata={"help": "KV cache size in bytes (default: a size for the device)."}
    )
    num_gpu_blocks_override: Optional[int] = field(
        default=None,
        metadata={
            "help": "Exactly this many KV-cache blocks, instead of what the memory budget gives (vLLM's, for tests "
            "and benchmarks); no memory profiling. Must hold one max_model_len request."
        },
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata={
            "help": "CUDA: fraction of the card's total memory this engine may use (weights, activations and "
            "KV cache); the KV cache gets what a profiling pass leaves. --kv-cache-memory-bytes overrides."
        },
    )
    enable_prefix_caching: bool = field(default=True, metadata={"help": "Reuse KV blocks of shared prompt prefixes."})
    prefix_caching_scope: str = field(
        default="client",
        metadata={
            "help": "Which frontends attached to one engine core share cached prefixes. client: each its own "
            "(the core salts the cache per authenticated frontend, so a tenant cannot detect another's prompt "
            "through num_cached_tokens or timing); shared: all of them (more hits; only for frontends that "
            "trust each other).",
            "choices": ("client", "shared"),
        },
    )
    swap_space: float = field(
        default=1.0, metadata={"help": "GiB of host memory for swapped-out KV blocks (--preemption-mode swap)."}
    )
    preemption_mode: str = field(
        default="recompute",
        metadata={
            "help": "When KV blocks run out: drop and re-prefill (recompute), or swap blocks to host memory.",
            "choices": ("recompute", "swap"),
        },
    )
    max_num_batched_tokens: Optional[int] = field(
        default=None,
        metadata={
            "help": "Token budget per engine step (default: 16384 for the offline LLM and 8192 for a server on a "
            "CUDA GPU of 70 GiB or more other than an A100, as vLLM; else max(2048, min(max_model_len, 8192)))."
        },
    )
    enable_chunked_prefill: Optional[bool] = field(
        default=None,
        metadata={
            "help": "Chunked prefill (a long prompt runs over several steps, beside decodes): on for generative "
            "models by default, as vLLM V1; --no-enable-chunked-prefill runs each prompt whole in one step (then "
            "max_num_batched_tokens defaults to max(max_model_len, 2048) and must be >= max_model_len). Pooling "
            "models always run each prompt whole (off)."
        },
    )
    max_num_seqs: int = field(default=128, metadata={"help": "Most requests running at once."})
    long_prefill_token_threshold: int = field(
        default=0, metadata={"help": "Most tokens of one prompt prefilled per step (0: no cap)."}
    )
    scheduling_policy: str = field(
        default="fcfs",
        metadata={
            "help": "fcfs: arrival order; priority: lowest priority value first, then arrival.",
            "choices": ("fcfs", "priority"),
        },
    )
    async_scheduling: Optional[bool] = field(
        default=None,
        metadata={
            "help": "Schedule and launch step N+1 while step N runs (vLLM's async scheduling); not with "
            "speculative decoding, tensor_parallel_size > 1 or pooling models. Default: on for CUDA where none of "
            "those is set, off on CPU."
        },
    )
    tensor_parallel_size: int = field(
        default=1, metadata={"help": "Ranks the model is split over (one process each).", "aliases": ("-tp",)}
    )
    data_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Independent engine cores (own model copy and KV cache each); requests are spread over them.",
            "aliases": ("-dp",),
        },
    )
    nnodes: int = field(default=1, metadata={"help": "Machines the tensor-parallel ranks are spread over (evenly)."})
    node_rank: int = field(
        default=0, metadata={"help": "This machine's index: 0 runs the engine, 1..nnodes-1 run `vllm-lite worker`."}
    )
    master_addr: str = field(default="127.0.0.1", metadata={"help": "Node 0's address, reachable from every node."})
    master_port: int = field(
        default=0,
        metadata={
            "help": "torch.distributed rendezvous (TCPStore) port on node 0 (0: a free one; set it when --nnodes > 1)."
        },
    )
    device: str = field(
        default="auto",
        metadata={
            "help": "auto (CUDA when present, else CPU), cpu, cuda or cuda:N.",
            "type": parse_device_name,
            "metavar": "{auto,cpu,cuda,cuda:N}",
        },
    )
    num_threads: Optional[int] = field(
        default=None,
        metadata={
            "help": "Torch threads per engine core, fixed (default on CPU: start on all cores but one and follow what "
            "other processes use between steps; shared out and fixed under data parallel)."
        },
    )
    structured_outputs_config: Optional[StructuredOutputsConfig] = field(
        default=None,
        metadata={
            "help": 'Structured outputs as JSON, e.g. \'{"backend": "guidance"}\': backend (auto: xgrammar, falling '
            "back to guidance; xgrammar; guidance), disable_fallback, disable_any_whitespace, "
            "disable_additional_properties. One field alone: --structured-outputs-config.backend xgrammar "
            "(or --structured-outputs-backend). Python: a StructuredOutputsConfig or a dict.",
            "type": parse_structured_outputs_config,
            "metavar": "JSON",
        },
    )
    speculative_config: Optional[SpeculativeConfig] = field(
        default=None,
        metadata={
            "help": 'Speculative decoding as JSON, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 3, '
            '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (prompt lookup over each request\'s own tokens). '
            "Python: a SpeculativeConfig or a dict.",
            "type": parse_speculative_config,
            "metavar": "JSON",
        },
    )
    served_model_name: Optional[str] = field(
        default=None,
        metadata={
            "help": "Model name(s) the engine reports; the first is the engine's, all are accepted by the HTTP API "
            "(default: the model path).",
            "nargs": "+",
        },
    )
    runner: str = field(
        default="auto",
        metadata={
            "help": "generate (sample tokens) or pooling (embeddings, classification, scores: LLM.embed, "
            "/v1/embeddings); auto: pooling for architectures without an LM head and sentence-transformers "
            "checkpoints, else generate.",
            "choices": RUNNERS,
        },
    )
    convert: str = field(
        default="auto",
        metadata={
            "help": "Serve a generative (*ForCausalLM) checkpoint as a pooling model, as vLLM: embed (last token, "
            "normalized), classify (the checkpoint's `score` head over the last token), reward (every token's "
            "hidden state); none: no conversion; auto: embed for generative architectures under runner=pooling. "
            "Implies runner=pooling; an error with runner=generate.",
            "choices": CONVERTS,
        },
    )
    pooler_config: Optional[PoolerConfig] = field(
        default=None,
        metadata={
            "help": 'Pooling models: JSON, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' (pooling_type LAST, '
            "MEAN, CLS or ALL; normalize; dimensions; activation; softmax). Default: the checkpoint's "
            "sentence-transformers files, else LAST for decoders and CLS for encoders, normalized. Python: a "
            "PoolerConfig or a dict.",
            "type": parse_pooler_config,
            "metavar": "JSON",
        },
    )

    enable_lora: bool = field(
        default=False,
        metadata={"help": "Serve LoRA adapters (PEFT checkpoints) beside the base model, chosen per request."},
    )
    max_loras: int = field(default=1, metadata={"help": "Most LoRA adapters in one batch (device slots held at once)."})
    max_lora_rank: int = field(
        default=16, metadata={"help": "Largest LoRA rank served; every device slot is sized for it."}
    )
    max_cpu_loras: Optional[int] = field(
        default=None,
        metadata={"help": "LoRA adapters kept loaded in host memory, least recently used dropped (>= max_loras)."},
    )

    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser,
        *,
        exclude: Sequence[str] = (),
        only: Optional[Sequence[str]] = None,
        positional_model: bool = False,
    ) -> None:
        """Add a flag for every field (group "engine"); `exclude`: fields the caller defines itself;
        `only`: just these fields. `positional_model`: MODEL is an optional positional argument
        (`vllm-lite serve MODEL`) instead of --model.
        """
        from vllm_lite.cli_flags import add_dataclass_args, add_subconfig_args

        group = parser.add_argument_group("engine")
        added = add_dataclass_args(
            group, cls, exclude=exclude, only=only, positional=("model",) if positional_model else ()
        )
        if any(spec.name == "structured_outputs_config" for spec in added):
            add_subconfig_args(
                group,
                "structured_outputs_config",
                StructuredOutputsConfig,
                aliases={"backend": ("--structured-outputs-backend",)},
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> "EngineArgs":
        """EngineArgs from parsed flags (fields the namespace lacks keep their defaults; `overrides` win).

        No model means the bundled default model; a list of served names gives the engine the first.
        """
        from vllm_lite.cli_flags import dataclass_kwargs_from, subconfig_overrides

        kwargs = {**dataclass_kwargs_from(args, cls), **overrides}
        nested = subconfig_overrides(args, "structured_outputs_config")
        if nested:  # --structured-outputs-config.FIELD flags refine the JSON one
            import dataclasses

            base = StructuredOutputsConfig.from_value(kwargs.get("structured_outputs_config"))
            kwargs["structured_outputs_config"] = StructuredOutputsConfig(**{**dataclasses.asdict(base), **nested})
        names = kwargs.get("served_model_name")
        if isinstance(names, (list, tuple)):
            kwargs["served_model_name"] = names[0] if names else None
        if not kwargs.get("model"):
            from vllm_lite.default_model import DEFAULT_MODEL_NAME, default_model_path

            kwargs["model"] = default_model_path()
            kwargs["served_model_name"] = kwargs.get("served_model_name") or DEFAULT_MODEL_NAME
        return cls(**kwargs)

    def create_engine_config(self, usage_context: Optional[str] = None) -> VllmConfig:
        """``usage_context``: vLLM's; LLM_CLASS (the offline LLM) takes a bigger default step budget on large GPUs."""
        from vllm_lite.model_resolution import check_model_options, resolve_model_and_tokenizer

        check_model_options(self.trust_remote_code, self.quantization, self.max_logprobs)
        structured_outputs_config = StructuredOutputsConfig.from_value(self.structured_outputs_config)
        speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        model_dir, tokenizer_dir, gen_dir = resolve_model_and_tokenizer(self)
        hf = ModelConfig.read_hf_config(model_dir)
        if speculative_config is not None:
            speculative_config.check_draft_model(model_dir, hf)
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError(f"config.json in {self.model!r} names no architectures.")
        device = resolve_device(self.device)
        compilation_config = CompilationConfig.from_value(self.compilation_config)
        if self.enforce_eager and compilation_config.mode:
            _note_once(f"enforce_eager=True: compilation_config mode {compilation_config.mode} is ignored; eager.")
            compilation_config = dataclasses.replace(compilation_config, mode=0)
        dtype = resolve_dtype(self.dtype, hf.get("torch_dtype") or hf.get("dtype"), device)
        max_pos = hf.get("max_position_embeddings") or hf.get("n_positions") or 2048  # n_positions: GPT-2
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len!r}.")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads!r}.")
        max_model_len = self.max_model_len or max_pos
        if max_model_len > max_pos:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={max_pos}.")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size!r}.")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}.")
        if self.prefix_caching_scope not in ("client", "shared"):
            raise ValueError(f"prefix_caching_scope must be 'client' or 'shared', got {self.prefix_caching_scope!r}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs!r}.")
        check_load_format(self.load_format)
        override_generation_config = check_override_generation_config(self.override_generation_config)
        kv_cache_dtype = check_kv_cache_dtype(self.kv_cache_dtype, dtype)
        override = self.num_gpu_blocks_override
        if override is not None and (isinstance(override, bool) or not isinstance(override, int) or override < 1):
            raise ValueError(f"num_gpu_blocks_override must be a positive integer, got {override!r}.")
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            data_parallel_size=self.data_parallel_size,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            master_addr=self.master_addr,
            master_port=self.master_port,
        )
        verify_parallel_config(parallel_config, hf)
        if device.type == "cuda":
            verify_cuda_device_count(parallel_config, device, _platform.cuda_device_count())
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}.")
        if self.node_rank != 0:
            raise ValueError(
                f"node_rank={self.node_rank}: the engine runs on node 0; start nodes 1..{self.nnodes - 1} "
                "with `vllm-lite worker --node-rank N ...`."
            )
        max_batched = self.max_num_batched_tokens or default_max_num_batched_tokens(
            device, max_model_len, usage_context
        )
        if max_batched < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {max_batched!r}.")
        runner_type = resolve_runner(self.runner, archs, model_dir, self.convert)
        convert_type, archs = resolve_convert(self.convert, runner_type, archs)
        pooler_config = None
        if runner_type == "pooling":
            pooler_config = resolve_pooler_config(PoolerConfig.from_value(self.pooler_config), archs, model_dir)
            # A pooling prompt runs whole in one step (no chunked prefill, as vLLM for pooling models). With no
            # decodes to keep moving, a bigger step is cheaper per token: 4096 measured 1.4-4% faster a BERT pass
            # than 2048 on Zen 4 (8192 was slower).
            if self.max_num_batched_tokens is None:
                max_batched = max(max_batched, POOLING_MIN_BATCHED_TOKENS, max_model_len)
            elif max_batched < max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({max_batched}) is smaller than max_model_len ({max_model_len}): a "
                    "pooling model runs each prompt whole in one step; raise max_num_batched_tokens or lower "
                    "max_model_len."
                )
        elif self.pooler_config is not None:
            raise ValueError("pooler_config applies to pooling models only (runner='pooling').")
        chunked_prefill = resolve_chunked_prefill(self.enable_chunked_prefill, runner_type)
        if not chunked_prefill and runner_type != "pooling":
            max_batched = whole_prompt_max_num_batched_tokens(
                self.max_num_batched_tokens, max_model_len, self.max_num_seqs, self.long_prefill_token_threshold
            )
        quant_config = resolve_quantization(self.quantization, hf, model_dir)
        if quant_config is not None and self.load_format == "dummy":
            raise ValueError(
                f"load_format='dummy' does not support quantized checkpoints ({quant_config.quant_method}): random "
                "packed int4 weights and group indices would not make a valid model; use a non-quantized config."
            )
        model_config = ModelConfig(
            model=model_dir,
            tokenizer=tokenizer_dir,
            dtype=dtype,
            max_model_len=max_model_len,
            hf_config=hf,
            architecture=archs[0],
            vocab_size=int(hf.get("vocab_size", 0)),
            seed=self.seed,
            # A repo id stays the model's name (as in vLLM), not the cache path it resolved to.
            served_model_name=self.served_model_name or (self.model if model_dir != self.model else None),
            max_logprobs=self.max_logprobs,
            generation_config="auto" if gen_dir == model_dir else gen_dir or "vllm",
            enforce_eager=self.enforce_eager,
            runner_type=runner_type,
            pooler_config=pooler_config,
            convert_type=convert_type,
            quantization=quant_config.quant_method if quant_config else None,
            quant_config=quant_config,
            load_format=self.load_format,
            override_generation_config=override_generation_config,
        )
        config = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                prefix_caching_scope=self.prefix_caching_scope,
                swap_space_bytes=int(self.swap_space * (1 << 30)),
                preemption_mode=self.preemption_mode,
                cache_dtype=kv_cache_dtype,
                num_gpu_blocks_override=override,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_batched,
                max_num_seqs=self.max_num_seqs,
                max_model_len=max_model_len,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,
                log_stats_interval_s=None if self.disable_log_stats else 10.0,
                async_scheduling=bool(self.async_scheduling),
                enable_chunked_prefill=chunked_prefill,
            ),
            parallel_config=parallel_config,
            device_config=DeviceConfig(device=device, num_threads=self.num_threads),
            structured_outputs_config=structured_outputs_config,
            speculative_config=speculative_config,
            lora_config=self._lora_config(),
            compilation_config=compilation_config,
        )
        resolve_async_scheduling(config, self.async_scheduling)
        return config

    def _lora_config(self) -> Optional[LoRAConfig]:
        """enable_lora turns LoRA on with these limits (vLLM's); the limits alone change nothing."""
        if not self.enable_lora:
            return None
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank, max_cpu_loras=self.max_cpu_loras)

    def create_dp_engine_configs(self, usage_context: Optional[str] = None) -> list[VllmConfig]:
        """One VllmConfig per data-parallel rank: its own CUDA devices or a share of the CPU threads.

        On CUDA, rank r's engine sits on the first of its tensor-parallel devices
        (``device_layout.engine_device``: cuda:(first + r*tp)); its TP ranks take the next ones.

        Validates once, with a clear error, before any process starts. Each rank's
        tensor-parallel group gets its own rendezvous port (master_port + 10 r).
        """
        import dataclasses

        base = self.create_engine_config(usage_context)
        dp = self.data_parallel_size
        if dp == 1:
            return [base]
        configs = []
        for rank in range(dp):
            kw: dict[str, Any] = {}
            if base.device_config.device.type == "cuda":
                first = engine_device(base.device_config.device, rank, base.parallel_config.ranks_per_node)
                kw["device"] = str(first)
            elif self.num_threads is None:
                try:
                    ncpu = len(os.sched_getaffinity(0))
                except AttributeError:
                    ncpu = os.cpu_count() or 1
                kw["num_threads"] = max(1, ncpu // dp)
            if self.master_port:
                kw["master_port"] = self.master_port + 10 * rank
            configs.append(dataclasses.replace(self, **kw).create_engine_config(usage_context))
        return configs
