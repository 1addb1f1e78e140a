"""What `jpaged serve` takes besides the engine's options: read by the app (api_server.py) and
the endpoints it is built from (serving_engine.py), so it lives below both."""

import dataclasses
import json

from jpaged.config import MAX_LOGPROBS, RESPONSES_STORE_SIZE
from serving.responses_store import RESPONSES_STORE_BYTES

# Seconds a connection may sit idle or take to send a whole request (vLLM's --timeout-keep-alive):
# then a half-sent head closes the connection and a half-sent body gets a 408.
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 30


@dataclasses.dataclass
class ServerOptions:
    """What `jpaged serve` takes besides the engine's options (vLLM's flag names)."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "tiny"
    api_key: str | None = None
    max_queue: int | None = None
    timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S
    chat_template: str | None = None  # a template, or a file holding one
    max_logprobs: int = MAX_LOGPROBS
    enable_auto_tool_choice: bool = False  # tool_choice "auto", read by tool_call_parser
    tool_call_parser: str | None = None  # one of tool_calls.TOOL_CALL_PARSERS
    exclude_tools_when_tool_choice_none: bool = False  # tool_choice "none": the template gets no tools
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    log_requests: bool = True
    log_stats: bool = True
    allowed_origins: str | None = None  # comma-separated, or "*"
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    lora_modules: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (name, path): --lora-modules
    enable_lora_runtime_updates: bool = False  # /v1/(un)load_lora_adapter (or VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allowed_lora_paths: list[str] | None = None  # runtime loads only from under these directories
    profile_dir: str | None = None  # --profile: POST /start_profile and /stop_profile write jax.profiler traces here
    responses_store_size: int = RESPONSES_STORE_SIZE  # stored /v1/responses results (0: none)
    responses_store_bytes: int = RESPONSES_STORE_BYTES  # ... and their bytes in all (0: none)
    # With data_parallel_size > 1: each replica's app on its own port too (serving/dp_external_lb.py).
    data_parallel_external_lb: bool = False


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
