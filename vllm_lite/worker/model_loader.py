"""Build our model for a checkpoint and stream its weights in, one tensor at a time.

The module is constructed on the meta device (no random init, no memory),
materialised empty on the target device in the target dtype, then filled
from the checkpoint; so peak memory is one model plus one tensor.

`load_format` is vLLM's: auto (safetensors, else PyTorch *.bin state dicts), safetensors, pt (PyTorch *.pt,
else *.bin, read with ``torch.load(weights_only=True)``: tensors only, never pickled code) or dummy (no weight
file read: small deterministic random values, for benchmarks).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from typing import Any, Iterator, Optional

import torch
from torch import nn

from vllm_lite.config import LOAD_FORMATS, ModelConfig, check_load_format  # noqa: F401 (LOAD_FORMATS: re-export)
from vllm_lite.quantization.int4_linear import quantized_linears
from vllm_lite.worker.models.registry import get_model_class
from vllm_lite.worker.parallel_state import get_tp_size

logger = logging.getLogger(__name__)


def _indexed_files(model_dir: str, index_name: str) -> Optional[list[str]]:
    """The shards a sharded checkpoint's index file names (all must exist), or None without that index."""
    index = os.path.join(model_dir, index_name)
    if not os.path.isfile(index):
        return None
    with open(index) as f:
        weight_map = json.load(f).get("weight_map") or {}
    files = sorted({os.path.join(model_dir, v) for v in weight_map.values()})
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"shards named in {index} are missing: {missing}.")
    return files


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's weight files: those named by model.safetensors.index.json, else every *.safetensors."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist.")
    files = _indexed_files(model_dir, "model.safetensors.index.json")
    if files is None:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir!r}.")
    return files


# Files next to PyTorch weights that are not weights (trainer state), skipped as vLLM does.
_NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth")
# vLLM's dummy initialisation: uniform in [-1e-3, 1e-3] from a fixed seed, so two loads give the same model.
DUMMY_LOW, DUMMY_HIGH, DUMMY_SEED = -1e-3, 1e-3, 1234


def pt_files(model_dir: str, patterns: tuple[str, ...] = ("*.pt", "*.bin")) -> list[str]:
    """PyTorch weight files: those named by pytorch_model.bin.index.json, else the first of `patterns` that
    matches (trainer state files left out); empty when there are none."""
    files = _indexed_files(model_dir, "pytorch_model.bin.index.json")
    if files is not None:
        return files
    for pattern in patterns:
        files = sorted(
            f for f in glob.glob(os.path.join(model_dir, pattern)) if os.path.basename(f) not in _NOT_WEIGHTS
        )
        if files:
            return files
    return []


def weight_files(model_dir: str, load_format: str = "auto") -> tuple[str, list[str]]:
    """("safetensors" or "pt", the files) that `load_format` reads from model_dir; FileNotFoundError if none.

    auto: *.safetensors, else PyTorch *.bin (vLLM's order); safetensors: only those; pt: *.pt, else *.bin."""
    check_load_format(load_format)
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist.")
    if load_format == "pt":
        files = pt_files(model_dir)
        if not files:
            raise FileNotFoundError(f"load_format='pt': no *.pt or *.bin weights in {model_dir!r}.")
        return "pt", files
    if load_format == "auto":
        has_st = os.path.isfile(os.path.join(model_dir, "model.safetensors.index.json")) or glob.glob(
            os.path.join(model_dir, "*.safetensors")
        )
        if not has_st:
            files = pt_files(model_dir, ("*.bin",))
            if files:
                return "pt", files
    return "safetensors", safetensors_files(model_dir)


def _load_pt(path: str) -> dict[str, Any]:
    """A PyTorch state dict, tensors only: weights_only=True refuses anything that would run code on load."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
        state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{path!r} holds a {type(state).__name__}, not a state dict of tensors.")
    return state


def iterate_weights(model_dir: str, lazy: bool = False, load_format: str = "auto") -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every tensor of the checkpoint, read one at a time.

    lazy=True yields safetensors slices instead of tensors: a tensor-parallel
    rank then reads only its shard's bytes (`slice[a:b]`); PyTorch files (load_format pt, or auto without
    safetensors) are memory-mapped where their format allows."""
    from safetensors import safe_open

    kind, files = weight_files(model_dir, load_format)
    if kind == "pt":
        for path in files:
            state = _load_pt(path)
            for name, tensor in state.items():
                if isinstance(tensor, torch.Tensor):
                    yield name, tensor
            del state
        return
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, (f.get_slice(name) if lazy else f.get_tensor(name))


def _hf_config(model_config: ModelConfig):
    """The resolved transformers config; from a snapshot without importing transformers when it was seen before."""
    from vllm_lite.worker.hf_config_cache import load_hf_config

    return load_hf_config(model_config.model)


_INIT_FNS = (
    "uniform_",
    "normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "trunc_normal_",
    "ones_",
    "zeros_",
    "constant_",
)


@contextlib.contextmanager
def skip_param_init() -> Iterator[None]:
    """Make torch.nn.init fills no-ops while modules are built: every value is overwritten by the checkpoint,
    and random fills on the meta device would import torch's compiler stack (seconds) for nothing."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FNS}
    try:
        for name in _INIT_FNS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace meta parameters/buffers by uninitialised storage on device (floating ones in dtype).

    Done by hand with torch.empty rather than Module.to_empty: the latter routes through
    torch's Python reference ops and costs seconds of imports on first use. Shared
    parameters (tied embeddings) stay shared. A parameter marked `keep_dtype` (int4 layers' scales,
    loaded in float32 so float16/bfloat16 checkpoint values stay exact) keeps its own dtype.
    """
    # id(old) -> (old, new); holding `old` keeps ids unique while we walk the tree.
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def empty_like(t: torch.Tensor) -> torch.Tensor:
        keep = not t.dtype.is_floating_point or getattr(t, "keep_dtype", False)
        return torch.empty(tuple(t.shape), dtype=t.dtype if keep else dtype, device=device)

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = (p, nn.Parameter(empty_like(p), requires_grad=False))
                module._parameters[name] = made[id(p)][1]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = empty_like(b)


def init_non_persistent_buffers(model: nn.Module) -> None:
    """Recompute buffers that checkpoints do not carry (RoPE tables) after materialising the module."""
    for m in model.modules():
        if m is not model and hasattr(m, "init_buffers"):
            m.init_buffers()


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = DUMMY_SEED) -> None:
    """Fill every floating-point parameter with uniform values in [DUMMY_LOW, DUMMY_HIGH] (vLLM's dummy format).

    Each parameter draws from its own generator seeded by its position, on its own device, so the fill is the
    same on every load of the same model on the same device (and does not touch torch's global RNG)."""
    for i, (_, p) in enumerate(model.named_parameters()):
        if not p.dtype.is_floating_point:
            continue
        g = torch.Generator(device=p.device).manual_seed(seed + i)
        if p.dtype.itemsize < 2:  # fp8: draw in float16, then round
            p.copy_(
                torch.empty(p.shape, dtype=torch.float16, device=p.device).uniform_(DUMMY_LOW, DUMMY_HIGH, generator=g)
            )
        else:
            p.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=g)


def load_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    """Our model for model_config.model in model_config.dtype on device, with the checkpoint's weights
    (load_format dummy: none read, deterministic small random values instead).

    Under tensor parallelism (parallel_state initialised) this builds and loads only this rank's shard."""
    device = torch.device(device)
    load_format = check_load_format(model_config.load_format)
    if load_format == "dummy" and model_config.quant_config is not None:
        raise ValueError(
            f"load_format='dummy' cannot make {model_config.quant_config.quant_method} weights (packed int4 "
            "values, group indices); use a non-quantized checkpoint's config for dummy weights."
        )
    files = [] if load_format == "dummy" else weight_files(model_config.model, load_format)[1]  # fail early
    hf_config = _hf_config(model_config)
    archs = getattr(hf_config, "architectures", None) or [model_config.architecture]
    if model_config.convert_type != "none":  # --convert: built as the converted architecture (e.g. Qwen2Model)
        archs = [model_config.architecture]
    cls = get_model_class(archs)
    with torch.device("meta"), skip_param_init(), quantized_linears(model_config.quant_config):
        model = cls(hf_config)
    materialize(model, model_config.dtype, device)
    init_non_persistent_buffers(model)
    if load_format == "dummy":
        initialize_dummy_weights(model)
        process_weights_after_loading(model)
        return model.eval()
    loaded = model.load_weights(iterate_weights(model_config.model, lazy=get_tp_size() > 1, load_format=load_format))
    expected = {name for name, _ in model.named_parameters()}
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {model_config.model!r} ({len(files)} file(s)) lacks parameters: {shown}.")
    process_weights_after_loading(model)
    return model.eval()


def process_weights_after_loading(model: nn.Module) -> None:
    """Let each quantized layer settle its loaded weights into the layout its forward reads (vLLM's hook);
    int4 layers on CPU get the native dequantization kernel where the CPU kernels build."""
    on_cpu = False
    settled: dict[str, list[str]] = {}  # layer kind -> why each one kept its plain weights ("" if it did not)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
            on_cpu = on_cpu or getattr(module, "qweight_nk", None) is not None
        elif callable(getattr(module, "process_weights_after_loading", None)):
            settled.setdefault(type(module).__name__, []).append(module.process_weights_after_loading())
    if on_cpu:
        load_native_int4()
    for kind, whys in settled.items():
        kept = [w for w in whys if w]
        if len(kept) < len(whys):
            logger.info("%d %s layers settled their weights for this device", len(whys) - len(kept), kind)
        if kept:
            logger.info("%d %s layers keep their plain weights (%s)", len(kept), kind, kept[0])


def load_native_int4() -> bool:
    """Register csrc's int4_dequant_nk for int4 layers' CPU forward; False (torch ops used) if unavailable."""
    from vllm_lite.quantization.int4_linear import set_native_dequantize
    from vllm_lite.worker.attention.cpu_kernels import load_cpu_ops

    op = None
    if load_cpu_ops():
        try:
            op = torch.ops.vllm_lite.int4_dequant_nk
        except (AttributeError, RuntimeError):  # a library built from sources without csrc/int4_cpu.cpp
            op = None
    set_native_dequantize(op)
    return op is not None
