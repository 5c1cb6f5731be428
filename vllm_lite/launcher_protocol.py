"""The launcher's wire protocol: the typed frames a parent and its child exchange over two pipes.

Two pipes per child:

* control (parent -> child): one ``Envelope`` frame with the child's arguments -- ONE typed
  msgspec struct, msgpack (never argv, which ``ps`` shows; never pickle) -- then any ``Control``
  frames. The parent keeps its end open for the child's whole life, so EOF means the parent is gone.
* status (child -> parent): one ``Status`` frame, the caller's ready struct or a ``StartupError``
  carrying the child's exception type, message and traceback text. The child keeps its end open
  until it exits, so once the frame is read EOF means "exited".

Frames are a little-endian u32 length and the payload; a frame over ``MAX_FRAME`` is refused.
Shared by ``vllm_lite.launcher`` (parent side) and ``vllm_lite.launcher_child`` (child side).
"""

from __future__ import annotations

import os
import struct
from typing import Optional

import msgspec

_HEADER = struct.Struct("<I")
MAX_FRAME = 64 << 20


class StartupError(msgspec.Struct):
    """What a child that failed before it was ready tells its parent."""

    exc_type: str
    message: str
    traceback: str


class Control(msgspec.Struct):
    """A message from a parent to its running child (e.g. ``kind="stop"``: what follows is on purpose)."""

    kind: str
    data: str = ""


class Envelope(msgspec.Struct):
    """The first control frame: the caller's typed arguments plus what the launcher itself needs.

    ``death_signal``: the child asks the kernel for SIGTERM when its parent dies (the parent
    started it from its main thread). ``cleanup_paths``: removed by the child if it outlives the parent.
    """

    args: msgspec.Raw
    parent_pid: int
    death_signal: bool = False
    cleanup_paths: list[str] = []


class Status(msgspec.Struct):
    """The status frame: ``ready`` (the caller's struct, msgpack-encoded) or ``error``."""

    ready: Optional[bytes] = None
    error: Optional[StartupError] = None


def write_frame(fd: int, payload: bytes) -> None:
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    while data:
        data = data[os.write(fd, data) :]


def _read_exact(fd: int, n: int) -> Optional[bytes]:
    """``n`` bytes, or None at EOF (a peer that exited mid-frame counts as EOF)."""
    chunks: list[bytes] = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> Optional[bytes]:
    header = _read_exact(fd, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ValueError(f"launcher frame of {size} bytes is larger than {MAX_FRAME}")
    return _read_exact(fd, size)
