"""OpenAI-style errors: one exception type per HTTP status, one JSON shape for all of them.

Every error body is `{"error": {"message", "type", "param", "code"}}`, as the
official client expects, so it raises the matching `openai.*Error`.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Optional

from fastapi.responses import JSONResponse

from vllm_lite.entrypoints.openai.protocol import ErrorInfo, ErrorResponse


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


def make_error(message: str, err_type: str, status_code: int, param: Optional[str] = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=int(status_code)))


def error_json(err: OpenAIServingError) -> JSONResponse:
    return JSONResponse(err.to_response().model_dump(), status_code=int(err.status_code))


def as_serving_error(exc: BaseException) -> OpenAIServingError:
    """Map any exception from request handling to its HTTP error (engine death -> 503, bad input -> 400)."""
    from vllm_lite.client.exceptions import EngineDeadError

    if isinstance(exc, OpenAIServingError):
        return exc
    if isinstance(exc, EngineDeadError):
        return EngineUnavailableError(f"The engine is not available: {exc}")
    if isinstance(exc, (ValueError, TypeError)):
        return BadRequestError(str(exc), param=_guess_param(str(exc)))
    return OpenAIServingError(f"Internal server error: {type(exc).__name__}: {exc}")


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
