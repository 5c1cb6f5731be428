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

import warnings
from typing import Any, Optional, Sequence, Union

import msgspec
import numpy as np
import torch

# Ext type codes (application-defined, 0..127).
EXT_TORCH = 1
EXT_NUMPY = 2

# Tensors below this many bytes ride inside the msgpack body.
DEFAULT_INLINE_THRESHOLD = 256

Frame = Union[bytes, bytearray, memoryview]

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_TORCH_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}
_NUMPY_DTYPES = {
    "float32",
    "float64",
    "float16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
}

# torch.frombuffer warns on read-only buffers (ZMQ frames are read-only); we
# hand out read-only views on purpose (see module docstring).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

# Ext payload: (dtype name, shape, frame index or inline bytes).
_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(tuple[str, list[int], Union[int, bytes]])


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

    def _buffer_ref(self, buf: memoryview, nbytes: int) -> Union[int, bytes]:
        if nbytes < self._inline_threshold:
            return buf.tobytes()
        assert self._aux is not None
        self._aux.append(buf)
        return len(self._aux) - 1

    def _encode_tensor(self, t: torch.Tensor) -> msgspec.msgpack.Ext:
        name = _TORCH_DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise TypeError(f"Cannot serialize tensor of dtype {t.dtype} on the engine wire.")
        shape = list(t.shape)
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        # uint8 view works for every dtype, including bfloat16 (no numpy equivalent).
        buf = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
        ref = self._buffer_ref(buf, buf.nbytes)
        return msgspec.msgpack.Ext(EXT_TORCH, _meta_encoder.encode((name, shape, ref)))

    def _encode_ndarray(self, a: np.ndarray) -> msgspec.msgpack.Ext:
        name = a.dtype.name
        if name not in _NUMPY_DTYPES:
            raise TypeError(f"Cannot serialize numpy array of dtype {a.dtype} on the engine wire.")
        a = np.ascontiguousarray(a)
        buf = memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")
        ref = self._buffer_ref(buf, buf.nbytes)
        return msgspec.msgpack.Ext(EXT_NUMPY, _meta_encoder.encode((name, list(a.shape), ref)))


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
        if code not in (EXT_TORCH, EXT_NUMPY):
            raise ValueError(f"Unknown msgpack ext type {code} on the engine wire.")
        name, shape, ref = _meta_decoder.decode(data)
        if any(d < 0 for d in shape):
            raise ValueError(f"Negative dimension in wire tensor shape {shape}.")
        if isinstance(ref, int):
            if not 1 <= ref < len(self._aux):
                raise ValueError(f"Wire tensor refers to frame {ref}, message has {len(self._aux)} frames.")
            buf = _as_buffer(self._aux[ref])
        else:
            buf = memoryview(ref)
        if code == EXT_TORCH:
            return _decode_tensor(name, shape, buf)
        return _decode_ndarray(name, shape, buf)


def _as_buffer(frame: Any) -> memoryview:
    if isinstance(frame, memoryview):
        return frame
    if isinstance(frame, (bytes, bytearray)):
        return memoryview(frame)
    buf = getattr(frame, "buffer", None)  # zmq.Frame (copy=False receive)
    if buf is None:
        raise TypeError(f"Cannot read a frame of type {type(frame).__name__}.")
    return buf


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _decode_tensor(name: str, shape: list[int], buf: memoryview) -> torch.Tensor:
    dtype = _TORCH_DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"Unknown tensor dtype {name!r} on the engine wire.")
    n = _numel(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if buf.nbytes != n * itemsize:
        raise ValueError(f"Wire tensor {name}{shape} needs {n * itemsize} bytes, frame has {buf.nbytes}.")
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def _decode_ndarray(name: str, shape: list[int], buf: memoryview) -> np.ndarray:
    if name not in _NUMPY_DTYPES:
        raise ValueError(f"Unknown array dtype {name!r} on the engine wire.")
    dtype = np.dtype(name)
    n = _numel(shape)
    if buf.nbytes != n * dtype.itemsize:
        raise ValueError(f"Wire array {name}{shape} needs {n * dtype.itemsize} bytes, frame has {buf.nbytes}.")
    return np.frombuffer(buf, dtype=dtype).reshape(shape)
