"""``logits``: the model's logits for one token sequence, saved as safetensors."""

from __future__ import annotations

import argparse

from engine.commands.common import add_model_args, parse_ids


def register(sub) -> None:
    p = sub.add_parser("logits", help="write logits [T, vocab] for a token sequence")
    add_model_args(p)
    p.add_argument("--ids", required=True, help="comma-separated token ids")
    p.add_argument("--out", required=True, help="output .safetensors file (tensor 'logits', float32)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens
    from engine.model import load_model

    ids = parse_ids(args.ids)
    if not ids:
        raise SystemExit("error: --ids is empty")
    model = load_model(args.model, device=args.device, dtype=args.dtype, context=len(ids))
    vocab = model.spec.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise SystemExit(f"error: token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
    cache = PagedKVCache.for_model(model.spec, len(ids), dtype=model.dtype, device=model.device)
    logits = score_tokens(model.module, cache, ids)
    save_file({"logits": logits.float().cpu().contiguous()}, args.out)
    print(f"wrote logits {list(logits.shape)} to {args.out}")
    return 0
