"""The FastAPI application: routes, guards and the engine's lifecycle, over an `EngineClient` only."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pagoda.engine import envs
from pagoda.engine.frontend.engine_client import EngineClient
from pagoda.engine.server import protocol as P
from pagoda.engine.server.errors import APIError, ErrorResponseModel, bad_request, install_error_handlers
from pagoda.engine.server.kv_routes import install_kv_routes
from pagoda.engine.server.lora_routes import install_lora_routes
from pagoda.engine.server.memory_status import install_memory_status
from pagoda.engine.server.middleware import APIKeyMiddleware, BodySizeLimitMiddleware
from pagoda.engine.server.serving import OpenAIServing
from pagoda.engine.server.settings import ServerSettings

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponseModel, "description": text}
    for code, text in {
        400: "Invalid request (the error names the field)",
        401: "Missing or invalid API key",
        404: "Unknown model",
        413: "Request body too large",
        503: "Overloaded (see Retry-After) or engine not running",
    }.items()
}


def pagoda_version() -> str:
    try:
        return version("pagoda")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0.0.0"


def build_app(engine: EngineClient, settings: ServerSettings, exporter: Any = None) -> FastAPI:
    """An app bound to `engine`; the engine starts and stops with the app's lifespan."""
    serving = OpenAIServing(engine, settings, exporter)

    step_failed = getattr(exporter, "step_failed", None)
    if step_failed is not None:
        engine.add_step_failure_listener(step_failed)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()
            serving.close()

    app = FastAPI(title="Pagoda OpenAI-compatible server", version=pagoda_version(), lifespan=lifespan)
    app.state.serving = serving
    app.state.engine = engine
    install_error_handlers(app)

    @app.post("/v1/completions", response_model=P.CompletionResponse, responses=ERROR_RESPONSES)
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        return await serving.create_completion(body, request)

    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses=ERROR_RESPONSES)
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        return await serving.create_chat_completion(body, request)

    def model_cards() -> list[P.ModelCard]:
        """The served names of the base model, then the loaded LoRA adapters."""
        base = serving.model_name
        cards = [
            P.ModelCard(id=name, root=base, max_model_len=serving.max_model_len)
            for name in serving.model_names
        ]
        cards += [
            P.ModelCard(id=a.name, root=a.path, parent=base, max_model_len=serving.max_model_len)
            for a in engine.lora_adapters.values()
        ]
        return cards

    @app.get("/v1/models", response_model=P.ModelList)
    async def models() -> P.ModelList:
        return P.ModelList(data=model_cards())

    @app.get("/v1/models/{model_id:path}", response_model=P.ModelCard, responses=ERROR_RESPONSES)
    async def model(model_id: str) -> P.ModelCard:
        serving.check_model(model_id)
        return next(card for card in model_cards() if card.id == model_id)

    app.state.draining = False  # set on SIGTERM (cli/serve.py): routers stop sending, in-flight work ends
    install_kv_routes(app, engine)
    if settings.allow_runtime_lora_updating or envs.allow_runtime_lora_updating():
        install_lora_routes(app, engine, serving.model_names, ERROR_RESPONSES)
    if engine.info.memory_profile:
        install_memory_status(app, engine.info.memory_profile)

    @app.get("/health")
    async def health() -> Response:
        if app.state.draining and engine.is_alive:
            return JSONResponse(
                {
                    "error": {
                        "message": "draining: finishing in-flight requests before shutdown",
                        "type": "service_unavailable_error",
                        "param": None,
                        "code": "draining",
                    }
                },
                status_code=503,
            )
        if engine.is_alive:
            return Response(status_code=200)
        return JSONResponse(
            {
                "error": {
                    "message": f"engine not running: {engine.dead_reason}",
                    "type": "service_unavailable_error",
                    "param": None,
                    "code": "engine_dead",
                }
            },
            status_code=503,
        )

    @app.get("/version")
    async def get_version() -> dict:
        return {"version": pagoda_version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        body = exporter.render() if exporter is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(body: P.TokenizeRequest) -> dict:
        serving.check_model(body.model)
        serving.check_fields(body)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("Give exactly one of 'prompt' or 'messages'.", "prompt")
        if body.messages is not None:
            if not body.messages:
                raise bad_request("messages must not be empty", "messages")
            serving.check_chat_chars(body.messages)
            text = await serving.off_loop(
                serving.render_chat,
                body.messages,
                body.add_generation_prompt,
                False,
                body.tools,
                body.chat_template_kwargs,
            )
            ids = await serving.off_loop(serving.encode, text, "messages", False)
        else:
            prompt = body.prompt or ""
            serving.check_chars(len(prompt), "prompt")
            ids = await serving.off_loop(serving.encode, prompt, "prompt", body.add_special_tokens)
        return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids}

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(body: P.DetokenizeRequest) -> dict:
        serving.check_model(body.model)
        serving.check_fields(body)
        bad = next((t for t in body.tokens if t >= serving.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"Token id {bad} is outside the vocabulary (0..{serving.vocab_size - 1}).", "tokens"
            )
        return {"prompt": await serving.off_loop(serving.decode, body.tokens)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        try:
            ok = await engine.reset_prefix_cache()
        except Exception as exc:  # noqa: BLE001
            raise APIError(503, f"could not reset the prefix cache: {exc}", code="engine_error") from exc
        if ok is False:
            raise APIError(
                503,
                "The prefix cache could not be reset while requests are running; retry when idle.",
                code="busy",
            )
        return Response(status_code=200)

    # The last added is the outermost: the API key first (decided from headers, before any body byte is
    # read), then the body-size limit, which counts bytes only as the app reads them.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    return app
