"""``serve``: an OpenAI-compatible HTTP server for one model (see ``engine.serve``)."""

from __future__ import annotations

import argparse
import sys

from engine.commands.common import (
    add_cache_args,
    add_model_args,
    cache_bits,
    int_at_least,
    positive_int,
    stderr_progress,
)
from engine.errors import UsageError
from engine.parallel.command_line import add_placement_args

LOCAL = ("127.0.0.1", "localhost", "::1")


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, tools)")
    add_model_args(p)
    add_cache_args(p)
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=int_at_least(0), default=8000, help="port (default 8000; 0: any free one)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 requests")
    p.add_argument(
        "--served-model-name", default=None, help="the model id clients send (default: the folder's name)"
    )
    p.add_argument(
        "--allowed-media-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder whose images requests may name by path (repeatable; default: none, data URLs only)",
    )
    p.add_argument(
        "--tool-parser",
        default="auto",
        help="tool-call format: auto (from the model; default), hermes, llama3, mistral, harmony, "
        "functiongemma, pythonic",
    )
    p.add_argument(
        "--default-max-tokens",
        type=positive_int,
        default=1024,
        help="reply budget of a request that names none (default 1024)",
    )
    p.add_argument(
        "--cache-tokens",
        type=positive_int,
        default=None,
        help="KV cache size in tokens, shared by all requests (default: the model's context, at most 8192)",
    )
    p.add_argument(
        "--max-body-mb", type=positive_int, default=8, help="largest request body in MiB (default 8)"
    )
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_placement_args(p)
    p.set_defaults(func=run)


def _session(args: argparse.Namespace, bits: tuple[int, int]):
    """The served model's session, placed as ``--split-layers`` / ``--gpu-layers`` / ``--experts-on`` ask."""
    from engine.parallel.command_line import parallel_model
    from engine.session import ChatSession
    from engine.tokenizer import Tokenizer

    placed = parallel_model(args, args.options, None, args.dtype, args.cache_tokens)
    if placed is None:
        return ChatSession.load(
            args.model,
            device=args.device,
            dtype=args.dtype,
            progress=stderr_progress,
            cache_tokens=args.cache_tokens,
            cache_bits=bits,
            options=args.options,
        )
    model, options = placed
    return ChatSession(model, Tokenizer.from_dir(args.model), args.cache_tokens, bits, options)


def run(args: argparse.Namespace) -> int:
    from engine.tool_calls import FORMATS

    if args.tool_parser not in FORMATS:
        raise UsageError(f"--tool-parser must be one of {', '.join(FORMATS)}, got {args.tool_parser!r}")
    bits = cache_bits(args)
    try:
        from engine.serve.runner import serve_forever
        from engine.serve.server import OpenAIServer, ServeOptions
    except ImportError as exc:
        raise UsageError(
            f"serve needs the HTTP stack ({exc.name} is missing): pip install starlette uvicorn"
        ) from None
    session = _session(args, bits)
    options = ServeOptions(
        model_name=args.served_model_name,
        api_key=args.api_key,
        allowed_media_dirs=args.allowed_media_dir,
        tool_format=args.tool_parser,
        default_max_tokens=args.default_max_tokens,
        max_body_bytes=args.max_body_mb * 1024 * 1024,
    )
    server = OpenAIServer(session, options)

    def ready(host: str, port: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        reach = (
            "this machine only; --host 0.0.0.0 to accept other machines"
            if host in LOCAL
            else "reachable from other machines" + ("" if args.api_key else " WITHOUT an API key (--api-key)")
        )
        print(
            f"serving {server.model_name} at http://{shown}:{port}/v1 (OpenAI-compatible; bound to {host}: "
            f"{reach}; tool calls: {server.tool_format}; Ctrl-C stops)",
            flush=True,
        )

    # Ctrl-C: uvicorn finishes what is in flight and stops; the exit status says so (130, as the
    # cli's other commands), whether or not the re-raised signal reaches us as a KeyboardInterrupt.
    if serve_forever(server, args.host, args.port, on_ready=ready, log_level=args.log_level):
        print("interrupted", file=sys.stderr)
        return 130
    return 0
