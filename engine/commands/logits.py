"""``logits``: the model's logits for one token sequence, saved as safetensors.

The sequence is ``--ids``, or ``--chat -p TEXT [--image PATH ...]``: one user message holding
the images first, then the text, rendered with the model's chat template and the generation
prompt; the logits then cover every prompt token after the image placeholders are expanded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.commands.common import add_model_args, check_files_exist, parse_ids
from engine.errors import InputNotFoundError, UsageError


def register(sub) -> None:
    p = sub.add_parser("logits", help="write logits [T, vocab] for a token sequence")
    add_model_args(p)
    p.add_argument("--ids", help="comma-separated token ids")
    p.add_argument(
        "--chat", action="store_true", help="score one user message (-p, --image) via the chat template"
    )
    p.add_argument("-p", "--prompt", help="the user message's text (with --chat)")
    p.add_argument(
        "--image", action="append", default=[], help="image file shown before the text (repeatable)"
    )
    p.add_argument("--out", required=True, help="output .safetensors file (tensor 'logits', float32)")
    p.set_defaults(func=run)


def check_out_dir(out: str) -> None:
    """Refuse an --out whose folder does not exist before the model loads (safetensors would fail
    only after the forward pass, with an error that names a temporary file)."""
    folder = Path(out).resolve().parent
    if not folder.is_dir():
        raise InputNotFoundError(f"the folder of --out {out} does not exist ({folder})")


def run(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens
    from engine.model import load_model

    check_out_dir(args.out)
    if args.chat:
        return run_chat(args)
    if args.ids is None:
        raise UsageError("give --ids, or --chat with -p")
    ids = parse_ids(args.ids)
    if not ids:
        raise UsageError("--ids is empty")
    model = load_model(
        args.model, device=args.device, dtype=args.dtype, context=len(ids), options=args.options
    )
    if len(ids) > model.spec.max_position_embeddings:
        raise UsageError(
            f"--ids holds {len(ids)} tokens, more than the model's context of "
            f"{model.spec.max_position_embeddings}"
        )
    vocab = model.spec.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise UsageError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
    cache = PagedKVCache.for_model(model.spec, len(ids), dtype=model.dtype, device=model.device)
    logits = score_tokens(model.module, cache, ids)
    save_file({"logits": logits.float().cpu().contiguous()}, args.out)
    print(f"wrote logits {list(logits.shape)} to {args.out}")
    return 0


def run_chat(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from engine.cache.paged import PagedKVCache
    from engine.config import require_model_dir
    from engine.errors import EngineError
    from engine.generation.step import score_tokens
    from engine.model import load_model
    from engine.tokenizer import Tokenizer
    from engine.vision.prompt import encode_chat_with_images, user_message

    if args.prompt is None:
        raise UsageError("--chat needs -p TEXT")
    check_files_exist(args.image, "image")
    require_model_dir(args.model)  # a wrong path is named as such, not as a missing tokenizer
    tokenizer = Tokenizer.from_dir(args.model)
    model = load_model(args.model, device=args.device, dtype=args.dtype, options=args.options)
    # Without images the content stays a plain string, which every chat template accepts.
    messages = [
        user_message(args.prompt, len(args.image)) if args.image else {"role": "user", "content": args.prompt}
    ]
    media = None
    try:
        if args.image:
            if model.vision is None:
                raise SystemExit(
                    f"error: {model.config.architecture} cannot see images (it has no vision tower)"
                )
            ids, media = encode_chat_with_images(tokenizer, model.vision, messages, args.image)
        else:
            ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    except EngineError as exc:
        raise SystemExit(f"error: {exc}") from None
    cache = PagedKVCache.for_model(model.spec, len(ids), dtype=model.dtype, device=model.device)
    logits = score_tokens(model.module, cache, ids, media=media)
    save_file({"logits": logits.float().cpu().contiguous(), "input_ids": torch_ids(ids)}, args.out)
    print(f"wrote logits {list(logits.shape)} to {args.out}")
    return 0


def torch_ids(ids: list[int]):
    import torch

    return torch.tensor(ids, dtype=torch.long)
