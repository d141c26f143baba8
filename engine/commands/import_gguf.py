"""``import-gguf FILE OUT_DIR``: convert a GGUF model into a Hugging Face directory the engine loads."""

from __future__ import annotations

import argparse
import sys

from engine.commands.common import stderr_progress


def register(sub) -> None:
    p = sub.add_parser(
        "import-gguf",
        help="convert a GGUF file (llama.cpp) into a Hugging Face model directory",
        description=(
            "Dequantize a GGUF model into safetensors and rebuild its config, tokenizer and chat template."
        ),
    )
    p.add_argument("file", help="the .gguf file")
    p.add_argument("out_dir", help="directory to create (must not exist, or be empty)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16", "int8"],
        help="weight dtype to write (default float32: exact dequantized values; int8: matrices as "
        "int8 with a scale per row, a quarter of the size and of the memory on the CPU)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.loading.gguf_import import import_gguf  # deferred: numpy/gguf only when used

    shown = []

    def progress(fraction: float, message: str) -> None:
        shown.append(fraction)
        stderr_progress(fraction, message)

    try:
        out = import_gguf(
            args.file, args.out_dir, progress=None if args.quiet else progress, dtype=args.dtype
        )
    except BaseException:
        if shown and shown[-1] < 1.0:
            print(file=sys.stderr)  # end the progress line before the error message
        raise
    print(out)
    return 0
