"""``generate``: continue a prompt, or answer it as a chat message, streaming to stdout."""

from __future__ import annotations

import argparse
import json
import sys
import time

from engine.commands.common import add_cache_args, add_model_args, cache_bits, stderr_progress
from engine.errors import EngineError
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
    p.add_argument("-n", "--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
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


def run(args: argparse.Namespace) -> int:
    from engine.session import ChatSession

    if args.image and not args.chat:
        raise SystemExit("error: --image needs --chat (images go into a user message)")
    constraint = constraint_from_args(args)
    session = ChatSession.load(
        args.model,
        device=args.device,
        dtype=args.dtype,
        progress=None if args.json else stderr_progress,
        cache_bits=cache_bits(args),
    )
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
    media = None  # the images of the prompt, when --image is given
    if args.chat:
        # Without images the content stays a plain string, which every chat template accepts.
        user = {"role": "user", "content": args.prompt}
        if args.image:
            user = user_message(args.prompt, len(args.image))
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [user]
        if args.image:
            try:
                ids, media = session.encode_chat_with_images(messages, args.image)
            except EngineError as exc:
                raise SystemExit(f"error: {exc}") from None
        else:
            ids = session.tokenizer.encode_chat(messages, add_generation_prompt=True)
    else:
        ids = session.tokenizer.encode(args.prompt)
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
