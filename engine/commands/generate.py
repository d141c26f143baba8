"""``generate``: continue a prompt, or answer it as a chat message, streaming to stdout."""

from __future__ import annotations

import argparse
import json
import sys
import time

from engine.commands.common import (
    add_cache_args,
    add_model_args,
    cache_bits,
    check_files_exist,
    positive_int,
    stderr_progress,
)
from engine.errors import SamplingSettingError, UsageError
from engine.generation.sampling import SamplingSettings
from engine.vision.prompt import user_message


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt")
    add_model_args(p)
    add_cache_args(p)
    p.add_argument("-p", "--prompt", required=True)
    p.add_argument(
        "--chat", action="store_true", help="send the prompt as one user message via the chat template"
    )
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument(
        "-n", "--max-new-tokens", type=positive_int, default=256, help="most tokens to generate (default 256)"
    )
    # The sampling options' ranges are SamplingSettings.validate's (see sampling_from_args).
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0 = off, default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (1 = off, default)")
    p.add_argument("--min-p", type=float, default=0.0, help="in [0, 1], relative to the best (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0 (1 = off, default)")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="0 .. 2**64-1 (default: a random one)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--image", action="append", default=[], help="image shown before the prompt (repeatable, with --chat)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema", metavar="FILE", help="output one JSON document valid under this schema"
    )
    shape.add_argument(
        "--regex", metavar="PATTERN", help="output text matching this regular expression in full"
    )
    shape.add_argument(
        "--grammar", metavar="FILE", help="output text from this KBNF grammar (start symbol: start)"
    )
    p.set_defaults(func=run)


def constraint_from_args(args: argparse.Namespace):
    """The constraint the options ask for, or None; compiled before the model loads (fail fast)."""
    from pathlib import Path

    from engine.generation import constraints

    def read(path: str) -> str:
        try:
            return Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise constraints.ConstraintError(f"cannot read {path}: {exc.strerror or exc}") from None

    if getattr(args, "json_schema", None):
        return constraints.json_schema(read(args.json_schema))
    if getattr(args, "regex", None) is not None:
        return constraints.regex(args.regex)
    if getattr(args, "grammar", None):
        return constraints.grammar(read(args.grammar))
    return None


def sampling_from_args(args: argparse.Namespace) -> SamplingSettings:
    """The sampling options as SamplingSettings, validated: a value out of range is a UsageError
    that names the option (the settings' own error names the field)."""
    settings = SamplingSettings(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
    )
    try:
        settings.validate()
    except SamplingSettingError as exc:
        option = "--" + exc.field.replace("_", "-")
        raise UsageError(f"{option} must be {exc.allowed}, got {exc.value}") from None
    return settings


def run(args: argparse.Namespace) -> int:
    from engine.session import ChatSession

    # Everything the command line alone decides is checked before the model loads.
    if args.image and not args.chat:
        raise UsageError("--image needs --chat (images go into a user message)")
    if args.system is not None and not args.chat:
        raise UsageError("--system needs --chat (it is a message of the chat template)")
    check_files_exist(args.image, "image")
    settings = sampling_from_args(args)
    bits = cache_bits(args)
    constraint = constraint_from_args(args)
    session = ChatSession.load(
        args.model,
        device=args.device,
        dtype=args.dtype,
        progress=None if args.json else stderr_progress,
        cache_bits=bits,
        options=args.options,
    )
    media = None  # the images of the prompt, when --image is given
    if args.chat:
        # Without images the content stays a plain string, which every chat template accepts.
        user = {"role": "user", "content": args.prompt}
        if args.image:
            user = user_message(args.prompt, len(args.image))
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [user]
        if args.image:
            ids, media = session.encode_chat_with_images(messages, args.image)
        else:
            ids = session.tokenizer.encode_chat(messages, add_generation_prompt=True)
    else:
        ids = session.tokenizer.encode(args.prompt)
        if not ids:  # a tokenizer that adds no BOS gives nothing to continue
            raise UsageError(
                "the prompt is empty (it encodes to no tokens): give some text with -p, or use --chat"
            )
    text, token_ids, last = [], [], None
    start = time.perf_counter()
    for chunk in session.stream_ids(
        ids, settings, args.max_new_tokens, args.stop, constraint=constraint, media=media
    ):
        text.append(chunk.text)
        token_ids += chunk.token_ids
        last = chunk
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    elapsed = time.perf_counter() - start
    if args.json:
        print(
            json.dumps(
                {
                    "text": "".join(text),
                    "token_ids": token_ids,
                    "prompt_tokens": len(ids),
                    "new_tokens": len(token_ids),
                    "tokens_per_second": last.tokens_per_second if last else 0.0,
                    "stop_reason": last.stop_reason if last else None,
                    "error": last.error if last else None,
                    "elapsed_s": elapsed,
                }
            )
        )
    else:
        print(
            f"\n[{len(token_ids)} tokens, {last.tokens_per_second if last else 0:.1f} tok/s, "
            f"stop: {last.stop_reason if last else None}]",
            file=sys.stderr,
        )
    if last is not None and last.error:
        print(f"error: {last.error}", file=sys.stderr)
        return 3  # the output does not satisfy the constraint
    return 0
