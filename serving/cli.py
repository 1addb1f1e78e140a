"""The `jpaged` command: `jpaged serve` (the OpenAI-compatible server) and `jpaged generate`.

It lives in serving/ because it starts the server: serving imports jpaged, never the reverse."""

import argparse
import dataclasses
import logging
import sys
import typing

from jpaged.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, spelled as vLLM spells them (--max-model-len ...)."""
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = next(t for t in (typing.get_args(field.type) or (field.type,)) if t is not type(None))
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            parser.add_argument(flag, type=kind, default=field.default)


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


def cmd_serve(args) -> int:
    from serving.api_server import run_server

    return run_server(EngineConfig(**engine_kwargs(args)), host=args.host, port=args.port,
                      served_model_name=args.served_model_name, api_key=args.api_key, max_queue=args.max_queue,
                      timeout_keep_alive=args.timeout_keep_alive)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="jpaged", description="PagedAttention LLM serving in JAX/Pallas")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    serve.add_argument("--max-queue", type=int, default=None,
                       help="answer 503 while more than this many requests are waiting")
    serve.add_argument("--timeout-keep-alive", type=float, default=30,
                       help="seconds a connection may idle or take to send a whole request (default: 30)")
    serve.set_defaults(func=cmd_serve)
    gen = sub.add_parser("generate", help="generate text for prompts and print it")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    # A one-shot run compiles only the step shapes it uses; `serve` warms up every bucket.
    gen.set_defaults(func=cmd_generate, enforce_eager=True)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
