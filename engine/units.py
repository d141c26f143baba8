"""Sizes, counts and durations as people read them: the one convention of the GUI, the CLI and error messages.

Bytes are shown in binary multiples with their IEC names (KiB, MiB, GiB, TiB): the numbers are
powers of 1024 everywhere in the engine (memory, files, downloads), and calling 2**30 bytes a "GB"
would understate it by 7%. Parameter counts are decimal with the usual K/M/B/T suffixes, as model
names and the Hub's ``num_parameters`` filter write them.

Standard library only: the GUI thread imports this (no torch).
"""

from __future__ import annotations

import re

BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
COUNT_SUFFIXES = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))
_COUNT = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMbBtT]?)\s*")


def format_bytes(n: float, decimals: int = 1) -> str:
    """``1536`` -> ``'1.5 KiB'``, ``512`` -> ``'512 B'``; ``decimals`` digits after the point
    (whole bytes never have any). Negative amounts (a shortfall) keep their sign."""
    value = float(n)
    unit = BYTE_UNITS[0]
    for unit in BYTE_UNITS:
        if abs(value) < 1024 or unit == BYTE_UNITS[-1]:
            break
        value /= 1024
    return f"{value:.0f} B" if unit == "B" else f"{value:.{decimals}f} {unit}"


def format_count(n: float | None, unknown: str = "?") -> str:
    """``134_515_008`` -> ``'135M'``, ``7.24e9`` -> ``'7.24B'`` (three significant digits);
    ``unknown`` for a count nobody knows (None or 0)."""
    if not n:
        return unknown
    for scale, suffix in COUNT_SUFFIXES:
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(int(n))


def parse_count(text: str) -> float:
    """``"7B"`` -> 7e9, ``"500M"`` -> 5e8, ``"1.5b"`` -> 1.5e9: what :func:`format_count` writes
    (and what people type into a parameter filter). Raises ValueError for anything else."""
    m = _COUNT.fullmatch(text)
    if not m:
        raise ValueError(f"not a parameter count: {text!r} (use e.g. 500M, 7B)")
    scales = {suffix.lower(): scale for scale, suffix in COUNT_SUFFIXES}
    return float(m.group(1)) * scales.get(m.group(2).lower(), 1.0)


def format_duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min`` (an ETA or an elapsed time, whole seconds)."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"
