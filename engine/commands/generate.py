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
from engine.parallel.command_line import add_parallel_args
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
    p.add_argument("--dry-multiplier", type=float, default=0.0, help="DRY repetition penalty (0 = off)")
    p.add_argument("--dry-base", type=float, default=1.75, help="DRY penalty growth per token (default 1.75)")
    p.add_argument("--dry-allowed-length", type=int, default=2, help="repeats DRY allows (default 2)")
    p.add_argument("--xtc-threshold", type=float, default=0.1, help="XTC: tokens at least this likely")
    p.add_argument("--xtc-probability", type=float, default=0.0, help="XTC: chance per token (0 = off)")
    p.add_argument("--top-n-sigma", type=float, default=0.0, help="keep logits within n std devs (0 = off)")
    p.add_argument("--typical-p", type=float, default=1.0, help="locally typical sampling mass (1 = off)")
    p.add_argument(
        "--ban",
        action="append",
        default=[],
        metavar="TEXT",
        help="a string the reply never contains (repeatable)",
    )
    add_draft_args(p)
    add_parallel_args(p)
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


_EXTRA_SAMPLERS = (
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "xtc_threshold",
    "xtc_probability",
    "top_n_sigma",
    "typical_p",
)


def add_draft_args(p: argparse.ArgumentParser) -> None:
    """``--draft`` and ``--draft-tokens``: speculative decoding (``engine.generation.speculative``)."""
    p.add_argument(
        "--draft",
        default=None,
        metavar="KIND",
        help="speculative decoding: off, auto (default: ngram on the CPU, off on a GPU), ngram (prompt "
        "lookup), model:DIR (a smaller model with the same tokenizer) or mtp (the model's own multi-token-"
        "prediction layer: Qwen3.5/Qwen3-Next, DeepSeek-V3, GLM-4.5, MiMo) (TRELLIS_DRAFT: the default)",
    )
    p.add_argument(
        "--draft-tokens",
        type=int,
        default=None,
        metavar="K",
        help="most tokens drafted per step, 1..8 (default 4)",
    )


def draft_options(args: argparse.Namespace):
    """``args.options`` with the drafting flags on top, checked before any model loads."""
    from dataclasses import replace
    from pathlib import Path

    from engine.generation.speculative.factory import check_draft_tokens, check_mtp, parse_draft

    options = args.options.with_front_end_draft()
    if getattr(args, "draft", None) is not None:
        kind, directory = parse_draft(args.draft)
        if kind == "mtp" and getattr(args, "model", None):
            from engine.config import ModelConfig

            check_mtp(ModelConfig.from_dir(args.model).raw, Path(args.model).name)
        if directory is not None:
            check_files_exist([str(directory)], "draft model")
        options = replace(options, draft=args.draft)
    if getattr(args, "draft_tokens", None) is not None:
        options = replace(options, draft_tokens=check_draft_tokens(args.draft_tokens))
    return options


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
        # Options other commands' parsers may lack keep their defaults.
        **{name: getattr(args, name) for name in _EXTRA_SAMPLERS if hasattr(args, name)},
        banned_strings=tuple(getattr(args, "ban", ()) or ()),
    )
    try:
        settings.validate()
    except SamplingSettingError as exc:
        option = "--" + exc.field.replace("_", "-")
        value = exc.value
        if exc.field == "banned_strings":
            option, value = "--ban", repr(value)
        raise UsageError(f"{option} must be {exc.allowed}, got {value}") from None
    return settings


def run(args: argparse.Namespace) -> int:
    from contextlib import ExitStack

    from engine.parallel.command_line import parallel_model
    from engine.session import ChatSession
    from engine.tokenizer import Tokenizer

    # Everything the command line alone decides is checked before the model loads.
    if args.image and not args.chat:
        raise UsageError("--image needs --chat (images go into a user message)")
    if args.system is not None and not args.chat:
        raise UsageError("--system needs --chat (it is a message of the chat template)")
    check_files_exist(args.image, "image")
    settings = sampling_from_args(args)
    options = draft_options(args)
    bits = cache_bits(args)
    constraint = constraint_from_args(args)
    with ExitStack() as stack:  # closes a tensor-parallel run's other ranks
        parallel = parallel_model(args, options, stack, args.dtype)
        if parallel is None:
            session = ChatSession.load(
                args.model,
                device=args.device,
                dtype=args.dtype,
                progress=None if args.json else stderr_progress,
                cache_bits=bits,
                options=options,
            )
        else:
            model, options = parallel
            session = ChatSession(model, Tokenizer.from_dir(args.model), cache_bits=bits, options=options)
        return _reply(args, session, settings, constraint)


def _reply(args: argparse.Namespace, session, settings: SamplingSettings, constraint) -> int:
    """Encode the prompt, stream (or collect) the reply and report it; the exit status."""
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
    spec = session.generator.speculation
    drafting = None
    if spec is not None:
        stats = spec.stats
        drafting = {
            "drafter": spec.drafter.kind,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "acceptance_rate": stats.acceptance_rate,
            "tokens_per_verify_step": stats.tokens_per_step,
        }
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
                    "drafting": drafting,
                }
            )
        )
    else:
        drafts = ""
        if drafting is not None and drafting["drafted"]:
            drafts = (
                f", {drafting['drafter']} drafts: {drafting['acceptance_rate']:.0%} of {drafting['drafted']} "
                f"kept, {drafting['tokens_per_verify_step']:.2f} tokens per verify step"
            )
        print(
            f"\n[{len(token_ids)} tokens, {last.tokens_per_second if last else 0:.1f} tok/s{drafts}, "
            f"stop: {last.stop_reason if last else None}]",
            file=sys.stderr,
        )
    if last is not None and last.error:
        print(f"error: {last.error}", file=sys.stderr)
        return 3  # the output does not satisfy the constraint
    return 0
