"""The `jpaged` command: `jpaged serve [MODEL]` (the OpenAI-compatible server) and `jpaged generate`.

It lives in serving/ because it starts the server: serving imports jpaged, never the reverse.
Only the standard library and EngineConfig are imported up front, so `--help` and `--version`
answer at once; jax and transformers load when a command runs.
"""

import argparse
import dataclasses
import gc
import logging
import os
import socket
import sys
import typing

from jpaged import __version__
from jpaged.config import MAX_LOGPROBS, RESPONSES_STORE_SIZE, EngineConfig
from serving.responses_store import RESPONSES_STORE_BYTES
from serving.tool_calls import TOOL_CALL_PARSERS
from serving.tool_templates import TOOL_CHAT_TEMPLATES, load_chat_template

if typing.TYPE_CHECKING:
    from serving.server_options import ServerOptions

LOG_LEVELS = ("debug", "info", "warning", "error")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, spelled as vLLM spells them (--max-model-len ...), with the
    field's help text, default and choices."""
    group = parser.add_argument_group("engine")
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = next(t for t in (typing.get_args(field.type) or (field.type,)) if t is not type(None))
        extra = {"choices": field.metadata["choices"]} if "choices" in field.metadata else {}
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default,
                               help=field.metadata.get("help"))
        else:  # dict options come as JSON, lists as "2,3" (EngineConfig parses both)
            group.add_argument(flag, type=str if kind in (dict, list) else kind, default=field.default,
                               help=field.metadata.get("help"), **extra)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def cmd_generate(args) -> int:
    import jpaged

    kwargs = engine_kwargs(args)
    llm = jpaged.LLM(kwargs.pop("model"), **kwargs)
    params = jpaged.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                   top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    prompts = args.prompt or ["Hello, my name is"]
    for out in llm.generate(prompts, params, use_tqdm=False):
        print(f"Prompt: {out.prompt!r}\nGenerated: {out.outputs[0].text!r}\n")
    return 0


def cmd_warmup(args) -> int:
    """Compile every step shape of the engine `jpaged serve` would start with these flags into the
    executable cache, then exit: a container image or CI job built this way starts warm."""
    import time

    from jpaged.engine.llm_engine import LLMEngine
    from jpaged.engine.start_up import executable_cache_dir

    if args.model_tag is not None:
        args.model = args.model_tag
    config = EngineConfig(**dict(engine_kwargs(args), background_warmup=False, enforce_eager=False))
    if not config.executable_cache:
        raise ValueError("--no-executable-cache: there is no cache to fill")
    if config.data_parallel_size > 1:
        raise ValueError("data_parallel_size > 1: warm up one replica's devices at a time (--devices), each with "
                         "data_parallel_size 1")
    start = time.perf_counter()
    engine = LLMEngine(config)
    cache = engine.runner.executable_cache
    print(f"jpaged: {engine.runner.num_compilations} step executables in {cache.directory or executable_cache_dir()} "
          f"({cache.hits} already there) in {time.perf_counter() - start:.1f} s", flush=True)
    engine.shutdown()
    return 0


def check_port(host: str, port: int):
    """A ValueError (one line, exit status 2) when the server could not listen on host:port, found
    before the engine spends a minute loading and compiling. Bound and released as asyncio will
    bind it (SO_REUSEADDR: a port in TIME_WAIT is free)."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: {e.strerror}") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as e:
                raise ValueError(f"cannot listen on {host}:{port}: {e.strerror} (is another server using it? "
                                 "choose another --port)") from None


def serve_options(args) -> "tuple[EngineConfig, ServerOptions]":
    """The engine's and the server's options from `jpaged serve`'s parsed flags, checked (a
    ValueError naming the flag otherwise); also what jpaged.ray's build_app checks its args with."""
    from serving.server_options import ServerOptions, parse_lora_modules

    if args.model_tag is not None:  # `jpaged serve MODEL`, as vLLM
        args.model = args.model_tag
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    if args.responses_store_size < 0:
        raise ValueError(f"--responses-store-size {args.responses_store_size}; expected >= 0")
    if args.responses_store_bytes < 0:
        raise ValueError(f"--responses-store-bytes {args.responses_store_bytes}; expected >= 0")
    if args.data_parallel_external_lb and args.data_parallel_size < 2:
        raise ValueError(f"--data-parallel-external-lb needs --data-parallel-size >= 2 (got "
                         f"{args.data_parallel_size}): it gives each data-parallel replica a port of its own")
    chat_template = load_chat_template(args.chat_template)  # a bad name or path: an error before loading
    options = ServerOptions(
        host=args.host, port=args.port, served_model_name=args.served_model_name or args.model, api_key=args.api_key,
        max_queue=args.max_queue, timeout_keep_alive=args.timeout_keep_alive, chat_template=chat_template,
        max_logprobs=args.max_logprobs, enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details, log_requests=not args.disable_log_requests,
        log_stats=not args.disable_log_stats, allowed_origins=args.allowed_origins, ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile, lora_modules=parse_lora_modules(args.lora_modules),
        enable_lora_runtime_updates=args.enable_lora_runtime_updates, allowed_lora_paths=args.allowed_lora_paths,
        responses_store_size=args.responses_store_size, responses_store_bytes=args.responses_store_bytes,
        profile_dir=args.profile, data_parallel_external_lb=args.data_parallel_external_lb)
    return EngineConfig(**engine_kwargs(args)), options


def cmd_serve(args) -> int:
    # Every check that needs no engine comes first, before jax, transformers or torch are imported
    # (serving.api_server pulls them in): a taken port or a bad value is an error within a second.
    if not args.process_id:  # process 0 serves HTTP (multi-host)
        check_port(args.host, args.port)
    config, options = serve_options(args)
    if options.data_parallel_external_lb and options.port:  # each replica's own port (serving/dp_external_lb.py)
        from serving.dp_external_lb import replica_port

        for rank in range(config.data_parallel_size):
            check_port(args.host, replica_port(options.port, rank))
    if config.kv_events_config is not None and config.kv_events_config.enabled:
        from jpaged.kv_events.config import check_local_addresses

        # Before loading anything: its ports against ours, its ipc paths against what is there.
        check_local_addresses(config.kv_events_config, range(config.data_parallel_size),
                              None if args.process_id else args.port)
    # The server's modules (jax, flax, aiohttp, jpaged) live as long as it does: imported with the
    # cyclic collector off (its passes walked the growing heap again and again: 0.3-0.7 s of a start),
    # then frozen out of its passes. The engine collects and freezes its whole start-up heap when built.
    gc.disable()
    try:
        from jpaged.pooling.engine import resolve_runner
        from serving.api_server import run_server
    finally:
        gc.freeze()
        gc.enable()
    if resolve_runner(config) == "pooling":  # embeddings, classification, scores: serving/pooling_server.py
        from serving.pooling_server import run_pooling_server
        return run_pooling_server(config, options)
    return run_server(config, options)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default said once: "(default: X)" is added unless the help text already says
    what the default is (or it is None: not set). Python's BooleanOptionalAction adds its own
    "(default: X)" to the help text: that one is taken out first."""

    def _get_help_string(self, action):
        text = (action.help or "").replace(" (default: %(default)s)", "")
        if "default" in text or action.default in (None, argparse.SUPPRESS):
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text + " (default: %(default)s)"
        return text


def build_parser(parser_class=argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser_class`: what its subcommands' parsers are too (jpaged.ray's raises ValueError)."""
    # allow_abbrev=False: "--max-num-seq" is an error, not --max-num-seqs (vLLM's parser refuses it too).
    formatter = HelpFormatter
    parser = parser_class(prog="jpaged", description="PagedAttention LLM serving in JAX/Pallas, "
                                     "with vLLM's API", formatter_class=formatter, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"jpaged {__version__}")
    common = parser_class(add_help=False, allow_abbrev=False)  # options every command takes
    common.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="logging level")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server", formatter_class=formatter,
                           parents=[common], allow_abbrev=False)
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model (same as --model)")
    add_engine_args(serve)
    server = serve.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    server.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    server.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    server.add_argument("--max-queue", type=int, default=None,
                        help="answer 503 (with Retry-After) while more than this many requests are waiting")
    server.add_argument("--timeout-keep-alive", type=float, default=30,
                        help="seconds a connection may idle or take to send a whole request")
    server.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, a file holding one, or a shipped tool template by name "
                             f"({', '.join(TOOL_CHAT_TEMPLATES)}: tools rendered in the format of the "
                             "--tool-call-parser of that name), instead of the tokenizer's")
    server.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS, choices=range(0, MAX_LOGPROBS + 1),
                        metavar=f"{{0..{MAX_LOGPROBS}}}",
                        help="most logprobs / top_logprobs a request may ask for")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="answer tool_choice 'auto' (OpenAI's default with tools); needs --tool-call-parser")
    server.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="the model's tool-call format: hermes (Hermes, Qwen 2.5/3), llama3_json (Llama 3.1+), "
                             "mistral (Mistral v0.3); --chat-template NAME renders tools in it")
    server.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                        help="tool_choice 'none': leave the tools out of the chat template (which renders them "
                             "by default)")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="usage.prompt_tokens_details.cached_tokens: the prompt tokens found in the prefix "
                             "cache (--enable-prefix-caching)")
    server.add_argument("--disable-log-requests", action="store_true", help="no log line per request")
    server.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic stats line (throughput, running / waiting, KV cache usage)")
    server.add_argument("--allowed-origins", default=None,
                        help="CORS: comma-separated origins allowed to call the API from a browser ('*': any)")
    server.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key ...")
    server.add_argument("--ssl-certfile", default=None, help="... and this certificate")
    server.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters served as models (with --enable-lora): name=path, or a JSON object "
                             "with name, path and base_model_name")
    server.add_argument("--enable-lora-runtime-updates", action="store_true",
                        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
                             "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, which also turns them on): clients can then "
                             "make the server read adapters from local directories")
    server.add_argument("--profile", default=None, metavar="DIR",
                        help="serve POST /start_profile and /stop_profile (vLLM's routes): a jax.profiler trace "
                             "of the server, written under DIR")
    server.add_argument("--allowed-lora-paths", nargs="+", default=None, metavar="DIR",
                        help="runtime adapter loads only from directories under these (real paths)")
    server.add_argument("--data-parallel-external-lb", action="store_true",
                        help="with --data-parallel-size N: each replica also serves the API on its own port "
                             "(--port + 1 + its rank), for a router that picks replicas itself (llm-d, the Gateway "
                             "API Inference Extension); the front on --port still routes (vLLM's flag)")
    server.add_argument("--responses-store-size", type=int, default=RESPONSES_STORE_SIZE,
                        help="/v1/responses results kept in memory for previous_response_id and GET "
                             "/v1/responses/{id}, the oldest dropped first (0: none)")
    server.add_argument("--responses-store-bytes", type=int, default=RESPONSES_STORE_BYTES,
                        help="... and at most this many bytes of them (their JSON: request input and response), "
                             "the oldest dropped first (0: none kept)")
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate text for prompts and print it", formatter_class=formatter,
                         parents=[common], allow_abbrev=False)
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for several; default: 'Hello, my name is')")
    gen.add_argument("--max-tokens", type=int, default=32, help="most tokens generated per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens "
                                                            "holding this much probability")
    gen.add_argument("--top-k", type=int, default=-1, help="sample from the k likeliest tokens (-1: all)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampling (default: --seed's)")
    gen.add_argument("--ignore-eos", action="store_true", help="go on after the end-of-sequence token")
    warm = sub.add_parser("warmup", help="compile every step shape `serve` would, with the same engine flags, into "
                          "the executable cache ($JPAGED_CACHE_DIR, else ~/.cache/jpaged/xla), and exit",
                          formatter_class=formatter, parents=[common], allow_abbrev=False)
    warm.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model (same as --model)")
    add_engine_args(warm)
    warm.set_defaults(func=cmd_warmup)

    # A one-shot run compiles only the step shapes it uses; `serve` warms up every bucket.
    gen.set_defaults(func=cmd_generate, enforce_eager=True)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    # transformers advises installing PyTorch when it is absent; jpaged needs only its tokenizers.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if args.log_level != "debug":  # jax's INFO line on every CPU start: "Unable to initialize backend 'tpu'"
        logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
