"""Build our model for a checkpoint and stream its safetensors weights in, one tensor at a time.

The module is constructed on the meta device (no random init, no memory),
materialised empty on the target device in the target dtype, then filled
from the checkpoint; so peak memory is one model plus one tensor.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from typing import Any, Iterator

import torch
from torch import nn

from vllm_lite.config import ModelConfig
from vllm_lite.quantization.int4_linear import quantized_linears
from vllm_lite.worker.models.registry import get_model_class
from vllm_lite.worker.parallel_state import get_tp_size

logger = logging.getLogger(__name__)


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's weight files: those named by model.safetensors.index.json, else every *.safetensors."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist.")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map") or {}
        files = sorted({os.path.join(model_dir, v) for v in weight_map.values()})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"shards named in {index} are missing: {missing}.")
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir!r}.")
    return files


def iterate_weights(model_dir: str, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every tensor of the checkpoint, read one at a time.

    lazy=True yields safetensors slices instead of tensors: a tensor-parallel
    rank then reads only its shard's bytes (`slice[a:b]`)."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
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


def load_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    """Our model for model_config.model in model_config.dtype on device, with the checkpoint's weights.

    Under tensor parallelism (parallel_state initialised) this builds and loads only this rank's shard."""
    device = torch.device(device)
    files = safetensors_files(model_config.model)  # fail on a bad dir before building anything
    hf_config = _hf_config(model_config)
    archs = getattr(hf_config, "architectures", None) or [model_config.architecture]
    if model_config.convert_type != "none":  # --convert: built as the converted architecture (e.g. Qwen2Model)
        archs = [model_config.architecture]
    cls = get_model_class(archs)
    with torch.device("meta"), skip_param_init(), quantized_linears(model_config.quant_config):
        model = cls(hf_config)
    materialize(model, model_config.dtype, device)
    init_non_persistent_buffers(model)
    loaded = model.load_weights(iterate_weights(model_config.model, lazy=get_tp_size() > 1))
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
