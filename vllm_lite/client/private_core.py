"""A private engine core: a core process started for one frontend alone, on ``ipc://`` sockets
in a private temp dir (mode 0700) and with a random auth token, through ``vllm_lite.launcher``."""

from __future__ import annotations

import secrets
import shutil
from dataclasses import dataclass
from typing import Optional

import torch

from vllm_lite import launcher
from vllm_lite.client.exceptions import EngineStartupError
from vllm_lite.config import VllmConfig, encode_vllm_config
from vllm_lite.core.messages import EngineCoreArgs, EngineCoreReady
from vllm_lite.endpoints import CoreAddresses, private_core_addresses, private_ipc_dir

DEFAULT_STARTUP_TIMEOUT_S = 600.0


def set_frontend_thread_policy() -> None:
    """The frontend does little tensor math; one thread leaves the cores to the model process."""
    torch.set_num_threads(1)


ENGINE_CORE_MODULE = "vllm_lite.core.engine_core_main"


@dataclass
class PrivateCore:
    """A core process started for one frontend: the process, its socket dir, addresses and token."""

    proc: launcher.ChildProcess
    tmpdir: str
    addresses: CoreAddresses
    auth_token: str
    ready: EngineCoreReady


def spawn_private_core(
    vllm_config: VllmConfig,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    module: str = ENGINE_CORE_MODULE,
) -> PrivateCore:
    """Start an engine-core process for this frontend alone (``python -m module``) and wait until it serves.

    A core that fails to start is reaped and its error raised here as EngineStartupError
    carrying the original message (its traceback text on ``__cause__.traceback``).
    """
    tmpdir = private_ipc_dir()  # mode 0700: only we can reach the sockets
    addresses = private_core_addresses(tmpdir)
    token = secrets.token_hex(16)
    args = EngineCoreArgs(
        vllm_config=encode_vllm_config(vllm_config),
        input_address=addresses.input,
        output_address=addresses.output,
        auth_token=token,
        heartbeat_timeout_s=None,  # one frontend, which the launcher watches instead
        drain_timeout_s=0.0,  # nobody is left to read drained outputs
    )
    proc: Optional[launcher.ChildProcess] = None
    try:
        proc = launcher.start_child(
            module,
            args,
            EngineCoreReady,
            name="engine-core",
            cleanup_paths=[tmpdir],
            pass_fds=vllm_config.parallel_config.inherited_fds,
        )
        ready = proc.wait_ready(startup_timeout_s)
    except BaseException as e:
        if proc is not None:
            proc.stop(grace_s=1.0)
        shutil.rmtree(tmpdir, ignore_errors=True)
        if isinstance(e, launcher.ChildStartupError):
            raise EngineStartupError(f"Engine core failed to start: {e.exc_type}: {e.message}") from e
        raise
    return PrivateCore(proc, tmpdir, addresses, token, ready)
