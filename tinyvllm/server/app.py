"""The FastAPI application: routes, the engine loop's life cycle, and errors as OpenAI's error body.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /health   GET /metrics

Every error a client can cause is a 4xx with {"error": {"message", "type", "param", "code"}}; a 500 means a
bug in the server or a failed engine.
"""

from __future__ import annotations

import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from tinyvllm.engine import LLMEngine
from tinyvllm.server.engine_core import EngineProcess
from tinyvllm.server.engine_loop import EngineLoop
from tinyvllm.server.metrics import Metrics
from tinyvllm.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
from tinyvllm.server.prompts import PromptEncoder
from tinyvllm.server.options import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_WAITING_REQUESTS
from tinyvllm.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body, parse_body
from tinyvllm.server.serving import ServerContext, generate

log = logging.getLogger("tinyvllm.server")


def build_app(engine: LLMEngine | EngineProcess, model_name: str, api_key: str | None = None,
              max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """An app serving `engine` as `model_name`: an engine process (what `tinyvllm serve` runs), or an LLMEngine
    of this process, stepped in a thread (engine_core.py). The engine loop starts with the app (its lifespan)
    and is `app.state.engine_loop`; the app's end stops it (an engine process with it)."""
    metrics = Metrics()
    engine_loop = EngineLoop(engine, metrics, max_waiting_requests)
    info = engine_loop.info
    ctx = ServerContext(engine_loop, PromptEncoder(info), model_name)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        yield
        await engine_loop.stop()

    app = FastAPI(title="tinyvllm", lifespan=lifespan)
    app.state.engine_loop = engine_loop
    app.state.metrics = metrics

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, parse_body(ChatCompletionRequest, await request.body()), ctx)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, parse_body(CompletionRequest, await request.body()), ctx)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "tinyvllm", "max_model_len": info.max_model_len}]}

    @app.get("/health")
    async def health():
        if engine_loop.healthy:
            return {"status": "ok"}
        problem = f"the engine failed: {engine_loop.error}" if engine_loop.error else "the engine is not running"
        return JSONResponse(error_body(problem, type="server_error", code="engine_unhealthy"), status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return PlainTextResponse(metrics.render(*engine_loop.stats()), media_type="text/plain; version=0.0.4")

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # unknown route, wrong method
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(error_body(str(exc.detail), code=code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}", type="server_error"),
                            status_code=500)

    # Added last = runs first: the key is checked before the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app
