"""Builds (once) and loads vllm-lite's C++ CPU kernels, exposed as torch.ops.vllm_lite.*.

The C++ sources live in the repository's top-level csrc/; a wheel ships a copy
as vllm_lite/_csrc (setup.py's build step), found when there is no source tree.
The shared library is compiled with torch's extension tools on first use into
a cache directory keyed by everything that changes the binary (sources, torch
version, flags, CPU features), so later processes only load it. A file lock makes two
processes that start cold at once build it a single time. Any failure (no
compiler, compile error) is logged and reported as False so callers fall
back to the PyTorch reference backend instead of crashing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import platform
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from vllm_lite import envs
from vllm_lite import platform as host

logger = logging.getLogger(__name__)

_PACKAGE_DIR = Path(__file__).resolve().parents[2]  # vllm_lite/
# Where the sources may be, in order: a source tree or editable install, then an installed wheel.
CSRC_CANDIDATES = (_PACKAGE_DIR.parent / "csrc", _PACKAGE_DIR / "_csrc")
EXTRA_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
EXTRA_LDFLAGS = ["-fopenmp"]
OP_NAMES = ("paged_attention", "paged_attention_impl", "attention_impls", "write_kv", "copy_blocks", "swap_blocks")
# Key loops paged_attention can be asked for; "auto" = the fastest built for this CPU and head size.
ATTENTION_IMPLS = ("auto", "avx512", "avx2", "portable")

_lock = threading.Lock()
_loaded: Optional[bool] = None


def cache_dir() -> Path:
    """Where built kernels live: $VLLM_LITE_CACHE_DIR or ~/.cache/vllm_lite/ext."""
    env = envs.VLLM_LITE_CACHE_DIR
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm_lite" / "ext"


def csrc_dir() -> Path:
    """The directory holding the C++ sources (see CSRC_CANDIDATES); raises if neither has them."""
    for d in CSRC_CANDIDATES:
        if (d / "torch_bindings.cpp").is_file():
            return d
    raise FileNotFoundError(f"vllm-lite's C++ sources are in none of {[str(d) for d in CSRC_CANDIDATES]}")


def source_files() -> list[Path]:
    return sorted(p for p in csrc_dir().iterdir() if p.suffix in (".cpp", ".h"))


def _cpu_flags() -> str:
    """CPU feature flags: -march=native binds the binary to them."""
    return " ".join(host.cpu_flags()) or platform.processor()


def build_key() -> str:
    """Hash of what determines the binary; a change in any of them means a rebuild."""
    h = hashlib.sha256()
    for p in source_files():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    for part in (
        torch.__version__,
        sys.version,
        platform.machine(),
        " ".join(EXTRA_CFLAGS + EXTRA_LDFLAGS),
        _cpu_flags(),
    ):
        h.update(part.encode())
    return h.hexdigest()[:16]


def ops_available() -> bool:
    """True when every op is registered in this process (by us or an earlier load)."""
    ns = getattr(torch.ops, "vllm_lite", None)
    if ns is None:
        return False
    try:
        return all(hasattr(ns, name) for name in OP_NAMES)
    except RuntimeError:
        return False


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_or_load() -> None:
    """Loads the cached library, compiling it first if no cached copy exists. Raises on failure."""
    key = build_key()
    name = f"vllm_lite_cpu_{key}"
    root = cache_dir()
    build_dir = root / name
    build_dir.mkdir(parents=True, exist_ok=True)
    lib = build_dir / f"{name}.so"
    with _file_lock(root / f"{name}.lock"):
        if lib.is_file():
            try:
                torch.ops.load_library(str(lib))
                logger.info("loaded cached CPU kernels from %s", lib)
                return
            except OSError as e:  # e.g. a build killed while linking left a truncated file
                logger.warning("cached CPU kernels at %s are unusable (%s); rebuilding", lib, e)
                lib.unlink()
        if host.cxx_compiler() is None:
            raise RuntimeError(f"no C++ compiler found (CXX={envs.CXX!r})")
        from torch.utils.cpp_extension import load

        logger.warning("building vllm-lite CPU kernels (first use, ~30 s)...")
        load(
            name=name,
            sources=[str(p) for p in source_files() if p.suffix == ".cpp"],
            # Copies: torch's load() appends its link flags to the list it is given, which would change
            # build_key() for the rest of this process (a later check of the key would name another build).
            extra_cflags=list(EXTRA_CFLAGS),
            extra_ldflags=list(EXTRA_LDFLAGS),
            extra_include_paths=[str(csrc_dir())],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
        logger.info("built CPU kernels into %s", lib)


def load_cpu_ops() -> bool:
    """Makes torch.ops.vllm_lite.* available; False (with a warning) if they cannot be built."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if ops_available():
            _loaded = True
            host.record_native_kernels(True)
            return True
        try:
            _build_or_load()
            _loaded = ops_available()
            if not _loaded:
                raise RuntimeError("the library loaded but did not register torch.ops.vllm_lite ops")
        except Exception as e:  # noqa: BLE001 - any build failure means: use the reference backend
            logger.warning("vllm-lite CPU kernels unavailable (%s); falling back to the PyTorch reference backend", e)
            _loaded = False
        host.record_native_kernels(_loaded)
        return _loaded


def cpu_op(name: str) -> Optional[Any]:
    """torch.ops.vllm_lite.<name> once csrc's CPU kernels load here and have it; None: the caller's torch path.

    One place for the check every optional kernel's caller makes (a library built from older sources may
    lack a newer op)."""
    try:
        return getattr(torch.ops.vllm_lite, name, None) if load_cpu_ops() else None
    except (AttributeError, RuntimeError):
        return None
