"""OpenAI-style errors: one exception type per HTTP status, one JSON shape for all of them.

Every error body is `{"error": {"message", "type", "param", "code"}}`, as the
official client expects, so it raises the matching `openai.*Error`.
"""

from __future__ import annotations

import logging
import uuid
from http import HTTPStatus
from typing import Optional

from fastapi.responses import JSONResponse

from vllm_lite.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class OpenAIServingError(Exception):
    """An error with an HTTP status and an OpenAI error type."""

    status_code: int = HTTPStatus.INTERNAL_SERVER_ERROR
    err_type: str = "InternalServerError"

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_response(self) -> ErrorResponse:
        return make_error(self.message, self.err_type, self.status_code, self.param)


class BadRequestError(OpenAIServingError):
    status_code = HTTPStatus.BAD_REQUEST
    err_type = "BadRequestError"


class AuthenticationError(OpenAIServingError):
    status_code = HTTPStatus.UNAUTHORIZED
    err_type = "AuthenticationError"


class ModelNotFoundError(OpenAIServingError):
    status_code = HTTPStatus.NOT_FOUND
    err_type = "NotFoundError"


class EngineUnavailableError(OpenAIServingError):
    status_code = HTTPStatus.SERVICE_UNAVAILABLE
    err_type = "ServiceUnavailableError"


class InternalServerError(OpenAIServingError):
    """A failure that is not the client's: the body says only that, plus an id to find the logged details by."""

    def __init__(self, error_id: str) -> None:
        super().__init__(f"Internal server error (error id {error_id}); the server log has the details.")
        self.error_id = error_id


def new_error_id() -> str:
    return f"err-{uuid.uuid4().hex[:16]}"


def make_error(message: str, err_type: str, status_code: int, param: Optional[str] = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=int(status_code)))


def error_json(err: OpenAIServingError) -> JSONResponse:
    return JSONResponse(err.to_response().model_dump(), status_code=int(err.status_code))


def as_serving_error(exc: BaseException) -> OpenAIServingError:
    """Map any exception from request handling to its HTTP error (engine death -> 503, bad input -> 400).

    Anything else is ours, not the client's: its type, text and traceback go to the server log under a fresh
    error id, and the client gets a generic 500 carrying that id (internals never reach a response body).
    """
    from vllm_lite.client.exceptions import EngineDeadError

    if isinstance(exc, OpenAIServingError):
        return exc
    if isinstance(exc, EngineDeadError):
        return EngineUnavailableError(f"The engine is not available: {exc}")
    if isinstance(exc, (ValueError, TypeError)):
        return BadRequestError(str(exc), param=_guess_param(str(exc)))
    return internal_error(exc)


def internal_error(exc: BaseException) -> InternalServerError:
    """Log `exc` (with its traceback when it was raised) under a new error id; the 500 the client gets."""
    err = InternalServerError(new_error_id())
    traceback = exc if exc.__traceback__ is not None else None
    logger.error("internal error %s: %s: %s", err.error_id, type(exc).__name__, exc, exc_info=traceback)
    return err


def engine_request_error(message: str) -> InternalServerError:
    """The 500 for a request the engine core finished with an error (`message` is logged, never returned)."""
    return internal_error(RuntimeError(message))


def _guess_param(message: str) -> Optional[str]:
    """SamplingParams' messages start with the field's name ("temperature must be ..."): report it as `param`."""
    head = message.split(" ", 1)[0]
    if head in _KNOWN_PARAMS or (head.isidentifier() and head.islower() and "_" in head):
        return head
    return None


_KNOWN_PARAMS = {
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "logprobs",
    "prompt",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "max_tokens",
    "min_tokens",
    "logit_bias",
    "messages",
    "top_logprobs",
    "best_of",
    "suffix",
    "model",
}
