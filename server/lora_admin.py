"""vLLM's endpoints that load and unload LoRA adapters while serving, served with
--allow-runtime-lora-updating (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true): a
client names a directory on the server, so they are off by default.

The engine reads the adapter into a free slot between two steps (--enable-lora;
engine/models/lora_slots.py); from the next step on, requests whose `model` names it
generate with it, in any API process (each learns the engine's adapters from its
reports, and syncs with the engine before refusing a name it does not know). Unloading refuses new requests at once; those running finish with it.
"""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from server.errors import APIError
from server.serving import Serving

_TEXT = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str  # a PEFT directory on the server
    load_inplace: bool = False  # vLLM's: new weights for a loaded name


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; adapters are named here


async def load_lora_adapter(serving: Serving, body: LoadLoRAAdapterRequest) -> str:
    name = body.lora_name
    if not name or not body.lora_path:
        raise APIError("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
    if name == serving.model_name:
        raise APIError(f"'{name}' is the base model's name.", param="lora_name")
    if name in serving.lora_modules and not body.load_inplace:
        raise APIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    await serving.async_engine.update_lora(name, body.lora_path, body.load_inplace)
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload_lora_adapter(serving: Serving, body: UnloadLoRAAdapterRequest) -> str:
    name = body.lora_name
    if name not in serving.lora_modules:
        raise APIError(f"The lora adapter '{name}' cannot be found.", 404, param="lora_name")
    await serving.async_engine.update_lora(name, None)
    return f"Success: LoRA adapter '{name}' removed successfully."


def add_lora_routes(app: FastAPI, responses: dict) -> None:
    def serving(request: Request) -> Serving:
        return request.app.state.serving

    @app.post("/v1/load_lora_adapter", responses={**responses, **_TEXT})
    async def load(body: LoadLoRAAdapterRequest, request: Request) -> Response:
        return PlainTextResponse(await load_lora_adapter(serving(request), body))

    @app.post("/v1/unload_lora_adapter", responses={**responses, **_TEXT})
    async def unload(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
        return PlainTextResponse(await unload_lora_adapter(serving(request), body))
