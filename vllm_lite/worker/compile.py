"""torch.compile of the model forward, opt-in as in vLLM (``compilation_config``; ``enforce_eager`` turns it off).

What is compiled: every non-attention block of each decoder layer (its norms, residual adds and MLP or
mixture of experts), each as its own compiled module. Attention stays eager: it writes the paged KV cache
and calls our kernels, which dynamo must not trace into; compiling around it, not through it, keeps it out
of every graph. Blocks are compiled ``dynamic=True``: the token count is a symbolic size, so a batch of a new
size runs the same graph instead of recompiling (dynamo specialises sizes 0 and 1 only, so decode at batch 1
may add one graph). Graphs are shared by layers of the same shapes (dynamo inlines nn.Module calls and
guards on shapes, not identities). Measured on CPU (benchmarks/PROFILE.md): inductor roughly halves the time
of these blocks at batch 32 but adds a compile of tens of seconds to start-up, so the default stays eager.
"""

from __future__ import annotations

import logging
import time

from torch import nn

from vllm_lite.config import VllmConfig

logger = logging.getLogger(__name__)

# A decoder layer's attention child, by the names our model classes use: never compiled.
ATTENTION_CHILDREN = frozenset({"self_attn", "attention"})


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the modules with an attention child (``self_attn``), attention itself aside."""
    return [
        m
        for name, m in model.named_modules()
        if name.rsplit(".", 1)[-1] not in ATTENTION_CHILDREN
        and any(child in ATTENTION_CHILDREN for child, _ in m.named_children())
    ]


def compiled_blocks(model: nn.Module) -> list[nn.Module]:
    """What ``maybe_compile`` compiles: every decoder layer child that is not its attention."""
    return [
        child
        for layer in decoder_layers(model)
        for name, child in layer.named_children()
        if name not in ATTENTION_CHILDREN and any(True for _ in child.parameters())
    ]


def maybe_compile(model: nn.Module, vllm_config: VllmConfig) -> int:
    """Compile the non-attention blocks in place when ``compilation_config.mode`` asks; returns how many.

    Compilation itself happens on each block's first call (the first step), under the same guards.
    """
    cc = vllm_config.compilation_config
    if not cc.mode or vllm_config.model_config.enforce_eager:
        return 0
    t0 = time.perf_counter()
    blocks = compiled_blocks(model)
    for block in blocks:
        block.compile(dynamic=True, backend=cc.backend)
    logger.info(
        "compilation_config mode %d: %d non-attention blocks of %d decoder layers compiled with torch.compile "
        "(backend=%s, dynamic token count; compiled on first use) in %.2fs",
        cc.mode,
        len(blocks),
        len(decoder_layers(model)),
        cc.backend,
        time.perf_counter() - t0,
    )
    return len(blocks)
