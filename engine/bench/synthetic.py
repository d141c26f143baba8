"""``synthetic SHAPE -o DIR``: write a random-weight EXL3 model of a published shape to disk.

The model ``bench --synthetic`` builds in memory, as a directory in the converter's layout, so that
other engines (ExLlamaV3: ``tools/peer_exllamav3.py decode DIR``) and ``bench -m DIR`` can be timed on
the same bytes. No calibration: the trellis codes are uniformly random (speed does not depend on
them).
"""

from __future__ import annotations

import argparse
import time

from engine.bench import help_for
from engine.commands.common import run_alone
from engine.units import format_bytes


def register(sub) -> None:
    from engine.exl3.codebooks import CODEBOOKS

    p = sub.add_parser(
        "synthetic",
        help=help_for("synthetic"),
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    p.add_argument("shape", help="a shape name from engine.shapes (e.g. llama3.1-8b), or a config.json path")
    p.add_argument("-o", "--out", required=True, help="directory to create (must not exist, or be empty)")
    p.add_argument("--bpw", type=float, default=4.0, help="whole bits per weight 1..8 (default 4)")
    p.add_argument(
        "--head-bits",
        type=int,
        default=6,
        help="bits of the head, tied or not, as the reference converter writes it (16: fp16)",
    )
    p.add_argument("--codebook", default="mul1", choices=CODEBOOKS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--files-from",
        metavar="DIR",
        help="copy this model directory's other files (tokenizer, chat template) along",
    )
    p.add_argument("--device", default="cpu", help="where the random tensors are made (default cpu)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.bench.speed import parse_bpw, synthetic_shape
    from engine.loading.synthetic_store import write_synthetic_model

    name, hf_config = synthetic_shape(args.shape)
    (bits,) = parse_bpw(str(args.bpw))
    t0 = time.perf_counter()
    try:
        out = write_synthetic_model(
            hf_config,
            bits,
            args.out,
            head_bits=args.head_bits,
            codebook=args.codebook,
            device=args.device,
            name=name,
            seed=args.seed,
            files_from=args.files_from,
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {name} at {bits} bpw to {out}: {format_bytes(size)} in {time.perf_counter() - t0:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_alone(register, "synthetic", argv)


if __name__ == "__main__":
    raise SystemExit(main())
