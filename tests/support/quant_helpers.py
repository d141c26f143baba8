"""Helpers shared by the EXL3 format and converter tests (tests/exl3, tests/convert and the
architectures' conversion tests), imported as ``quant_helpers`` through the tests/support path
entry that tests/conftest.py adds. The fixture lookup itself is in tests/conftest.py."""

from __future__ import annotations

import torch

from engine.exl3.trellis import pack_states, unpack_states

VARIANTS = ("4.0bpw-h6-mul1", "2.5bpw-h4-mcg", "5.5bpw-h8-3inst")


def fp16_bits(x: torch.Tensor) -> torch.Tensor:
    """fp16 bit patterns, for bit-exact comparisons (treats -0.0 and 0.0 as different, NaNs equal)."""
    return x.to(torch.float16).view(torch.int16)


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against the reference ``b`` (both taken as float64)."""
    a, b = a.double(), b.double()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def cheap_encoder(x: torch.Tensor, k: int, table: torch.Tensor, batch: int | None = None) -> torch.Tensor:
    """A fast, valid, low-quality stand-in for the Viterbi (``quantize.encode_tiles``): greedy
    along the trellis (best next code for each value), made tail-biting by pack -> unpack (which
    only changes the first few states)."""
    values = table.float()
    codes = torch.arange(1 << k, device=x.device)
    state = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    out = torch.empty(x.shape, dtype=torch.int32, device=x.device)
    for i in range(x.shape[1]):
        cand = ((state.unsqueeze(1) << k) | codes) & 0xFFFF
        best = (values[cand] - x[:, i : i + 1]).abs().argmin(dim=1)
        state = cand.gather(1, best.unsqueeze(1)).squeeze(1)
        out[:, i] = state.to(torch.int32)
    return unpack_states(pack_states(out, k))


def tiny_convert_options(**changes):
    """Converter options for a tiny test model on the CPU: a few short calibration rows of random
    tokens (tiny checkpoints have no tokenizer), uniform bits (6 by default, head 8); ``changes``
    override any of them."""
    from engine.convert.options import ConvertOptions

    settings = {
        "bits": 6.0,
        "head_bits": 8,
        "cal_rows": 4,
        "cal_cols": 32,
        "device": "cpu",
        "allocation": "uniform",
        "random_rows_fraction": 1.0,
    }
    return ConvertOptions(**{**settings, **changes})
