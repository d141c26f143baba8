"""The calibration token rows: the text the Hessians are estimated from, as ``(rows, cols)`` ids.

Text rows come from the calibration text (the shipped files in ``calibration/``, or the user's
own), cut into rows that start at offsets spread over its whole length; the last rows are random
tokens. With ``generated_rows``, a share of the text rows is replaced by rows the model writes
itself (:mod:`engine.convert.self_calibration`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engine.convert.errors import ConvertError
from engine.convert.options import ConvertOptions
from engine.convert.self_calibration import load_or_generate_rows

CALIBRATION_DIR = Path(__file__).parent / "calibration"


def calibration_text(source: str | Path = "") -> str:
    """The calibration text: the shipped files, or ``source`` (a UTF-8 file, or a folder whose
    regular, non-hidden files are read in name order)."""
    if not source:
        files = sorted(CALIBRATION_DIR.glob("*.txt"))
    else:
        path = Path(source)
        if path.is_dir():
            files = sorted(f for f in path.iterdir() if f.is_file() and not f.name.startswith("."))
        elif path.is_file():
            files = [path]
        else:
            raise ConvertError(f"calibration text {path} does not exist")
    parts = []
    for f in files:
        try:
            parts.append(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            reason = f"{e.reason} at byte {e.start}"
            raise ConvertError(f"calibration text {f} is not UTF-8 text ({reason})") from e
    text = "\n\n".join(parts)
    if not text.strip():
        raise ConvertError(f"calibration text {source or CALIBRATION_DIR} is empty")
    return text


def n_random_rows(rows: int, random_fraction: float) -> int:
    """How many of ``rows`` calibration rows are random tokens (at least one of several)."""
    return min(rows, max(1 if rows > 1 else 0, round(rows * random_fraction)))


def replaced_text_rows(text_rows: int, n_generated: int) -> list[int]:
    """Which of ``text_rows`` text rows (in text order) make way for ``n_generated`` written by the
    model: all but ``text_rows - n_generated`` evenly spaced ones."""
    n_keep = text_rows - n_generated
    keep = {i * text_rows // n_keep for i in range(n_keep)} if n_keep > 0 else set()
    return [r for r in range(text_rows) if r not in keep]


def calibration_ids(
    model_dir: Path,
    rows: int,
    cols: int,
    vocab: int,
    random_fraction: float,
    seed: int,
    text_source: str | Path = "",
) -> torch.Tensor:
    """``(rows, cols)`` token ids: the calibration text (:func:`calibration_text`) tokenized and cut
    into rows, plus random-token rows.

    ``random_fraction >= 1`` makes every row random, and then no tokenizer is needed (timing
    runs on random-weight models, ``engine.commands.convert_bench``).
    """
    gen = torch.Generator().manual_seed(seed)
    n_random = n_random_rows(rows, random_fraction)
    ids: list[int] = []
    if n_random < rows:
        from tokenizers import Tokenizer

        tok_path = model_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise ConvertError(f"{model_dir} has no tokenizer.json (needed for calibration)")
        tokenizer = Tokenizer.from_file(str(tok_path))
        ids = [i for i in tokenizer.encode(calibration_text(text_source)).ids if i < vocab]
    out = torch.empty(rows, cols, dtype=torch.long)
    stream = torch.tensor(ids * (cols // max(len(ids), 1) + 2), dtype=torch.long)
    # Rows start at different offsets so they are not identical copies; a text longer than the
    # rows need is sampled evenly over its whole length rather than only its beginning.
    stride = max(997, len(ids) // max(rows - n_random, 1))
    for r in range(rows - n_random):
        start = (r * stride) % max(len(ids), 1)
        out[r] = stream[start : start + cols]
    if n_random:
        out[rows - n_random :] = torch.randint(0, vocab, (n_random, cols), generator=gen)
    return out


def calibration_rows(
    src: Path,
    work: Path,
    options: ConvertOptions,
    vocab: int,
    device: torch.device,
    log: Callable[[str], None],
    progress: Callable[[float, str], None],
) -> torch.Tensor:
    """The conversion's calibration rows: :func:`calibration_ids` with ``options``, and the share
    ``options.generated_rows`` of the text rows written by the model at ``src`` on ``device``
    (kept in ``work`` for a resume). The snippets the model continues come from the text rows,
    and the text rows kept stay spread over the whole text."""
    from engine.model import load_model

    ids = calibration_ids(
        src,
        options.cal_rows,
        options.cal_cols,
        vocab,
        options.random_rows_fraction,
        options.seed,
        options.cal_text,
    )
    text_rows = ids.shape[0] - n_random_rows(ids.shape[0], options.random_rows_fraction)
    n_generated = min(text_rows, round(text_rows * options.generated_rows))
    if n_generated:
        text_ids = ids[:text_rows].flatten()
        ids[replaced_text_rows(text_rows, n_generated)] = load_or_generate_rows(
            work,
            lambda: load_model(src, device=str(device), dtype=torch.float32),
            text_ids,
            n_generated,
            options.cal_cols,
            options.seed,
            log=log,
            progress=progress,
        )
    log(f" -- calibration: {ids.shape[0]} rows x {ids.shape[1]} tokens ({n_generated} model-written)")
    return ids


__all__ = [
    "CALIBRATION_DIR",
    "calibration_ids",
    "calibration_rows",
    "calibration_text",
    "n_random_rows",
    "replaced_text_rows",
]
