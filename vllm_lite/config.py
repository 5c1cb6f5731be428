"""Engine configuration: plain dataclasses, built from `EngineArgs` (vllm_lite/engine_args.py).

Everything here is cheap to construct; reading the checkpoint's config.json
happens in `ModelConfig.from_pretrained_dir`, never in the hot path.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from vllm_lite.config_values import config_fields
from vllm_lite.dtype_policy import STR_DTYPES as _STR_DTYPES
from vllm_lite.pooling_config import PoolerConfig
from vllm_lite.quantization.quant_config import QuantizationConfig

logger = logging.getLogger(__name__)
_NOTED: set[str] = set()


def _note_once(message: str) -> None:
    """Log an accepted-but-inapplicable option once per process (create_engine_config runs per DP rank)."""
    if message not in _NOTED:
        _NOTED.add(message)
        logger.info(message)


# generation_config.json keys that vLLM turns into request defaults -> the SamplingParams field each sets
# (the frontend's Processor reads them; --override-generation-config may set only these).
GENERATION_CONFIG_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}

# vLLM's load formats that we implement (worker/model_loader.py); its others (npcache, tensorizer, gguf,
# bitsandbytes, ...) are refused.
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")


def check_load_format(load_format: str) -> str:
    """load_format if we implement it; ValueError naming the field and the formats we have otherwise."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format={load_format!r} is not supported; vllm-lite implements: {', '.join(LOAD_FORMATS)}."
        )
    return load_format


@dataclass
class ModelConfig:
    model: str
    tokenizer: str
    dtype: torch.dtype
    max_model_len: int
    hf_config: dict[str, Any]
    architecture: str
    vocab_size: int
    seed: int = 0
    served_model_name: Optional[str] = None
    # Most logprobs (sampled or prompt) one request may ask for; the frontend and the core both enforce it.
    max_logprobs: int = 20
    # Request defaults as vLLM: "auto" (the model's generation_config.json), "vllm" (none) or a directory.
    generation_config: str = "auto"
    enforce_eager: bool = False
    # "generate" or "pooling" (vLLM's --runner, "auto" resolved); a pooling model's resolved pooler settings.
    runner_type: str = "generate"
    pooler_config: Optional[PoolerConfig] = None
    # vLLM's --convert, resolved: "none", or how a generative checkpoint became this pooling model (architecture
    # is then the converted one, e.g. Qwen2ForCausalLM -> Qwen2Model for "embed").
    convert_type: str = "none"
    # vLLM's `quantization` (the method, resolved against the checkpoint) and the format's settings.
    quantization: Optional[str] = None
    quant_config: Optional[QuantizationConfig] = None
    # vLLM's --load-format (vLLM keeps it in its LoadConfig): auto, safetensors, pt or dummy (random weights).
    load_format: str = "auto"
    # vLLM's --override-generation-config: generation_config keys laid over the request defaults (after
    # generation_config's own: the checkpoint's file under "auto", nothing under "vllm").
    override_generation_config: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    @staticmethod
    def read_hf_config(model: str) -> dict[str, Any]:
        if not os.path.isdir(model):
            raise FileNotFoundError(f"Model directory {model!r} does not exist.")
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Model directory {model!r} has no config.json.")
        with open(path) as f:
            return json.load(f)


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: Optional[int] = None  # None: a default for the device
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the card's total memory this engine may use
    enable_prefix_caching: bool = True
    # Who may hit whose cached prefixes on a core that serves several frontends: "client" salts the
    # cache per frontend (a tenant cannot probe another's prompts), "shared" lets all frontends share it.
    prefix_caching_scope: str = "client"
    swap_space_bytes: int = 1 << 30
    preemption_mode: str = "recompute"  # or "swap"
    # vLLM's --kv-cache-dtype; "auto" (the model's dtype) is the only one we have.
    cache_dtype: str = "auto"
    # vLLM's --num-gpu-blocks-override: the KV cache's block count, used instead of the memory budget.
    num_gpu_blocks_override: Optional[int] = None
    # Set once the worker has sized the cache.
    num_gpu_blocks: Optional[int] = None
    num_cpu_blocks: Optional[int] = None


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0  # 0: a prompt may take the whole budget in one step
    policy: str = "fcfs"  # or "priority"
    # None: never log (disable_log_stats); not inf, which JSON (the wire form) cannot carry.
    log_stats_interval_s: Optional[float] = 10.0
    # vLLM's async scheduling: step N+1 is scheduled and launched while step N runs (at most two steps in
    # flight); step N+1's input token comes from step N's sampled tensor on the device. Off: today's step.
    async_scheduling: bool = False
    # vLLM's chunked prefill: a prompt longer than the step's budget runs over several steps. On by default for
    # generative models (vLLM V1's); off (always for pooling models), each prompt runs whole in one step or waits,
    # and max_num_batched_tokens must be >= max_model_len (the scheduler refuses less).
    enable_chunked_prefill: bool = True


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # Multi-node tensor parallelism: ranks are spread evenly over nnodes machines;
    # the engine core runs on node 0, other nodes run `vllm-lite worker`.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"  # node 0's address, reachable from every node
    master_port: int = 0  # torch.distributed TCP rendezvous port; 0: a free port (single node only)
    # A socket already listening on master_port, handed to the engine process (its launcher passes
    # it on) for the rendezvous store to take over: the port is bound once, never bound-and-released.
    master_listen_fd: Optional[int] = None
    # nnodes > 1: the token other nodes must prove to reach the rendezvous (the engine core's auth token;
    # else $VLLM_LITE_AUTH_TOKEN). Never stored where other nodes read the config.
    rendezvous_token: Optional[str] = field(default=None, repr=False)

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def inherited_fds(self) -> tuple[int, ...]:
        """The fds the process running this engine must inherit from whoever starts it."""
        return () if self.master_listen_fd is None else (self.master_listen_fd,)


def verify_parallel_config(pc: ParallelConfig, hf: dict[str, Any]) -> None:
    """Reject tensor-parallel layouts the model cannot be split into, before any process starts."""
    tp = pc.tensor_parallel_size
    for name in ("tensor_parallel_size", "data_parallel_size", "nnodes"):
        v = getattr(pc, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}.")
    if tp % pc.nnodes:
        raise ValueError(f"tensor_parallel_size={tp} must be a multiple of nnodes={pc.nnodes} (equal ranks per node).")
    if isinstance(pc.node_rank, bool) or not isinstance(pc.node_rank, int) or not 0 <= pc.node_rank < pc.nnodes:
        raise ValueError(f"node_rank must be in [0, nnodes={pc.nnodes}), got {pc.node_rank!r}.")
    if isinstance(pc.master_port, bool) or not isinstance(pc.master_port, int) or not 0 <= pc.master_port < 65536:
        raise ValueError(f"master_port must be in [0, 65535], got {pc.master_port!r}.")
    if pc.nnodes > 1 and pc.master_port == 0:
        raise ValueError("master_port must be set (nonzero) when nnodes > 1: every node must find the rendezvous.")
    if not isinstance(pc.master_addr, str) or not pc.master_addr:
        raise ValueError(f"master_addr must be a host name or IP address, got {pc.master_addr!r}.")
    if tp == 1:
        return
    heads = hf.get("num_attention_heads")
    kv_heads = hf.get("num_key_value_heads") or heads
    if heads is not None and heads % tp:
        raise ValueError(
            f"num_attention_heads={heads} is not divisible by tensor_parallel_size={tp}: "
            "attention heads are split evenly across ranks."
        )
    if kv_heads is not None and kv_heads % tp and tp % kv_heads:
        raise ValueError(
            f"num_key_value_heads={kv_heads} and tensor_parallel_size={tp}: one must divide the other "
            "(KV heads are split across ranks, or replicated when there are fewer than ranks)."
        )
    for key in ("intermediate_size", "ffn_dim"):
        v = hf.get(key)
        if isinstance(v, int) and v % tp:
            raise ValueError(f"{key}={v} is not divisible by tensor_parallel_size={tp}.")


@dataclass
class DeviceConfig:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    num_threads: Optional[int] = None  # torch intra-op threads in the engine core; None: a policy


STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")


@dataclass
class StructuredOutputsConfig:
    """The engine's structured-outputs settings, with vLLM's names (``--structured-outputs-config``)."""

    # auto: xgrammar, falling back to guidance (llguidance) for what xgrammar cannot compile.
    backend: str = "auto"
    disable_fallback: bool = False  # auto: report xgrammar's error instead of trying guidance
    disable_any_whitespace: bool = False  # JSON without optional whitespace (compact)
    disable_additional_properties: bool = False  # guidance: additionalProperties false unless the schema says
    reasoning_parser: str = ""  # accepted for vLLM compatibility; no reasoning parsers yet

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, "
                f"got {self.backend!r}."
            )
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs_config.{name} must be a bool, got {getattr(self, name)!r}.")
        if self.reasoning_parser:
            raise ValueError(
                f"structured_outputs_config.reasoning_parser: no reasoning parsers are implemented, "
                f"got {self.reasoning_parser!r}."
            )

    @classmethod
    def from_value(cls, value: Any) -> "StructuredOutputsConfig":
        """From a StructuredOutputsConfig, a dict or its JSON text; unknown keys are a ValueError naming them."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        return cls(**config_fields(value, "structured_outputs_config", cls.__dataclass_fields__))


# vLLM's CompilationMode names and values; 0 runs eager, 1-3 compile the model forward (see worker/compile.py).
COMPILATION_MODES = {"NONE": 0, "STOCK_TORCH_COMPILE": 1, "DYNAMO_TRACE_ONCE": 2, "VLLM_COMPILE": 3}


@dataclass
class CompilationConfig:
    """vLLM's ``compilation_config`` (``-O``/``--compilation-config``): an int mode, or ``{"mode": 3}``, or vLLM's
    older ``{"level": 3}``; a mode may be named ("VLLM_COMPILE"). Mode 0 (the default here) runs the model eager;
    modes 1-3 all compile each decoder layer's non-attention blocks (norms, MLP) with ``torch.compile``
    (``backend``, inductor by default), dynamic in the token count. ``enforce_eager`` turns it off."""

    mode: int = 0
    backend: str = "inductor"
    # CUDA graphs of decode batches (worker/cuda_graphs.py), vLLM's names: the batch sizes to capture (None:
    # 1, 2, 4, 8, 16, ... in steps of 8) and the largest (None: min(max_num_seqs, 256)). enforce_eager: none.
    cudagraph_capture_sizes: Optional[list[int]] = None
    max_cudagraph_capture_size: Optional[int] = None

    def __post_init__(self) -> None:
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            if not isinstance(sizes, (list, tuple)) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes
            ):
                raise ValueError(f"compilation_config.cudagraph_capture_sizes must be positive ints, got {sizes!r}.")
            self.cudagraph_capture_sizes = sorted(set(sizes))
        cap = self.max_cudagraph_capture_size
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ValueError(f"compilation_config.max_cudagraph_capture_size must be an int >= 0, got {cap!r}.")
        if isinstance(self.mode, str):
            name = self.mode.strip().upper()
            if name not in COMPILATION_MODES and not name.isdigit():
                raise ValueError(
                    f"compilation_config.mode must be 0-3 or one of {', '.join(COMPILATION_MODES)}, got {self.mode!r}."
                )
            self.mode = COMPILATION_MODES[name] if name in COMPILATION_MODES else int(name)
        if isinstance(self.mode, bool) or not isinstance(self.mode, int) or not 0 <= self.mode <= 3:
            raise ValueError(
                f"compilation_config.mode must be 0-3 or one of {', '.join(COMPILATION_MODES)}, got {self.mode!r}."
            )
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"compilation_config.backend must be a torch.compile backend name, got {self.backend!r}.")

    @classmethod
    def from_value(cls, value: Any) -> "CompilationConfig":
        """None, a CompilationConfig, an int mode (``-O3``), or a dict / JSON object with mode or level."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(mode=value)
        if isinstance(value, str) and value.strip().isdigit():
            return cls(mode=int(value))
        known = ("mode", "level", "backend", "cudagraph_capture_sizes", "max_cudagraph_capture_size")
        fields = dict(config_fields(value, "compilation_config", known))
        if "level" in fields:
            level = fields.pop("level")
            if "mode" in fields and fields["mode"] != level:
                raise ValueError(f"compilation_config: level {level!r} and mode {fields['mode']!r} disagree; give one.")
            fields["mode"] = level
        return cls(**fields)


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding as vLLM spells it (``speculative_config`` / ``--speculative-config``).

    ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}`` proposes
    by prompt lookup; ``{"model": DRAFT_DIR, "num_speculative_tokens": k}`` names a draft model (method
    "draft_model"). As in vLLM, a lookup bound left out takes the other's value, and both default to 5.
    """

    method: Optional[str] = None
    model: Optional[str] = None
    num_speculative_tokens: Optional[int] = None
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    # vLLM's: no speculation while this many requests (or more) run; None: never disabled; must be >= 2.
    disable_by_batch_size: Optional[int] = None

    def __post_init__(self) -> None:
        d = self.disable_by_batch_size
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 2):
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 2, got {d!r}.")
        if self.method is None:
            if self.model is None:
                raise ValueError("speculative_config.method: give method 'ngram' or a draft model path in 'model'.")
            self.method = "ngram" if self.model == "ngram" else "draft_model"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}."
            )
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}.")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"speculative_config.model must be a draft model directory, got {self.model!r}.")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} applies to method 'ngram' only.")
            return
        if self.model not in (None, "ngram"):
            raise ValueError(f"speculative_config.model must not be set with method 'ngram', got {self.model!r}.")
        self.model = None
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}.")
        assert self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"speculative_config.prompt_lookup_max ({self.prompt_lookup_max}) must be >= prompt_lookup_min "
                f"({self.prompt_lookup_min})."
            )

    def check_draft_model(self, target_dir: str, target_hf: dict[str, Any]) -> None:
        """Method 'draft_model': the draft must exist and share the target's vocabulary (vocab_size and, where both
        ship a tokenizer.json, the same token -> id map); a ValueError naming speculative_config.model otherwise."""
        if self.method != "draft_model":
            return
        assert self.model is not None
        try:
            draft_hf = ModelConfig.read_hf_config(self.model)
        except FileNotFoundError as e:
            raise ValueError(f"speculative_config.model: {e}") from e
        if not draft_hf.get("architectures"):
            raise ValueError(f"speculative_config.model: config.json in {self.model!r} names no architectures.")
        vocab, target_vocab = draft_hf.get("vocab_size"), target_hf.get("vocab_size")
        if vocab != target_vocab:
            raise ValueError(
                f"speculative_config.model: the draft's vocab_size ({vocab}) differs from the target's "
                f"({target_vocab}); a draft model must share the target's tokenizer and vocabulary."
            )
        draft_vocab, own_vocab = _tokenizer_vocab(self.model), _tokenizer_vocab(target_dir)
        if draft_vocab is not None and own_vocab is not None and draft_vocab != own_vocab:
            raise ValueError(
                f"speculative_config.model: the draft {self.model!r} has a different tokenizer from the target "
                f"{target_dir!r}; a draft model must share the target's tokenizer."
            )

    @classmethod
    def from_value(cls, value: Any) -> Optional["SpeculativeConfig"]:
        """From a SpeculativeConfig, a dict or its JSON text (None: no speculation); unknown keys are a ValueError."""
        if value is None or isinstance(value, cls):
            return value
        return cls(**config_fields(value, "speculative_config", cls.__dataclass_fields__))


def _tokenizer_vocab(model_dir: str) -> Optional[dict[str, int]]:
    """The token -> id map of model_dir's tokenizer.json (added tokens included), or None without one."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tok = json.load(f)
    vocab = dict((tok.get("model") or {}).get("vocab") or {})
    vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens") or [] if "content" in t and "id" in t})
    return vocab


@dataclass
class LoRAConfig:
    """LoRA serving limits, by vLLM's names (``enable_lora`` turns this on).

    ``max_loras``: adapters resident in device slots at once, and so the most distinct adapters in one
    step; ``max_lora_rank``: the rank every slot is sized for (an adapter of higher rank is refused);
    ``max_cpu_loras``: adapters kept loaded in host memory (LRU), at least ``max_loras``.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        v = self.max_cpu_loras
        if isinstance(v, bool) or not isinstance(v, int) or v < self.max_loras:
            raise ValueError(f"max_cpu_loras ({v!r}) must be an integer >= max_loras ({self.max_loras}).")


@dataclass
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative_config: Optional[SpeculativeConfig] = None
    lora_config: Optional[LoRAConfig] = None
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)


def async_scheduling_blockers(config: VllmConfig) -> list[str]:
    """What async scheduling cannot run with yet (as vLLM at first), one phrase each; empty when nothing blocks it."""
    unsupported = []
    if config.speculative_config is not None:
        unsupported.append("speculative decoding (speculative_config)")
    if config.parallel_config.tensor_parallel_size > 1:
        unsupported.append(f"tensor_parallel_size > 1 (got {config.parallel_config.tensor_parallel_size})")
    if config.model_config.runner_type == "pooling":
        unsupported.append("pooling models (runner='pooling')")
    return unsupported


def resolve_async_scheduling(config: VllmConfig, requested: Optional[bool]) -> None:
    """Set scheduler_config.async_scheduling from vLLM's three-way flag, then verify it.

    None (the default) turns it on where it pays and runs: on CUDA, with nothing in async_scheduling_blockers. On
    CPU the forward pass holds the engine's thread, so there is no idle device for the next step's host work to
    overlap (off). True asks for it anywhere (CPU too: the tests run it there); False turns it off.
    """
    if requested is None:
        requested = config.device_config.device.type == "cuda" and not async_scheduling_blockers(config)
    config.scheduler_config.async_scheduling = bool(requested)
    verify_async_scheduling(config)


def verify_async_scheduling(config: VllmConfig) -> None:
    """Reject async scheduling with what it cannot run with yet (as vLLM did): a ValueError naming the feature."""
    if not config.scheduler_config.async_scheduling:
        return
    unsupported = async_scheduling_blockers(config)
    if unsupported:
        raise ValueError(f"async_scheduling: async scheduling does not support {' or '.join(unsupported)} yet.")


# ---------------------------------------------------------------------------- wire form (JSON, no pickle)


def _config_enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.dtype):
        return str(obj).replace("torch.", "")
    if isinstance(obj, torch.device):
        return str(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} in an engine config.")


def _config_dec_hook(t: type, obj: Any) -> Any:
    if t is torch.dtype:
        if obj not in _STR_DTYPES:
            raise ValueError(f"unknown dtype {obj!r} in an engine config.")
        return _STR_DTYPES[obj]
    if t is torch.device:
        return torch.device(obj)
    raise NotImplementedError(f"cannot decode {t!r} in an engine config.")


def encode_vllm_config(config: VllmConfig) -> bytes:
    """JSON for a VllmConfig, for processes on other machines (tensor-parallel workers)."""
    import msgspec

    return msgspec.json.encode(config, enc_hook=_config_enc_hook)


def decode_vllm_config(data: bytes) -> VllmConfig:
    """The inverse of encode_vllm_config; typed, so a malformed config raises msgspec.ValidationError."""
    import msgspec

    return msgspec.json.decode(data, type=VllmConfig, dec_hook=_config_dec_hook)
