"""Wire format: typed msgpack with tensors in side frames, no pickle."""

from __future__ import annotations

import pickle
import struct

import msgspec
import numpy as np
import pytest
import torch

from vllm_lite.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    HandshakeReply,
    HelloRequest,
    SchedulerStats,
    UtilityOutput,
    UtilityRequest,
)
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams
from vllm_lite.serialization import MsgpackDecoder, MsgpackEncoder
from vllm_lite.worker.step import LogprobsTensors

torch.set_num_threads(1)


def _logprobs(n: int, k: int) -> LogprobsTensors:
    g = torch.Generator().manual_seed(n * 31 + k)
    return LogprobsTensors(
        torch.randint(0, 1000, (n, k + 1), generator=g, dtype=torch.int64),
        torch.randn(n, k + 1, generator=g, dtype=torch.float32),
        torch.randint(1, 50, (n,), generator=g, dtype=torch.int64),
    )


def test_engine_core_request_roundtrips_with_sampling_params():
    params = SamplingParams(
        temperature=0.7, top_k=5, stop=["x"], logit_bias={3: 1.5}, output_kind=RequestOutputKind.DELTA
    )
    req = EngineCoreRequest("r1", [1, 2, 3], params, eos_token_id=2, arrival_time=12.5, priority=3, client_index=1)
    frames = MsgpackEncoder().encode(req)
    assert len(frames) == 1
    out = MsgpackDecoder(EngineCoreRequest).decode(frames)
    assert out.request_id == "r1" and out.prompt_token_ids == [1, 2, 3] and out.priority == 3
    assert out.sampling_params.temperature == 0.7 and out.sampling_params.top_k == 5
    assert out.sampling_params.stop == ["x"] and out.sampling_params.logit_bias == {3: 1.5}
    assert out.sampling_params.output_kind == RequestOutputKind.DELTA


def test_large_logprob_tensors_travel_in_side_frames_and_decode_equal():
    lp = _logprobs(64, 5)
    outs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("a", [7], new_logprobs=lp, finish_reason=FinishReason.LENGTH)],
        scheduler_stats=SchedulerStats(num_running_reqs=1),
    )
    frames = MsgpackEncoder().encode(outs)
    assert len(frames) == 4  # body + 3 tensors above the inline threshold
    # The body must not contain the tensor data.
    assert len(bytes(frames[0])) < 200
    dec = MsgpackDecoder(EngineCoreOutputs).decode([bytes(f) for f in frames])
    got = dec.outputs[0].new_logprobs
    assert torch.equal(got.logprob_token_ids, lp.logprob_token_ids)
    assert torch.equal(got.logprobs, lp.logprobs)
    assert torch.equal(got.selected_token_ranks, lp.selected_token_ranks)
    assert dec.outputs[0].finish_reason == FinishReason.LENGTH
    assert dec.scheduler_stats.num_running_reqs == 1


def test_decode_is_zero_copy_on_the_received_frame():
    t = torch.arange(1000, dtype=torch.float32)
    frames = MsgpackEncoder().encode(EngineCoreOutput("z", [], new_logprobs=LogprobsTensors(t, t, t)))
    side = bytearray(frames[1])
    dec = MsgpackDecoder(EngineCoreOutput).decode([frames[0], side, frames[2], frames[3]])
    side[0:4] = torch.tensor([42.0]).numpy().tobytes()
    assert dec.new_logprobs.logprob_token_ids[0].item() == 42.0


def test_small_tensors_are_inlined_without_extra_frames():
    t = torch.tensor([[1, 2]], dtype=torch.int64)
    frames = MsgpackEncoder().encode(LogprobsTensors(t, t.float(), torch.tensor([1])))
    assert len(frames) == 1
    dec = MsgpackDecoder(LogprobsTensors).decode(frames)
    assert torch.equal(dec.logprob_token_ids, t) and dec.logprobs.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.int32, torch.bool, torch.uint8])
@pytest.mark.parametrize("shape", [(0,), (), (3, 0), (5,), (17, 9)])
def test_tensor_roundtrip_preserves_dtype_shape_and_values(dtype, shape):
    t = (torch.randn(shape) * 10).to(dtype)
    enc = MsgpackEncoder(inline_threshold=16)
    dec = MsgpackDecoder().decode(enc.encode({"t": t}))["t"]
    assert dec.dtype == dtype and tuple(dec.shape) == shape
    assert torch.equal(dec, t)


def test_non_contiguous_tensor_roundtrips():
    t = torch.arange(200, dtype=torch.int64).reshape(10, 20).t()
    dec = MsgpackDecoder().decode(MsgpackEncoder().encode([t]))[0]
    assert torch.equal(dec, t)


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool", "uint16"])
def test_numpy_array_roundtrip(dtype):
    a = (np.arange(300) % 7).astype(dtype).reshape(3, 100)
    dec = MsgpackDecoder().decode(MsgpackEncoder().encode({"a": a}))["a"]
    assert isinstance(dec, np.ndarray) and dec.dtype == a.dtype and np.array_equal(dec, a)


def test_utility_and_handshake_structs_roundtrip():
    enc = MsgpackEncoder()
    u = UtilityRequest(client_index=2, call_id=9, method="get_stats", args=[1, "x"])
    assert MsgpackDecoder(UtilityRequest).decode(enc.encode(u)) == u
    o = EngineCoreOutputs(utility_output=UtilityOutput(9, result={"free": 3}))
    assert MsgpackDecoder(EngineCoreOutputs).decode(enc.encode(o)).utility_output.result == {"free": 3}
    h = HelloRequest(protocol_version=1, auth_token="t", client_name="c")
    assert MsgpackDecoder(HelloRequest).decode(enc.encode(h)) == h
    r = HandshakeReply(accepted=True, client_index=4, model="m", num_gpu_blocks=10)
    assert MsgpackDecoder(HandshakeReply).decode(enc.encode(r)) == r


def test_wrong_type_is_rejected_by_typed_decoder():
    frames = MsgpackEncoder().encode(UtilityRequest(0, 1, "ping"))
    with pytest.raises(msgspec.ValidationError):
        MsgpackDecoder(EngineCoreRequest).decode(frames)


def test_garbage_bytes_raise_decode_error():
    with pytest.raises(msgspec.DecodeError):
        MsgpackDecoder(EngineCoreRequest).decode([b"\xc1\xff\x00garbage"])


def test_bad_ext_records_are_rejected():
    body = msgspec.msgpack.Encoder().encode
    Ext = msgspec.msgpack.Ext
    dec = MsgpackDecoder()
    f32 = 0  # wire dtype code of float32
    # Frame index out of range.
    with pytest.raises(ValueError, match="frame 5"):
        dec.decode([body(Ext(2, struct.pack("<BBqI", f32, 1, 4, 5)))])
    # Byte count does not match the shape.
    with pytest.raises(ValueError, match="needs 16 bytes, got 3"):
        dec.decode([body(Ext(1, struct.pack("<BBq", f32, 1, 4) + b"\x00" * 3))])
    # Negative dimension, truncated record, unknown dtype code (no lookup by name at all).
    with pytest.raises(ValueError, match="Negative dimension"):
        dec.decode([body(Ext(1, struct.pack("<BBq", f32, 1, -1)))])
    with pytest.raises(ValueError, match="Truncated"):
        dec.decode([body(Ext(1, struct.pack("<BB", f32, 3)))])
    with pytest.raises(ValueError, match="Unknown array dtype code 200"):
        dec.decode([body(Ext(1, struct.pack("<BBq", 200, 1, 1) + b"\x00"))])
    # Unknown ext code.
    with pytest.raises(ValueError, match="Unknown msgpack ext type 77"):
        dec.decode([body(Ext(77, b"\x00"))])


def test_pickle_payload_is_not_executed():
    class Boom:
        def __reduce__(self):
            return (RuntimeError, ("pickle executed",))

    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        MsgpackDecoder(EngineCoreRequest).decode([pickle.dumps(Boom())])


def test_unserializable_object_raises_type_error():
    with pytest.raises(TypeError, match="Cannot serialize object of type object"):
        MsgpackEncoder().encode({"x": object()})
