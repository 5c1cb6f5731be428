"""msgpack on the wire, with tensors as raw side frames (no pickle, ever).

Why: logprob tensors are the only bulky thing that crosses the socket each
step. Turning them into Python lists costs far more than the model step on a
small model, so a tensor travels as its bytes in an extra ZMQ frame and the
msgpack body carries only an ext record ``(dtype, shape, frame index)``.
Tiny tensors (below ``inline_threshold`` bytes) are inlined in the record:
an extra frame costs more than a few dozen bytes of copy.

Decode is typed (``MsgpackDecoder(EngineCoreOutputs)``): a message that does
not match the struct raises ``msgspec.ValidationError``/``DecodeError``, which
the socket threads turn into "dropped with a log line". Tensors decode with
``torch.frombuffer`` straight on the received frame (zero copy); those
tensors are read-only views of the message buffer, so callers must not write
into them in place.

The ext decoder only ever builds tensors/arrays of whitelisted dtypes from
bytes: there is no code path that imports or calls anything named in the data.
"""

from __future__ import annotations

import struct
import warnings
from typing import Any, Optional, Sequence, Union

import msgspec
import numpy as np
import torch

# Ext type codes (application-defined, 0..127): where the bytes are, and what they become.
EXT_TORCH_INLINE = 1  # torch.Tensor, bytes inside the record
EXT_TORCH_FRAME = 2  # torch.Tensor, bytes in a side frame
EXT_NUMPY_INLINE = 3
EXT_NUMPY_FRAME = 4

# Tensors below this many bytes ride inside the msgpack body.
DEFAULT_INLINE_THRESHOLD = 256
MAX_NDIM = 8

Frame = Union[bytes, bytearray, memoryview]

# Wire dtype codes. numpy carries the bytes; bfloat16 (no numpy type) travels as int16 bits.
_DTYPES: list[tuple[str, torch.dtype, np.dtype]] = [
    ("float32", torch.float32, np.dtype("float32")),
    ("float64", torch.float64, np.dtype("float64")),
    ("float16", torch.float16, np.dtype("float16")),
    ("bfloat16", torch.bfloat16, np.dtype("int16")),
    ("int64", torch.int64, np.dtype("int64")),
    ("int32", torch.int32, np.dtype("int32")),
    ("int16", torch.int16, np.dtype("int16")),
    ("int8", torch.int8, np.dtype("int8")),
    ("uint8", torch.uint8, np.dtype("uint8")),
    ("bool", torch.bool, np.dtype("bool")),
    ("uint16", torch.uint16, np.dtype("uint16")),
    ("uint32", torch.uint32, np.dtype("uint32")),
    ("uint64", torch.uint64, np.dtype("uint64")),
]
_TORCH_TO_CODE = {tdt: code for code, (_, tdt, _) in enumerate(_DTYPES)}
_NUMPY_TO_CODE = {ndt: code for code, (name, _, ndt) in enumerate(_DTYPES) if name != "bfloat16"}

# Record layout: dtype code (u8), ndim (u8), dims (i64 each), then the inline bytes or a frame index (u32).
_HEADERS = [struct.Struct(f"<BB{n}q") for n in range(MAX_NDIM + 1)]
_DIMS = [struct.Struct(f"<{n}q") for n in range(MAX_NDIM + 1)]
_FRAME_INDEX = struct.Struct("<I")

# torch warns when wrapping a read-only buffer (ZMQ frames are read-only); we hand out
# read-only views of received frames on purpose (see module docstring).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


class MsgpackEncoder:
    """Encodes a msgspec struct (or any msgpack-able value) into ZMQ frames.

    ``encode(obj)`` returns ``[body, *tensor_buffers]``; send it with
    ``socket.send_multipart(frames, copy=False)``.
    """

    def __init__(self, inline_threshold: int = DEFAULT_INLINE_THRESHOLD) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._inline_threshold = inline_threshold
        self._aux: Optional[list[Frame]] = None

    def encode(self, obj: Any) -> list[Frame]:
        self._aux = frames = [b""]
        try:
            frames[0] = self._encoder.encode(obj)
            return frames
        finally:
            self._aux = None

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._encode_tensor(obj)
        if isinstance(obj, np.ndarray):
            return self._encode_ndarray(obj)
        raise TypeError(f"Cannot serialize object of type {type(obj).__name__} on the engine wire.")

    def _record(
        self, code_inline: int, dtype_code: int, shape: tuple[int, ...], arr: np.ndarray
    ) -> msgspec.msgpack.Ext:
        """``arr``: C-contiguous numpy view of the data (no copy yet)."""
        ndim = len(shape)
        if ndim > MAX_NDIM:
            raise TypeError(f"Cannot serialize an array with {ndim} dimensions on the engine wire (max {MAX_NDIM}).")
        header = _HEADERS[ndim].pack(dtype_code, ndim, *shape)
        if arr.nbytes < self._inline_threshold:
            return msgspec.msgpack.Ext(code_inline, header + arr.tobytes())
        assert self._aux is not None
        self._aux.append(memoryview(arr.reshape(-1)).cast("B"))
        return msgspec.msgpack.Ext(code_inline + 1, header + _FRAME_INDEX.pack(len(self._aux) - 1))

    def _encode_tensor(self, t: torch.Tensor) -> msgspec.msgpack.Ext:
        code = _TORCH_TO_CODE.get(t.dtype)
        if code is None:
            raise TypeError(f"Cannot serialize tensor of dtype {t.dtype} on the engine wire.")
        if not t.is_cpu:
            t = t.detach().cpu()
        elif t.requires_grad:
            t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.dtype is torch.bfloat16:
            t = t.view(torch.int16)
        return self._record(EXT_TORCH_INLINE, code, tuple(t.shape), t.numpy())

    def _encode_ndarray(self, a: np.ndarray) -> msgspec.msgpack.Ext:
        code = _NUMPY_TO_CODE.get(a.dtype)
        if code is None:
            raise TypeError(f"Cannot serialize numpy array of dtype {a.dtype} on the engine wire.")
        return self._record(EXT_NUMPY_INLINE, code, a.shape, np.ascontiguousarray(a))


class MsgpackDecoder:
    """Decodes frames from ``MsgpackEncoder`` into a given type (typed, validating)."""

    def __init__(self, t: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(t, ext_hook=self._ext_hook)
        self._aux: Sequence[Any] = ()

    def decode(self, frames: Union[Frame, Sequence[Any]]) -> Any:
        """``frames``: one buffer, or the list of frames (bytes / memoryview / zmq.Frame)."""
        if isinstance(frames, (bytes, bytearray, memoryview)):
            return self._decoder.decode(frames)
        if len(frames) == 0:
            raise ValueError("Cannot decode an empty list of frames.")
        self._aux = frames
        try:
            return self._decoder.decode(_as_buffer(frames[0]))
        finally:
            self._aux = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code not in (EXT_TORCH_INLINE, EXT_TORCH_FRAME, EXT_NUMPY_INLINE, EXT_NUMPY_FRAME):
            raise ValueError(f"Unknown msgpack ext type {code} on the engine wire.")
        if len(data) < 2:
            raise ValueError("Truncated array record on the engine wire.")
        dtype_code, ndim = data[0], data[1]
        if dtype_code >= len(_DTYPES) or ndim > MAX_NDIM:
            raise ValueError(f"Unknown array dtype code {dtype_code} or ndim {ndim} on the engine wire.")
        name, tdtype, ndtype = _DTYPES[dtype_code]
        offset = 2 + 8 * ndim
        if len(data) < offset:
            raise ValueError("Truncated array record on the engine wire.")
        shape = _DIMS[ndim].unpack_from(data, 2)
        n = 1
        for d in shape:
            if d < 0:
                raise ValueError(f"Negative dimension in wire array shape {list(shape)}.")
            n *= d
        if code in (EXT_TORCH_FRAME, EXT_NUMPY_FRAME):
            if len(data) != offset + 4:
                raise ValueError("Malformed frame reference on the engine wire.")
            (index,) = _FRAME_INDEX.unpack_from(data, offset)
            if not 1 <= index < len(self._aux):
                raise ValueError(f"Wire array refers to frame {index}, message has {len(self._aux)} frames.")
            buf: Any = _as_buffer(self._aux[index])  # zero copy: a view of the received frame
        else:
            buf = bytearray(data[offset:])  # the record is part of the body: copy the few bytes
        nbytes = len(buf) if isinstance(buf, bytearray) else buf.nbytes
        if nbytes != n * ndtype.itemsize:
            raise ValueError(f"Wire array {name}{list(shape)} needs {n * ndtype.itemsize} bytes, got {nbytes}.")
        arr = np.frombuffer(buf, dtype=ndtype, count=n).reshape(shape)
        if code in (EXT_NUMPY_INLINE, EXT_NUMPY_FRAME):
            if name == "bfloat16":
                raise ValueError("bfloat16 is not a numpy dtype.")
            return arr
        t = torch.from_numpy(arr)
        return t.view(tdtype) if name == "bfloat16" else t


def _as_buffer(frame: Any) -> memoryview:
    if isinstance(frame, memoryview):
        return frame
    if isinstance(frame, (bytes, bytearray)):
        return memoryview(frame)
    buf = getattr(frame, "buffer", None)  # zmq.Frame (copy=False receive)
    if buf is None:
        raise TypeError(f"Cannot read a frame of type {type(frame).__name__}.")
    return buf
