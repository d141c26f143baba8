"""``ppl``: perplexity over a text file, in non-overlapping windows of ``--ctx`` tokens."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from engine.commands.common import add_cache_args, add_model_args, cache_bits


def register(sub) -> None:
    p = sub.add_parser("ppl", help="perplexity of a model on a text file")
    add_model_args(p)
    add_cache_args(p)
    p.add_argument("--text-file", required=True)
    p.add_argument("--ctx", type=int, default=512, help="window length in tokens")
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def window_nll(logits: torch.Tensor, ids: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of ``ids[1:]`` given ``logits`` for ``ids[:-1]``, and the count."""
    targets = torch.tensor(ids[1:], device=logits.device)
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), targets, reduction="sum")
    return float(nll), len(ids) - 1


def perplexity(
    model, tokenizer, text: str, ctx: int, max_windows: int | None = None, bits: tuple[int, int] = (16, 16)
) -> tuple[float, int]:
    """Windows start with the tokenizer's BOS (where it adds one) and are scored independently."""
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens

    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = [tokenizer.bos_token_id] if tokenizer.encode("", add_special_tokens=True) else []
    step = ctx - len(bos)
    cache = PagedKVCache.for_model(model.spec, ctx, dtype=model.dtype, device=model.device, bits=bits)
    total, count = 0.0, 0
    for n, start in enumerate(range(0, len(ids) - 1, step)):
        if max_windows is not None and n >= max_windows:
            break
        window = bos + ids[start : start + step]
        if len(window) < 2:
            break
        nll, k = window_nll(score_tokens(model.module, cache, window), window)
        total, count = total + nll, count + k
    return math.exp(total / count), count


def run(args: argparse.Namespace) -> int:
    from engine.model import load_model
    from engine.tokenizer import Tokenizer

    text = Path(args.text_file).read_text(encoding="utf-8")
    tokenizer = Tokenizer.from_dir(args.model)
    model = load_model(args.model, device=args.device, dtype=args.dtype, context=args.ctx)
    ppl, tokens = perplexity(model, tokenizer, text, args.ctx, args.max_windows, cache_bits(args))
    print(
        json.dumps({"ppl": ppl, "tokens": tokens})
        if args.json
        else f"perplexity {ppl:.4f} over {tokens} tokens"
    )
    return 0
