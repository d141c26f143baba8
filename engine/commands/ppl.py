"""``ppl``: perplexity over a text file, in non-overlapping windows of ``--ctx`` tokens; with
``--reference DIR``, also the mean KL divergence of the model's next-token distribution from another
model's on the same windows (a quantization's cost, issue 3), and how often their top tokens agree.
The ``quality`` command builds its tables from the same functions. Progress (windows scored) goes
to stderr."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from engine.commands.common import (
    add_cache_args,
    add_model_args,
    cache_bits,
    int_at_least,
    positive_int,
    read_text_file,
)
from engine.commands.progress import Progress
from engine.errors import UsageError

ProgressFn = Callable[[int, int], None]  # (windows done, windows in all)

DENSE = (16, 16)  # cache bits: unquantized keys and values


def register(sub) -> None:
    p = sub.add_parser("ppl", help="perplexity of a model on a text file (and KL against a reference)")
    add_model_args(p)
    add_cache_args(p)
    p.add_argument("--text-file", required=True)
    # Two tokens at least: a window scores every token after its first.
    p.add_argument("--ctx", type=int_at_least(2), default=512, help="window length in tokens (default 512)")
    p.add_argument("--max-windows", type=positive_int, default=None)
    p.add_argument(
        "--reference",
        metavar="DIR",
        help="another model directory with the same tokenizer (e.g. the unquantized source): also "
        "report the mean KL(reference || model) over every scored position and the top-1 agreement",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def text_windows(tokenizer, text: str, ctx: int, max_windows: int | None = None) -> list[list[int]]:
    """The windows ``ppl`` scores: ``ctx`` tokens each (BOS first where the tokenizer adds one)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = [tokenizer.bos_token_id] if tokenizer.encode("", add_special_tokens=True) else []
    step = ctx - len(bos)
    windows = []
    for start in range(0, len(ids) - 1, step):
        window = bos + ids[start : start + step]
        if len(window) < 2 or (max_windows is not None and len(windows) >= max_windows):
            break
        windows.append(window)
    return windows


def window_logprobs(model, windows: list[list[int]], bits: tuple[int, int] = DENSE) -> Iterator[torch.Tensor]:
    """float32 log-softmax of the logits predicting ``window[1:]``, one window at a time, with a KV
    cache of ``bits`` (keys, values)."""
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens

    cache = PagedKVCache.for_model(
        model.spec, max(len(w) for w in windows), dtype=model.dtype, device=model.device, bits=bits
    )
    with torch.inference_mode():
        for window in windows:
            logits = score_tokens(model.module, cache, window)[:-1]
            yield torch.log_softmax(logits.float(), dim=-1)


def reference_logprobs(
    model, windows: list[list[int]], progress: ProgressFn | None = None
) -> list[torch.Tensor]:
    """The reference model's log-probabilities, kept on the CPU (float32: KL of a near-lossless
    row is ~1e-4 nats, below what fp16 log-probabilities resolve)."""
    out = []
    for lp in window_logprobs(model, windows):
        out.append(lp.cpu())
        if progress is not None:
            progress(len(out), len(windows))
    return out


def score(
    model,
    windows: list[list[int]],
    reference: list[torch.Tensor] | None,
    bits: tuple[int, int] = DENSE,
    progress: ProgressFn | None = None,
) -> dict:
    """Perplexity over ``windows``; with ``reference``, mean KL(reference || model) and top-1
    agreement. ``progress(done, total)`` after each window."""
    nll, kl, agree, count = 0.0, 0.0, 0, 0
    for i, (window, lq) in enumerate(zip(windows, window_logprobs(model, windows, bits))):
        targets = torch.tensor(window[1:], device=lq.device)
        nll += float(-lq.gather(1, targets[:, None]).sum())
        count += len(targets)
        if reference is not None:
            lp = reference[i].to(lq.device)
            if lp.shape != lq.shape:
                raise ValueError(
                    f"the reference scores {lp.shape[-1]} tokens per position, the model {lq.shape[-1]}: "
                    "KL needs the same vocabulary"
                )
            kl += float((lp.exp() * (lp - lq)).sum(-1).double().sum())
            agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
        if progress is not None:
            progress(i + 1, len(windows))
    out = {"ppl": math.exp(nll / count), "tokens": count}
    if reference is not None:
        out["mean_kl"] = kl / count
        out["top1_agree"] = agree / count
    return out


def perplexity(
    model, tokenizer, text: str, ctx: int, max_windows: int | None = None, bits: tuple[int, int] = DENSE
) -> tuple[float, int]:
    """Windows start with the tokenizer's BOS (where it adds one) and are scored independently."""
    result = score(model, text_windows(tokenizer, text, ctx, max_windows), None, bits)
    return result["ppl"], result["tokens"]


def check_window_fits(model_dir: str | Path, ctx: int, option: str = "--ctx") -> None:
    """Refuse a window longer than the model's context (positions past it have no trained
    meaning: the perplexity would be a number about nothing), as generate refuses such a prompt.
    Reading config.json first also reports a missing model directory as such."""
    from engine.config import ModelConfig

    context = ModelConfig.from_dir(model_dir).context_length
    if ctx > context:
        raise UsageError(f"{option} {ctx} is longer than the context of {model_dir} ({context} tokens)")


def run(args: argparse.Namespace) -> int:
    from engine.model import load_model
    from engine.tokenizer import Tokenizer

    bits = cache_bits(args)
    check_window_fits(args.model, args.ctx)
    if args.reference:
        check_window_fits(args.reference, args.ctx)
    text = read_text_file(args.text_file)
    tokenizer = Tokenizer.from_dir(args.model)
    windows = text_windows(tokenizer, text, args.ctx, args.max_windows)
    if not windows:
        raise UsageError(f"{args.text_file} is too short for one window (it needs two tokens at least)")
    reference = None
    if args.reference:
        if text_windows(Tokenizer.from_dir(args.reference), text, args.ctx, args.max_windows) != windows:
            raise SystemExit(
                f"error: the reference {args.reference} tokenizes the text differently from {args.model}: "
                "KL needs the same tokenizer"
            )
        ref_model = load_model(
            args.reference, device=args.device, dtype=args.dtype, context=args.ctx, options=args.options
        )
        reference = reference_logprobs(ref_model, windows, Progress(f"reference {args.reference}"))
        del ref_model
    model = load_model(
        args.model, device=args.device, dtype=args.dtype, context=args.ctx, options=args.options
    )
    try:
        result = score(model, windows, reference, bits, Progress(f"scoring {len(windows)} windows"))
    except ValueError as exc:  # the reference's vocabulary differs
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(result))
    else:
        line = f"perplexity {result['ppl']:.4f} over {result['tokens']} tokens"
        if reference is not None:
            line += (
                f"; KL(reference || model) {result['mean_kl']:.5f} nats, "
                f"top-1 agreement {result['top1_agree'] * 100:.1f}%"
            )
        print(line)
    return 0
