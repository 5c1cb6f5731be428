"""Typed messages between frontends and the engine core (msgspec, msgpack on the wire).

Hot structs are `array_like` and `omit_defaults`. Tensors (logprobs) ride in
extra frames via the serializer, never as Python lists.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Optional, Union

import msgspec

from vllm_lite.lora.request import LoRARequest
from vllm_lite.pooling_params import PoolingParams
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.spec_decode.metrics import SpecDecodingStats
from vllm_lite.worker.step import LogprobsTensors

PROTOCOL_VERSION = 1


class FinishReason(enum.IntEnum):
    """Why a request ended; `str()` gives vLLM's strings."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:  # "stop" / "length" / "abort" / "error"
        return self.name.lower()


class EngineCoreRequestType(enum.Enum):
    """Frame 0 of every frontend -> core message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    HELLO = b"\x03"
    HEARTBEAT = b"\x04"
    GOODBYE = b"\x05"  # no payload: this frontend detaches; its requests are aborted
    ADD_BATCH = b"\x06"  # EngineCoreRequestBatch: requests the core admits together, before its next step
    STOP_VERDICT = b"\x07"  # StopVerdict: a frontend's answer to outputs that asked for one (stop_verdict_step)


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    # Exactly one of the two (as vLLM): sampling for a generate model, pooling for a pooling model.
    sampling_params: Optional[SamplingParams]
    eos_token_id: Optional[int]
    arrival_time: float
    priority: int = 0
    client_index: int = 0
    cache_salt: Optional[str] = None
    pooling_params: Optional[PoolingParams] = None
    # A cross-encoder pair (vLLM's name): the prompt index where token type 1 begins; None: all type 0.
    compressed_token_type_ids: Optional[int] = None
    # The LoRA adapter this request runs with (vLLM's name); None: the base model.
    lora_request: Optional[LoRARequest] = None
    # Set by offline frontends (LLM / LLMEngine) on a request with stop strings: after a step that gave it a
    # token, the core waits for this frontend's StopVerdict before it steps again (see StopVerdict).
    await_stop_verdict: bool = False


class EngineCoreRequestBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Requests added together (offline ``LLM.generate``), each still validated on its own.

    The core admits a whole batch before it steps again, so the first steps' batches, and with them the
    order of bf16 sums in batched matmuls, do not depend on when each request arrived: the same prompts
    give the same tokens run after run. A batch too big for one message goes in parts; every part but
    the last has ``more`` set and the core holds its steps until the last part (for a few seconds at most).
    """

    requests: list[EngineCoreRequest]
    more: bool = False


class StopVerdict(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A frontend's answer to outputs whose ``stop_verdict_step`` is set: which requests its stop strings ended.

    Stop strings are matched in the frontend's detokenizer. Had the core stepped on meanwhile, a request
    that had just stopped would run in a timing-dependent number of further steps, and since bf16 matmuls
    give row results that depend on the batch's row count, the other requests' tokens would change run to
    run. So for requests flagged ``await_stop_verdict`` the core sends the step's outputs with a step number
    and, before its next step, applies this frontend's verdict for it: the stopped requests are aborted (their
    KV blocks freed) and the batch shrinks at the same step every run. The core does not wait while another
    frontend without a pending verdict has requests (its requests never stall behind this one).
    """

    step: int  # the EngineCoreOutputs.stop_verdict_step it answers
    stopped: list[str] = []  # request ids whose stop string matched in those outputs: aborted before the next step


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[LogprobsTensors] = None
    new_prompt_logprobs_tensors: Optional[LogprobsTensors] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: Union[int, str, None] = None
    num_cached_tokens: int = 0
    # Set when this one request failed in the core (finish_reason is ERROR).
    error: Optional[str] = None
    # On a request's first output only: when the core queued and first scheduled it (time.monotonic()
    # in the core, the clock of EngineCoreOutputs.timestamp), for vLLM's queue/prefill/decode metrics.
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    # A pooling request's result (float32 tensor: [hidden] or [tokens, hidden]); it travels as raw bytes with
    # dtype and shape (serialization.py's tensor record), never pickled.
    pooling_output: Optional[Any] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0  # tokens found this step
    num_preemptions: int = 0  # this step
    step_counter: int = 0
    # Speculative decoding counters of this batch (vLLM's SchedulerStats.spec_decoding_stats); None: none verified.
    spec_decoding_stats: Optional[SpecDecodingStats] = None


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    # msgpack-encodable result (bool/int/float/str/list/dict) or None.
    result: Any = None
    failure_message: Optional[str] = None
    # Exception class name of a failed call ("ValueError", ...), so the caller can re-raise the same kind.
    failure_type: Optional[str] = None


class UtilityRequest(msgspec.Struct, array_like=True):
    """A typed call of a named method on the core (no pickle): method + msgpack-able args."""

    client_index: int
    call_id: int
    method: str
    args: list[Any] = []


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: Optional[SchedulerStats] = None
    timestamp: float = 0.0
    utility_output: Optional[UtilityOutput] = None
    # Set when the core is dying: every pending request must fail with EngineDeadError.
    engine_dead: bool = False
    # Nonzero: these outputs gave a token to a request flagged await_stop_verdict; the core waits for this
    # frontend's StopVerdict(step=stop_verdict_step) before it steps again (unless others have requests).
    stop_verdict_step: int = 0

    def __post_init__(self) -> None:
        if self.timestamp == 0.0:
            self.timestamp = time.monotonic()


# ---------------------------------------------------------------------------- handshake and core -> frontend framing


class EngineCoreOutputType(enum.Enum):
    """Frame 0 of every core -> frontend message."""

    OUTPUTS = b"\x00"  # EngineCoreOutputs
    READY = b"\x01"  # HandshakeReply, accepted
    REFUSED = b"\x02"  # HandshakeReply, refused (reason set)
    HEARTBEAT = b"\x03"  # empty: the core is alive (answers a frontend HEARTBEAT)


class HelloRequest(msgspec.Struct, omit_defaults=True):
    """A frontend's first message on attach: who it is and that it speaks our protocol."""

    protocol_version: int
    auth_token: Optional[str] = None
    client_name: str = ""


class HandshakeReply(msgspec.Struct, omit_defaults=True):
    """READY (accepted: model facts and this frontend's client index) or REFUSED (reason)."""

    accepted: bool
    protocol_version: int = PROTOCOL_VERSION
    reason: Optional[str] = None
    client_index: int = -1
    model: str = ""
    max_model_len: int = 0
    block_size: int = 0
    num_gpu_blocks: int = 0
    vocab_size: int = 0
    # Seconds of silence after which the core drops this frontend and aborts its requests.
    heartbeat_timeout_s: float = 0.0
    # Where the core loaded the model and tokenizer from: an attaching frontend on the same
    # host builds its tokenizer and Processor from these.
    model_path: str = ""
    tokenizer: str = ""
    # The core's request rules an attached frontend must apply the same way (ModelConfig's fields).
    max_logprobs: int = 20
    generation_config: str = "auto"
    # "generate" or "pooling", and a pooling model's resolved PoolerConfig fields: the frontend checks and fills
    # pooling requests as the core will run them.
    runner_type: str = "generate"
    pooler_config: Optional[dict[str, Any]] = None
    convert_type: str = "auto"  # --convert as resolved ("none", "embed", ...): the frontend builds the same model
    # LoRAConfig's fields when the core serves LoRA adapters (--enable-lora), else None.
    lora_config: Optional[dict[str, Any]] = None
    # The core process, for a frontend on the same host to watch (vllm_lite.process_watch): its pid,
    # this host's boot id and the process's start time; a frontend elsewhere relies on heartbeats.
    core_pid: int = 0
    core_host: str = ""
    core_started: int = 0


# ---------------------------------------------------------------------------- engine-core process start-up (launcher)


class EngineCoreArgs(msgspec.Struct, kw_only=True):
    """Everything an engine-core process is started with (one struct over the launcher's pipe, never argv)."""

    vllm_config: bytes  # config.encode_vllm_config(...)
    input_address: str
    output_address: str
    # Listening sockets the parent bound for us (``tcp://...:0``): served on instead of binding again.
    input_fd: Optional[int] = None
    output_fd: Optional[int] = None
    # None: any frontend may attach. Else HELLO must carry this token.
    auth_token: Optional[str] = None
    # Drop a frontend after this much silence; None: never (a private core has one frontend).
    heartbeat_timeout_s: Optional[float] = 10.0
    # On SIGTERM, let running requests finish for at most this long.
    drain_timeout_s: float = 30.0
    # SIGINT too stops the core (daemon). A private core ignores it: its parent decides.
    handle_sigint: bool = False


class EngineCoreReady(msgspec.Struct, kw_only=True):
    """An engine-core process's answer once it serves: the model facts, its KV size and versions."""

    model: str
    model_path: str
    tokenizer: str
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int = 0
    vocab_size: int
    protocol_version: int = PROTOCOL_VERSION
    vllm_lite_version: str = ""
    torch_version: str = ""

    def model_facts(self) -> dict[str, Any]:
        """The facts frontends read (the same keys a handshake gives)."""
        return {
            "model": self.model,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "num_gpu_blocks": self.num_gpu_blocks,
            "vocab_size": self.vocab_size,
        }
