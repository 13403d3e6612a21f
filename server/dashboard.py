"""GET /dashboard: one page that polls /metrics every second and plots the last ten
minutes; GET /dashboard/info: what its header shows (model, uptime, configuration).

The page (server/static/dashboard.html) is one dependency-free file (plain SVG).
It plots the `pagoda:` series Prometheus scrapes, taking rates from counter
deltas and p50/p99 from histogram bucket deltas as histogram_quantile does.
With --api-key, /dashboard/info wants the key like /v1/*: the page asks for it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, replace
from importlib.resources import files
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.config import EngineConfig
from server.config import ServerConfig


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


def describe(engine: Any, model_name: str, server_config: ServerConfig) -> DashboardInfo:
    """The header's fixed part, resolved as the engine resolves `auto` (reads config.json)."""
    from engine.models.loader import checkpoint_dtype, load_config

    config: EngineConfig = engine.config  # `engine`: the EngineInfo
    dtype = config.torch_dtype(checkpoint_dtype(load_config(engine.model_dir)))
    return DashboardInfo(
        model=model_name,
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


def add_dashboard(app: FastAPI, server_config: ServerConfig) -> None:
    page = (files("server") / "static" / "dashboard.html").read_bytes()
    started = time.monotonic()
    described: list[DashboardInfo] = []  # worked out on the first request, once

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_NO_CACHE)

    @app.get("/dashboard/info", include_in_schema=False)  # with --api-key, behind it
    async def dashboard_info(request: Request) -> Response:
        if not described:
            state = request.app.state
            described.append(
                await asyncio.to_thread(
                    describe, state.async_engine.info, state.serving.model_name, server_config
                )
            )
        info = replace(described[0], uptime_s=time.monotonic() - started)
        return JSONResponse(asdict(info), headers=_NO_CACHE)


_NO_CACHE = {"Cache-Control": "no-store"}
