"""The OpenAI-compatible HTTP server: FastAPI routes over an `AsyncLLM`, run by uvicorn.

`build_app(engine, ...)` wires the endpoints to any engine with AsyncLLM's
interface (tests pass a fake); `run_server(args)` builds the real engine from
CLI arguments, serves until SIGINT/SIGTERM or engine death, and returns the
process exit code: 1 when the engine died, so a supervisor restarts us.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import signal
import socket
import threading
from contextlib import asynccontextmanager
from typing import Any, Callable, Optional, Sequence, Union

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import vllm_lite
from vllm_lite import envs
from vllm_lite.client.exceptions import EngineDeadError
from vllm_lite.entrypoints.openai.errors import (
    AuthenticationError,
    BadRequestError,
    EngineUnavailableError,
    OpenAIServingError,
    as_serving_error,
    error_json,
    internal_error,
    make_error,
)
from vllm_lite.entrypoints.openai.health import HealthMonitor
from vllm_lite.entrypoints.openai.lora_modules import LoRAModulePath
from vllm_lite.entrypoints.openai.metrics import METRICS_CONTENT_TYPE, ServerMetrics
from vllm_lite.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from vllm_lite.entrypoints.openai.protocol_pooling import EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest
from vllm_lite.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm_lite.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm_lite.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from vllm_lite.entrypoints.openai.serving_models import OpenAIServingModels
from vllm_lite.entrypoints.openai.serving_pooling import OpenAIServingPooling
from vllm_lite.entrypoints.openai.serving_score import OpenAIServingRerank, OpenAIServingScores
from vllm_lite.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger(__name__)

# Paths anyone may call without the API key (probes and scrapers).
PUBLIC_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
# Endpoint label values of the HTTP counter; anything else counts as "other" (bounded cardinality).
KNOWN_PATHS = PUBLIC_PATHS | {"/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
# Pooling models' endpoints (vLLM's paths, its /v1 and /v2 aliases included).
POOLING_PATHS = frozenset({"/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"})
KNOWN_PATHS |= POOLING_PATHS
# vLLM's runtime adapter routes (served with $VLLM_ALLOW_RUNTIME_LORA_UPDATING).
LORA_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
KNOWN_PATHS |= LORA_PATHS
# vLLM's profiler routes (served with $VLLM_TORCH_PROFILER_DIR): torch.profiler in the engine core(s).
PROFILE_PATHS = frozenset({"/start_profile", "/stop_profile"})
KNOWN_PATHS |= PROFILE_PATHS


# --max-request-body-bytes default: far more than any prompt max_model_len allows, far less than a flood.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20


class RequestTooLargeError(OpenAIServingError):
    status_code = 413
    err_type = "RequestTooLargeError"


class _BodyTooLarge(HTTPException):
    """Raised from the body stream; an HTTPException so FastAPI's body parsing passes it on unchanged."""

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=_too_large_message(limit))


def _too_large_message(limit: int) -> str:
    return f"Request body too large: the server accepts at most {limit} bytes (--max-request-body-bytes)."


class _BodySizeLimitMiddleware:
    """Pure ASGI: a 413 for a body over ``max_bytes``, before it is parsed, tokenized or even read whole.

    A declared Content-Length over the limit is refused before any byte is read; a chunked body
    is counted as it arrives and refused at the first byte past the limit.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and (not value.isdigit() or int(value) > self.max_bytes):
                await error_json(RequestTooLargeError(_too_large_message(self.max_bytes)))(scope, receive, send)
                return
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message.get("type") == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)


class _AuthAndCountMiddleware:
    """Pure ASGI (streaming and disconnects pass through untouched): API-key check, per-endpoint counts."""

    def __init__(self, app: Any, api_key: Optional[str], metrics: ServerMetrics) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        label = path if path in KNOWN_PATHS else "other"
        if self.api_key is not None and path not in PUBLIC_PATHS and scope.get("method") != "OPTIONS":
            if not self._authorized(scope):
                err = AuthenticationError("Invalid or missing API key (send 'Authorization: Bearer <key>').")
                await error_json(err)(scope, receive, send)
                self.metrics.http_requests.labels(label, str(int(err.status_code))).inc()
                return
        status: list[int] = []

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.http_requests.labels(label, str(status[0]) if status else "none").inc()

    def _authorized(self, scope: dict) -> bool:
        assert self.api_key is not None
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                got = value.decode("latin-1")
                scheme, _, token = got.partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                    return True
        return False


def build_app(
    engine: Any,
    served_model_name: Union[str, Sequence[str], None] = None,
    api_key: Optional[str] = None,
    *,
    health_stuck_timeout_s: float = 60.0,
    health_probe_timeout_s: float = 10.0,
    health_poll_interval_s: float = 1.0,
    engine_dead_grace_s: Optional[float] = 1.0,
    on_engine_dead: Optional[Callable[[str], Any]] = None,
    chat_template: Optional[str] = None,
    response_role: str = "assistant",
    root_path: str = "",
    allowed_origins: Sequence[str] = ("*",),
    allowed_methods: Sequence[str] = ("*",),
    allowed_headers: Sequence[str] = ("*",),
    allow_credentials: bool = False,
    disable_log_requests: bool = False,
    max_request_body_bytes: Optional[int] = DEFAULT_MAX_REQUEST_BODY_BYTES,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: Optional[str] = None,
    lora_modules: Sequence[LoRAModulePath] = (),
    allow_runtime_lora_updating: Optional[bool] = None,
    disable_fastapi_docs: bool = False,
    disable_uvicorn_access_log: bool = False,
) -> FastAPI:
    """The FastAPI app for `engine` (AsyncLLM or anything with its interface).

    The keyword options after `on_engine_dead` are vLLM's server flags of the same names
    (`server_options(args)` reads them from parsed CLI arguments).

    `lora_modules` (--lora-modules) are loaded when the app starts (or earlier by `init_static_loras`);
    `allow_runtime_lora_updating` (default $VLLM_ALLOW_RUNTIME_LORA_UPDATING) adds vLLM's
    /v1/load_lora_adapter and /v1/unload_lora_adapter routes.

    `on_engine_dead(reason)` runs once when the engine is found dead; by
    default the app asks its uvicorn server (set as `app.state.server` by
    `serve_app`) to exit after `engine_dead_grace_s`, with exit code 1.
    """
    if served_model_name is None:
        names = [engine.model_config.name]
    elif isinstance(served_model_name, str):
        names = [served_model_name]
    else:
        names = list(served_model_name)
    if not names or any(not isinstance(n, str) or not n for n in names):
        raise ValueError(f"served_model_name must be a non-empty string or list of them, got {served_model_name!r}.")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty string or None.")
    if max_request_body_bytes is not None and max_request_body_bytes < 0:
        raise ValueError(f"max_request_body_bytes must be >= 0 (0: no limit), got {max_request_body_bytes!r}.")

    metrics = ServerMetrics(names[0])
    add_stat_logger = getattr(engine, "add_stat_logger", None)  # AsyncLLM's hook (test fakes may lack it)
    if add_stat_logger is not None:
        add_stat_logger(metrics)

    async def default_on_dead(reason: str) -> None:
        app.state.engine_dead = True
        server = getattr(app.state, "server", None)
        if server is None or engine_dead_grace_s is None:  # None: stay up, /health says 503
            return
        logger.error("engine died (%s): the server exits in %.1f s", reason, engine_dead_grace_s)

        def stop() -> None:
            server.should_exit = True

        asyncio.get_running_loop().call_later(engine_dead_grace_s, stop)

    async def handle_dead(reason: str) -> None:
        if app.state.core_exit_expected:  # our supervisor is stopping the cores: their exit is not a death
            server = getattr(app.state, "server", None)
            if server is not None:
                server.should_exit = True
            return
        app.state.engine_dead = True
        await default_on_dead(reason)
        if on_engine_dead is not None:
            result = on_engine_dead(reason)
            if asyncio.iscoroutine(result):
                await result

    monitor = HealthMonitor(
        engine,
        stuck_timeout_s=health_stuck_timeout_s,
        probe_timeout_s=health_probe_timeout_s,
        poll_interval_s=health_poll_interval_s,
        on_dead=handle_dead,
    )

    models = OpenAIServingModels(
        engine,
        names,
        model_path=engine.model_config.model,
        max_model_len=int(engine.model_config.max_model_len),
        lora_modules=lora_modules,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await init_static_loras(app)  # a no-op when the caller did it before serving
        monitor.start()
        try:
            yield
        finally:
            await monitor.stop()

    app = FastAPI(
        title="vllm-lite OpenAI-compatible server",
        version=vllm_lite.__version__,
        lifespan=lifespan,
        root_path=root_path,
        # --disable-fastapi-docs: no /openapi.json, /docs, /redoc (vLLM's flag).
        **({"openapi_url": None, "docs_url": None, "redoc_url": None} if disable_fastapi_docs else {}),
    )
    # --disable-uvicorn-access-log, read by serve_app when it configures uvicorn.
    app.state.disable_uvicorn_access_log = disable_uvicorn_access_log
    app.state.engine = engine
    app.state.engine_dead = False
    # Set by a supervisor that stops the cores on purpose (serve_frontend's "stop" control): a core exit then
    # ends this server cleanly instead of counting as an engine death.
    app.state.core_exit_expected = False
    app.state.server = None
    app.state.metrics = metrics
    app.state.health_monitor = monitor
    app.state.openai_serving_models = models
    completion = OpenAIServingCompletion(engine, names, metrics, models=models)
    chat = OpenAIServingChat(
        engine,
        names,
        metrics,
        models=models,
        chat_template=chat_template,
        response_role=response_role,
        enable_auto_tool_choice=enable_auto_tool_choice,
        tool_call_parser=tool_call_parser,
    )
    tokenization = OpenAIServingTokenization(engine, names, metrics, chat_template=chat_template, models=models)
    embedding = OpenAIServingEmbedding(engine, names, metrics)
    pooling = OpenAIServingPooling(engine, names, metrics)
    scores = OpenAIServingScores(engine, names, metrics)
    rerank = OpenAIServingRerank(engine, names, metrics)
    if max_request_body_bytes:  # innermost of the three: a 413 is counted, and CORS headers reach it
        app.add_middleware(_BodySizeLimitMiddleware, max_bytes=int(max_request_body_bytes))
    app.add_middleware(_AuthAndCountMiddleware, api_key=api_key, metrics=metrics)
    # Outermost: CORS preflights are answered before the API-key check (browsers send no key on them).
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(allowed_origins),
        allow_methods=list(allowed_methods),
        allow_headers=list(allowed_headers),
        allow_credentials=allow_credentials,
    )
    request_log = _RequestLog(disable_log_requests)

    async def respond(handler: Callable[[], Any]) -> Any:
        """Run one endpoint: map exceptions to OpenAI errors; engine death also triggers the watchdog."""
        try:
            return await handler()
        except Exception as exc:
            err = as_serving_error(exc)  # an internal error is logged there, with its traceback and error id
            if isinstance(err, EngineUnavailableError):
                await monitor.notify_dead(str(exc))
            return error_json(err)

    # ------------------------------------------------------------------ error shapes
    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts, param = [], None
        for e in errors[:5]:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            if param is None and loc:
                param = loc[0]
            msg = e.get("msg", "invalid")
            if e.get("type") == "extra_forbidden":  # OpenAI's wording for an unknown field
                msg = "Unrecognized request argument supplied (unknown fields are refused, not ignored)"
            parts.append(f"{'.'.join(loc) or 'body'}: {msg}")
        message = "Invalid request: " + "; ".join(parts) if parts else "Invalid request body."
        return error_json(BadRequestError(message, param=param))

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        # Outside an endpoint's own handling (middleware, routing): the same generic, logged 500.
        return error_json(internal_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError", 413: RequestTooLargeError.err_type}.get(
            exc.status_code, "HTTPError"
        )
        body = make_error(str(exc.detail), kind, exc.status_code)
        return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health() -> Response:
        status = await monitor.check()
        if status.healthy:
            return Response(status_code=200)
        return error_json(EngineUnavailableError(f"unhealthy: {status.reason}"))

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": vllm_lite.__version__})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if not app.state.engine_dead:
            try:
                stats = await asyncio.wait_for(engine.call_utility_async("get_stats"), timeout=health_probe_timeout_s)
                if isinstance(stats, dict):
                    metrics.update_engine_stats(stats)
            except Exception as e:  # a scrape must not fail because the core is busy or gone
                logger.debug("engine stats unavailable for /metrics: %s", e)
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(models.show_available_models().model_dump())

    if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING if allow_runtime_lora_updating is None else allow_runtime_lora_updating:
        logger.warning(
            "LoRA adapters can be loaded and unloaded at runtime (/v1/load_lora_adapter): anyone who can reach "
            "this API may load any adapter directory this server can read."
        )

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Any:
            return await respond(lambda: _as_text(models.load_lora_adapter(request)))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Any:
            return await respond(lambda: _as_text(models.unload_lora_adapter(request)))

    if envs.VLLM_TORCH_PROFILER_DIR:
        logger.warning(
            "Torch profiler routes are served (POST /start_profile, /stop_profile; $VLLM_TORCH_PROFILER_DIR=%s): "
            "for development only.",
            envs.VLLM_TORCH_PROFILER_DIR,
        )

        async def _profile(is_start: bool) -> Response:
            logger.info("%s the profiler...", "Starting" if is_start else "Stopping")
            try:
                await (engine.start_profile() if is_start else engine.stop_profile())
            except EngineDeadError:
                raise
            except RuntimeError as e:  # the core's "already running" / "not running": the caller's mistake
                raise BadRequestError(str(e)) from e
            logger.info("Profiler %s.", "started" if is_start else "stopped")
            return Response(status_code=200)

        @app.post("/start_profile")
        async def start_profile() -> Any:
            return await respond(lambda: _profile(True))

        @app.post("/stop_profile")
        async def stop_profile() -> Any:
            return await respond(lambda: _profile(False))

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Any:
        request_log(raw_request, request)
        return await respond(lambda: _as_json(completion.create_completion(request, raw_request)))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Any:
        request_log(raw_request, request)
        return await respond(lambda: _as_json(chat.create_chat_completion(request, raw_request)))

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> Any:
        return await respond(lambda: _as_json(tokenization.tokenize_request(request)))

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Any:
        return await respond(lambda: _as_json(tokenization.detokenize_request(request)))

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Any:
        request_log(raw_request, request)
        return await respond(lambda: _as_json(embedding.create_embedding(request)))

    @app.post("/pooling")
    async def create_pooling(request: PoolingRequest, raw_request: Request) -> Any:
        request_log(raw_request, request)
        return await respond(lambda: _as_json(pooling.create_pooling(request)))

    @app.post("/score")
    @app.post("/v1/score")
    async def create_score(request: ScoreRequest, raw_request: Request) -> Any:
        request_log(raw_request, request)
        return await respond(lambda: _as_json(scores.create_score(request)))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def do_rerank(request: RerankRequest, raw_request: Request) -> Any:
        request_log(raw_request, request)
        return await respond(lambda: _as_json(rerank.do_rerank(request)))

    return app


class _RequestLog:
    """One INFO line per generation request (vLLM's request log); --disable-log-requests turns it off."""

    def __init__(self, disabled: bool) -> None:
        self.disabled = disabled

    def __call__(self, raw_request: Request, request: Any) -> None:
        if self.disabled or not logger.isEnabledFor(logging.INFO):
            return
        client = raw_request.client.host if raw_request.client is not None else "-"
        fields = request.model_dump(exclude_unset=True, exclude={"prompt", "messages"})
        logger.info("request from %s to %s: %s", client, raw_request.url.path, fields)


async def _as_text(coro: Any) -> Response:
    """A 200 with plain text, as vLLM answers the adapter routes."""
    return Response(content=await coro, status_code=200, media_type="text/plain")


async def init_static_loras(app: FastAPI) -> None:
    """Load the app's --lora-modules into the engine now (once): ValueError naming the adapter that failed."""
    if not getattr(app.state, "static_loras_loaded", False):
        await app.state.openai_serving_models.init_static_loras()
        app.state.static_loras_loaded = True


async def _as_json(coro: Any) -> Response:
    result = await coro
    if isinstance(result, Response):
        return result
    return JSONResponse(result.model_dump(exclude_none=False))


# ---------------------------------------------------------------------------- running it


async def serve_app(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: Optional[socket.socket] = None,
    log_level: str = "info",
    ssl_keyfile: Optional[str] = None,
    ssl_certfile: Optional[str] = None,
    freeze_gc: bool = False,
) -> int:
    """Serve until shutdown (HTTPS with both ssl files); returns 1 if the engine died, else 0.

    ``freeze_gc``: this process is the server's own (run_server, `serve`'s frontend processes; never a test's or a
    user's interpreter): its start-up heap (tokenizer, app, torch, pydantic models) is collected and frozen and the
    youngest generation's threshold raised right before uvicorn serves, the engine core's policy
    (gc_heap.freeze_gc_heap; vLLM freezes its API server's heap too), so no full collection walks it mid-stream."""
    import uvicorn

    if (ssl_keyfile is None) != (ssl_certfile is None):
        raise ValueError("HTTPS needs both ssl_keyfile and ssl_certfile.")
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_keep_alive=5,
        lifespan="on",
        access_log=not getattr(app.state, "disable_uvicorn_access_log", False),
        ssl_keyfile=ssl_keyfile,
        ssl_certfile=ssl_certfile,
        # Exit even if a client holds a stream open (the engine may be dead and a supervisor waiting).
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)
    app.state.server = server
    # uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown (to die "by the signal"), which
    # would skip our engine shutdown. Our handler, restored under uvicorn's, just asks it to stop.
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, frame: setattr(server, "should_exit", True))
    if freeze_gc:
        from vllm_lite.core.gc_heap import freeze_gc_heap

        if freeze_gc_heap():
            logger.info(
                "gc: %d start-up objects frozen, young threshold %d", gc.get_freeze_count(), gc.get_threshold()[0]
            )
    try:
        await server.serve(sockets=[sock] if sock is not None else None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if app.state.engine_dead and not app.state.core_exit_expected else 0


def build_engine(args: Any) -> Any:
    """AsyncLLM from CLI args: attach to a running core (--engine) or spawn a private one (--model)."""
    from vllm_lite.client.async_llm import AsyncLLM
    from vllm_lite.entrypoints.openai.cli_args import engine_args_from_cli

    if getattr(args, "engine", None):
        return AsyncLLM.attach(
            args.engine,
            auth_token=getattr(args, "auth_token", None),
            data_parallel_size=getattr(args, "data_parallel_size", 1),
        )
    return AsyncLLM.from_engine_args(engine_args_from_cli(args))


def run_server(args: Any) -> int:
    """Build the engine, serve HTTP, shut the engine down; the return value is the process exit code."""

    async def main() -> int:
        names = args.served_model_name or None
        options = dict(api_key=args.api_key, health_stuck_timeout_s=args.health_stuck_timeout, **server_options(args))
        reattacher = None
        if getattr(args, "engine", None):
            # Attached (as `serve`'s frontends): heartbeats from READY on, the slow start-up off the loop; on
            # core death stay up with /health 503 and re-attach.
            from vllm_lite.entrypoints.reattach import attach_app, attach_target_for_cli

            app, engine, reattacher = await attach_app(
                attach_target_for_cli(args), lambda handle, **on_death: build_app(handle, names, **options, **on_death)
            )
        else:  # a private core (no heartbeats) cannot come back: exit (code 1) after the grace period
            engine = build_engine(args)
        try:
            if reattacher is None:
                await engine.call_utility_async("ping")  # starts the client's receive task on this loop
                app = build_app(engine, names, engine_dead_grace_s=args.engine_dead_grace, **options)
            await init_static_loras(app)  # a bad --lora-modules adapter stops start-up here, naming it
            scheme = "https" if args.ssl_certfile else "http"
            logger.info(
                "OpenAI API on %s://%s:%d%s%s",
                scheme,
                args.host,
                args.port,
                args.root_path,
                " (loopback only: pass --host 0.0.0.0 to serve other machines)" if args.host == "127.0.0.1" else "",
            )
            return await serve_app(
                app,
                host=args.host,
                port=args.port,
                log_level=args.uvicorn_log_level,
                ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile,
                freeze_gc=True,  # this process is the server's (the CLI's main)
            )
        finally:
            if reattacher is not None:
                await reattacher.stop()
            try:
                engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")

    return asyncio.run(main())


def server_options(args: Any) -> dict[str, Any]:
    """build_app's vLLM-named keyword options from parsed server flags (cli_args.make_arg_parser)."""
    from vllm_lite.entrypoints.openai.cli_args import check_tool_args

    check_tool_args(args)  # ValueError before anything starts
    return {
        "chat_template": args.chat_template,
        "response_role": args.response_role,
        "root_path": args.root_path,
        "allowed_origins": args.allowed_origins,
        "allowed_methods": args.allowed_methods,
        "allowed_headers": args.allowed_headers,
        "allow_credentials": args.allow_credentials,
        "disable_log_requests": args.disable_log_requests,
        "max_request_body_bytes": args.max_request_body_bytes,
        "enable_auto_tool_choice": args.enable_auto_tool_choice,
        "tool_call_parser": args.tool_call_parser,
        "lora_modules": list(getattr(args, "lora_modules", None) or []),
        "disable_fastapi_docs": bool(getattr(args, "disable_fastapi_docs", False)),
        "disable_uvicorn_access_log": bool(getattr(args, "disable_uvicorn_access_log", False)),
    }


def main(argv: Optional[list[str]] = None) -> None:
    """`python -m vllm_lite.entrypoints.openai.api_server --model M ...`"""
    import argparse
    import sys

    from vllm_lite.entrypoints.openai.cli_args import check_api_server_args, make_arg_parser

    parser = make_arg_parser(argparse.ArgumentParser(description="vllm-lite OpenAI-compatible server"))
    args = parser.parse_args(argv)
    try:
        check_api_server_args(args)
    except ValueError as e:
        parser.error(str(e))
    sys.exit(run_server(args))


if __name__ == "__main__":
    main()
