"""LoRA adapters over HTTP (vLLM's): `--lora-modules name=path ...` (or JSON objects with
"name", "path" and "base_model_name"), each served as a model of its own (`"model": name` picks
it; /v1/models lists it with `parent` set to the base model and its name as `root`: no server
path is shown).

Adapters loaded or unloaded at run time: POST /v1/load_lora_adapter {"lora_name", "lora_path"},
POST /v1/unload_lora_adapter {"lora_name"} (under /v1: behind --api-key). As in vLLM these routes
exist only when the operator opts in (`--enable-lora-runtime-updates`, or the environment variable
VLLM_ALLOW_RUNTIME_LORA_UPDATING=true or 1); otherwise they are a 404. Runtime loads read local
directories only (no hub download), under `--allowed-lora-paths` when it is given (real paths:
symlinks out of them are refused). Any adapter may then be unloaded, `--lora-modules` ones too
(vLLM's behaviour). An unknown adapter is a 404; an unusable one a 400 that names the field or
tensor when the adapter's files could be read, and otherwise says only that the path is not a
loadable adapter (the same for missing, a directory, no permission: nothing about what exists).

Each adapter gets its own id, chosen and recorded with no await between: a name and id are
reserved before the adapter is read and given back if the load fails. The files are read and
checked in a worker thread (never on the event loop or the engine thread), under a timeout, in
memory and time linear in their size (jpaged/file_safety.py): the engine thread only receives the
read adapter. With data parallelism each replica reads the adapter itself, on its engine thread, so
the front end reads and checks it first, in its worker thread: a replica reads only files that
passed. An adapter unloaded while requests run with it is
finished with by those requests (LoRAManager.remove), new ones naming it are refused.
"""

import asyncio
import concurrent.futures
import functools
import logging
import os

from aiohttp import web

from jpaged.data_parallel.off_thread import OffThreadCall
from jpaged.lora.peft import AdapterUnreadable, load_peft_adapter
from jpaged.lora.request import LoRARequest
from serving.protocol import APIError, field
from serving.request_body import json_body
from serving.serving_engine import OpenAIServing
from serving.server_options import parse_lora_modules  # noqa: F401 (its home before; the CLI reads it without jax)

logger = logging.getLogger(__name__)

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
LORA_READ_TIMEOUT_S = 60  # reading one adapter (local files of at most a few hundred MB)


def runtime_updates_allowed(flag: bool) -> bool:
    """--enable-lora-runtime-updates, or vLLM's environment variable set to true or 1."""
    return flag or os.environ.get(RUNTIME_UPDATES_ENV, "0").strip().lower() in ("1", "true")


# What the engine thread (or each data-parallel replica) runs: module functions, so that a
# replica process can be sent them.
def register_read(lora: LoRARequest, adapter, weights, engine):
    engine.lora_manager.register(lora, adapter, weights)


def read_and_register(lora: LoRARequest, allowed_dirs) -> OffThreadCall:
    """A data-parallel replica reads the adapter itself, in a worker thread while it steps (an
    unreadable one: public_message only), then registers it between two steps."""
    return OffThreadCall(functools.partial(_read_adapter, lora, allowed_dirs), functools.partial(_register_adapter, lora))


def _read_adapter(lora: LoRARequest, allowed_dirs, engine):
    try:
        return engine.lora_manager.read(lora, download=False, allowed_dirs=allowed_dirs)
    except AdapterUnreadable as e:
        logger.info("load_lora_adapter %r refused: %s", lora.lora_name, e)
        raise ValueError(e.public_message(lora.lora_path)) from None


def _register_adapter(lora: LoRARequest, engine, read):
    engine.lora_manager.register(lora, *read)


def remove_adapter(lora_int_id: int, engine):
    """Requests running with it finish with it (LoRAManager.remove)."""
    engine.lora_manager.remove(lora_int_id, [*engine.scheduler.waiting, *engine.scheduler.running,
                                             *engine.scheduler.swapped])


def register_lora_modules(engine, modules: list[tuple[str, str]]):
    """The operator's --lora-modules read and checked before serving (ids 1.. as the app's)."""
    if modules and engine.lora_manager is None:
        raise ValueError("--lora-modules needs --enable-lora")
    for i, (name, path) in enumerate(modules):
        lora = LoRARequest(name, i + 1, path)
        engine.lora_manager.register(lora, *engine.lora_manager.read(lora))


class OpenAIServingLoRA(OpenAIServing):
    def __init__(self, engine, options):
        super().__init__(engine, options)
        self.lora_runtime_updates = runtime_updates_allowed(getattr(options, "enable_lora_runtime_updates", False))
        allowed = getattr(options, "allowed_lora_paths", None)
        self.allowed_lora_paths = [os.path.realpath(p) for p in allowed] if allowed else None
        self._loading: dict[str, int] = {}  # names being loaded -> their reserved ids
        # Adapters are read here, a few at a time: a slow file system holds these threads, not others'.
        self._lora_pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="jpaged-lora-read")

    def add_lora_routes(self, app: web.Application):
        if self.lora_runtime_updates:
            logger.warning("runtime LoRA adapter loading is on (%s): clients can load adapters from %s",
                           "--enable-lora-runtime-updates or " + RUNTIME_UPDATES_ENV,
                           self.allowed_lora_paths or "any directory this process can read")
            app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)

    def _lora_cards(self) -> list[dict]:
        return [{"id": name, "object": "model", "created": self.created, "owned_by": "jpaged", "root": name,
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
        if name in self.lora_requests or name in self._loading or name == self.model_name:
            raise APIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        # The name and a new id, reserved together before the first await; ids are never reused.
        lora = LoRARequest(name, self._next_lora_id, path)
        self._next_lora_id += 1
        self._loading[name] = lora.lora_int_id
        handed = False
        try:
            if hasattr(self.engine, "fleet"):  # data parallel: every replica reads it, and restarts replay it
                # Read and checked here first, in a worker thread, so a replica only gets an adapter
                # whose files passed the checks; each replica reads it again in a worker thread while
                # it steps, and registers it between two steps (read_and_register).
                rank = self.engine.engine.config.max_lora_rank
                await self._read_off_loop(path, name, lambda: load_peft_adapter(
                    path, rank, download=False, allowed_dirs=self.allowed_lora_paths))
                handed = True
                await asyncio.shield(self._register_everywhere(lora))
                return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")
            manager = self.engine.engine.lora_manager
            adapter, weights = await self._read_off_loop(path, name, lambda: manager.read(
                lora, download=False, allowed_dirs=self.allowed_lora_paths))
            # Handed to the engine thread and recorded even if the client leaves meanwhile.
            handed = True
            await asyncio.shield(self._register(lora, adapter, weights))
        finally:
            if not handed:
                self._loading.pop(name, None)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _read_off_loop(self, path: str, name: str, read):
        """read() in a worker thread, under the timeout; its refusal as a 400."""
        try:
            return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self._lora_pool, read),
                                          LORA_READ_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(f"lora_path {path!r}: reading the adapter took more than {LORA_READ_TIMEOUT_S} s",
                           param="lora_path") from None
        except AdapterUnreadable as e:
            logger.info("load_lora_adapter %r refused: %s", name, e)
            raise APIError(e.public_message(path), param="lora_path") from None
        except ValueError as e:
            raise APIError(str(e), param="lora_path") from None

    async def _register_everywhere(self, lora: LoRARequest):
        fn = read_and_register(lora, self.allowed_lora_paths)
        try:
            await self.engine.call(fn)
            self.engine.fleet.replayed.append(fn)
            self.lora_requests[lora.lora_name] = lora
        except ValueError as e:
            # Replicas that did read it drop it again (ids are never reused).
            await self.engine.call_all(functools.partial(remove_adapter, lora.lora_int_id))
            raise APIError(str(e), param="lora_path") from None
        finally:
            self._loading.pop(lora.lora_name, None)

    async def _register(self, lora: LoRARequest, adapter, weights):
        """On the engine thread, then recorded; the name's reservation ends here."""
        try:
            await self.engine.call(functools.partial(register_read, lora, adapter, weights))
            self.lora_requests[lora.lora_name] = lora
        except ValueError as e:
            raise APIError(str(e), param="lora_path") from None
        finally:
            self._loading.pop(lora.lora_name, None)

    async def unload_lora_adapter(self, request):
        body = await json_body(request, self.body_timeout)
        self._check_lora_enabled()
        name = field(body, "lora_name", "string")
        lora = self.lora_requests.pop(name, None) if name else None
        if lora is None:
            raise APIError(f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name",
                           code="model_not_found")
        # Requests already running with it finish with it; new ones naming it are refused.
        remove = functools.partial(remove_adapter, lora.lora_int_id)
        if hasattr(self.engine, "fleet"):
            self.engine.fleet.replayed.append(remove)
        await asyncio.shield(self.engine.call(remove))
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
