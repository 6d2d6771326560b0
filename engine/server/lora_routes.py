"""LoRA adapters while serving (docs/lora.md): POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

vLLM's routes and answers (plain-text success, 400 for an adapter that cannot be served, 404 for unloading a
name nobody has), behind the API key like every route but the probes, and like vLLM's only where enabled
(--allow-runtime-lora-updating or VLLM_ALLOW_RUNTIME_LORA_UPDATING: app.py installs them then, so they are
404s otherwise). The adapter is read in the engine core, which also refuses loads past --max-cpu-loras and
words every unreadable path the same; the served names that requests are checked against are the client's
(`EngineClient.lora_adapters`).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pagoda.engine.frontend.engine_client import EngineClient, EngineDeadError
from pagoda.engine.server import protocol as P
from pagoda.engine.server.errors import APIError, bad_request


def install_lora_routes(app: FastAPI, engine: EngineClient, model_names: list[str], responses: dict) -> None:
    """``model_names``: the base model's served names, which no adapter may take."""

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=responses)
    async def load_lora_adapter(body: P.LoadLoRAAdapterRequest) -> PlainTextResponse:
        if body.lora_name in model_names:
            raise bad_request(f"LoRA adapter name {body.lora_name!r} is the base model's name", "lora_name")
        try:
            await engine.load_lora_adapter(body.lora_name, body.lora_path)
        except ValueError as exc:
            raise bad_request(str(exc)) from exc  # the message says whether the name or the path is at fault
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from exc
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=responses)
    async def unload_lora_adapter(body: P.UnloadLoRAAdapterRequest) -> PlainTextResponse:
        try:
            await engine.unload_lora_adapter(body.lora_name)
        except KeyError as exc:
            raise APIError(404, str(exc.args[0]), param="lora_name", code="model_not_found") from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from exc
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
