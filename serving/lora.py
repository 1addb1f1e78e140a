"""LoRA adapters over HTTP (vLLM's): `--lora-modules name=path ...` (or JSON objects with
"name", "path" and "base_model_name"), each served as a model of its own (`"model": name` picks
it; /v1/models lists it with `parent` set to the base model), and adapters loaded or unloaded
at run time: POST /v1/load_lora_adapter {"lora_name", "lora_path"}, POST /v1/unload_lora_adapter
{"lora_name"} (under /v1: behind --api-key). An unknown adapter is a 404; an unusable one a 400.
"""

import json

from aiohttp import web

from jpaged.lora.request import LoRARequest
from serving.protocol import APIError, field
from serving.request_body import json_body
from serving.serving_engine import OpenAIServing


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """`--lora-modules` values: "name=path" or '{"name": ..., "path": ..., "base_model_name": ...}'
    -> (name, path) pairs; ValueError naming the bad one."""
    modules = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {value!r}: not valid JSON ({e})") from None
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
                raise ValueError(f"--lora-modules {value!r}: expected an object with string 'name' and 'path'")
            name, path = spec["name"], spec["path"]
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: expected name=path")
        if any(name == known for known, _ in modules):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        modules.append((name, path))
    return modules


class OpenAIServingLoRA(OpenAIServing):
    def _lora_cards(self) -> list[dict]:
        return [{"id": name, "object": "model", "created": self.created, "owned_by": "jpaged", "root": lora.lora_path,
                 "parent": self.model_name, "max_model_len": self.max_model_len}
                for name, lora in self.lora_requests.items()]

    def _check_lora_enabled(self):
        if self.engine.engine.lora_manager is None:
            raise APIError("LoRA adapters need a server started with --enable-lora")

    async def load_lora_adapter(self, request):
        body = await json_body(request, self.body_timeout)
        self._check_lora_enabled()
        name, path = field(body, "lora_name", "string"), field(body, "lora_path", "string")
        if not name or not path:
            raise APIError("'lora_name' and 'lora_path' are required", param="lora_name" if not name else "lora_path")
        if name in self.lora_requests or name == self.model_name:
            raise APIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        lora = LoRARequest(name, self._next_lora_id, path)
        try:  # read and checked on the engine thread, between two steps
            await self.engine.call(lambda engine: engine.lora_manager.add(lora))
        except ValueError as e:
            raise APIError(str(e), param="lora_path") from None
        self._next_lora_id += 1
        self.lora_requests[name] = lora
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request):
        body = await json_body(request, self.body_timeout)
        self._check_lora_enabled()
        name = field(body, "lora_name", "string")
        lora = self.lora_requests.pop(name, None) if name else None
        if lora is None:
            raise APIError(f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name",
                           code="model_not_found")
        # Requests already running with it finish with it (read again if its slot was taken).
        await self.engine.call(lambda engine: engine.lora_manager.remove(lora.lora_int_id))
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
