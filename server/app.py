"""The FastAPI app: thin routes over Serving, OpenAI-shaped errors everywhere."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, replace
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from importlib.resources import files
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.config import EngineConfig
from engine.heap import freeze_startup_heap
from server.async_engine import AsyncEngine
from server.classify import (
    ClassificationRequest,
    ClassificationResponse,
    create_classification,
)
from server.config import ServerConfig
from server.embeddings import EmbeddingRequest, EmbeddingResponse, create_embedding
from server.engine_loop import EngineFactory, build_engine
from server.engine_wire import EngineEndpoint
from server.errors import APIError
from server.lora_admin import add_lora_routes
from server.metrics import Metrics, MetricsShare
from server.middleware import ApiKeyAuth, BodySizeLimit, RequestId
from server.prompts import ClientDisconnected
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from server.replies import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from server.responses_protocol import ResponseObject, ResponsesRequest
from server.scoring import (
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    create_rerank,
    create_score,
)
from server.serving import Serving
from server.serving_chat import create_chat_completion
from server.serving_completions import create_completion
from server.serving_responses import create_response

logger = logging.getLogger("pagoda.server")
try:
    __version__ = package_version("pagoda")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0.1.0"


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse} for status in statuses}


# /openapi.json as the server behaves: every error is the OpenAI error body (never
# FastAPI's 422), and every route can answer 401 (with --api-key) and 413 (a body over
# the limit); streams are text/event-stream, /metrics is text.
_COMMON = _errors(400, 401, 404, 413)
# One event of a stream, as an SSE parser yields it: `data` is a chunk's JSON or [DONE].
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
_GENERATE = {
    **_errors(400, 401, 404, 413, 500, 503),
    200: {"content": {"text/event-stream": {"schema": _SSE_EVENT}}},
}
_EMBED = _errors(400, 401, 404, 413, 500, 503)
_HEALTH = _errors(503)
_METRICS = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}


def create_app(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    engine_factory: EngineFactory | None = None,
    engine_endpoint: EngineEndpoint | None = None,
    metrics_share: MetricsShare | None = None,
) -> FastAPI:
    """The whole server; `engine_factory` lets tests wrap the engine (fault injection).

    One of several API processes (server/api_servers.py) gets its link to the
    shared engine process and its row of the shared metrics."""
    metrics = Metrics(metrics_share)
    async_engine = AsyncEngine(
        engine_config, server_config, metrics, engine_factory or build_engine, engine_endpoint
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await async_engine.start()  # builds the engine; a failure stops startup
        serving = Serving(async_engine, server_config)
        app.state.serving = serving
        logger.info("serving %s (max_model_len %d)", serving.model_name, serving.max_model_len)
        freeze_startup_heap()  # startup is over: what is alive now lives until shutdown
        try:
            yield
        finally:
            await async_engine.shutdown()
            serving.prompts.close()

    app = FastAPI(title="Pagoda", version=__version__, lifespan=lifespan)
    app.state.async_engine = async_engine
    _add_routes(app, metrics)
    if server_config.allow_runtime_lora_updating:
        add_lora_routes(app, _errors(400, 401, 404, 413, 500, 503))
    _add_dashboard(app, server_config)
    _add_error_handlers(app)
    _drop_422s(app)
    # Starlette runs the last-added middleware first: CORS answers preflights before auth.
    app.add_middleware(BodySizeLimit, max_bytes=server_config.max_request_body_bytes)
    if server_config.api_key:
        app.add_middleware(ApiKeyAuth, api_key=server_config.api_key)
    app.add_middleware(RequestId)
    if server_config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=server_config.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    return app


def _serving(request: Request) -> Serving:
    return request.app.state.serving


def _add_routes(app: FastAPI, metrics: Metrics) -> None:
    @app.post("/v1/completions", response_model=CompletionResponse, responses=_GENERATE)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(_serving(request), body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_GENERATE)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(_serving(request), body, request)

    @app.post("/v1/responses", response_model=ResponseObject, responses=_GENERATE)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(_serving(request), body, request)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_EMBED)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await create_embedding(_serving(request), body, request)

    @app.post("/v1/score", response_model=ScoreResponse, responses=_EMBED)
    @app.post("/score", response_model=ScoreResponse, responses=_EMBED, include_in_schema=False)
    async def score(body: ScoreRequest, request: Request) -> Response:
        return await create_score(_serving(request), body, request)

    @app.post("/v1/rerank", response_model=RerankResponse, responses=_EMBED)
    @app.post("/rerank", response_model=RerankResponse, responses=_EMBED, include_in_schema=False)
    @app.post(
        "/v2/rerank", response_model=RerankResponse, responses=_EMBED, include_in_schema=False
    )
    async def rerank(body: RerankRequest, request: Request) -> Response:
        return await create_rerank(_serving(request), body, request)

    @app.post("/classify", response_model=ClassificationResponse, responses=_EMBED)
    async def classify(body: ClassificationRequest, request: Request) -> Response:
        return await create_classification(_serving(request), body, request)

    @app.get("/v1/models", responses=_COMMON)
    async def models(request: Request) -> ModelList:
        return await _serving(request).models()

    @app.get("/v1/models/{model_id:path}", responses=_COMMON)
    async def model(model_id: str, request: Request) -> ModelCard:
        return await _serving(request).model(model_id)

    @app.post("/tokenize", responses=_COMMON)
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        return await _serving(request).tokenize(body, request)

    @app.post("/detokenize", responses=_COMMON)
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        return await _serving(request).detokenize(body, request)

    @app.get("/tokenizer_info", responses=_COMMON)
    async def tokenizer_info(request: Request) -> dict[str, Any]:
        return _serving(request).tokenizer_info()

    # HEAD and POST variants answer the same, undocumented (one operation per path).
    @app.get("/health", responses=_HEALTH)
    @app.head("/health", include_in_schema=False)
    @app.get("/ping", responses=_HEALTH)
    @app.post("/ping", include_in_schema=False)
    async def health(request: Request) -> Response:
        if not request.app.state.async_engine.is_alive:
            return APIError("The engine is not running.", 503).response()
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse, responses=_METRICS)
    @app.head("/metrics", include_in_schema=False)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


@dataclass
class DashboardInfo:
    model: str  # the served model name, as /v1/models lists it
    uptime_s: float  # since this API process built its app
    device: str
    dtype: str  # resolved as the engine resolves it ("auto" is never shown)
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int | None  # None: sized from free device memory at startup
    prefix_caching: bool
    tensor_parallel_size: int
    api_server_count: int


def _describe(serving: Serving, server_config: ServerConfig) -> DashboardInfo:
    """The header's fixed part, resolved as the engine resolves `auto` (reads config.json)."""
    from engine.models.loader import checkpoint_dtype, load_config

    info = serving.async_engine.info
    config = info.config
    dtype = config.torch_dtype(checkpoint_dtype(load_config(info.model_dir)))
    return DashboardInfo(
        model=serving.model_name,
        uptime_s=0.0,
        device=str(config.torch_device),
        dtype=str(dtype).removeprefix("torch."),
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len or 0,
        block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks,
        prefix_caching=config.enable_prefix_caching,
        tensor_parallel_size=config.tensor_parallel_size,
        api_server_count=server_config.api_server_count,
    )


def _add_dashboard(app: FastAPI, server_config: ServerConfig) -> None:
    """GET /dashboard: one page (server/static/dashboard.html, plain SVG) that polls
    /metrics every second and plots the last ten minutes, rates from counter deltas
    and p50/p99 from histogram bucket deltas as histogram_quantile takes them; GET
    /dashboard/info: what its header shows (with --api-key, the page asks for it)."""
    page = (files("server") / "static" / "dashboard.html").read_bytes()
    started = time.monotonic()
    described: list[DashboardInfo] = []  # worked out on the first request, once

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_NO_CACHE)

    @app.get("/dashboard/info", include_in_schema=False)  # with --api-key, behind it
    async def dashboard_info(request: Request) -> Response:
        if not described:
            described.append(await asyncio.to_thread(_describe, _serving(request), server_config))
        info = replace(described[0], uptime_s=time.monotonic() - started)
        return JSONResponse(asdict(info), headers=_NO_CACHE)


_NO_CACHE = {"Cache-Control": "no-store"}


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        # Never FastAPI's 422 shape: OpenAI answers malformed or mistyped input with 400.
        errors = list(exc.errors())
        if errors and errors[0].get("type") == "json_invalid":
            return APIError("The request body is not valid JSON.", 400).response()
        param = None
        parts = []
        for err in errors[:3]:
            loc = [str(p) for p in err.get("loc", ()) if p != "body"]
            param = param or (loc[0] if loc else None)
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
        return APIError("Invalid request: " + "; ".join(parts), 400, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if exc.status_code != 404 else f"Not found: {request.url.path}"
        return APIError(str(message), exc.status_code, headers=exc.headers).response()

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)  # the text stays in the log
        return APIError("Internal server error.", 500).response()


def _drop_422s(app: FastAPI) -> None:
    """Drop the 422 FastAPI documents for every body: validation errors are 400s."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
