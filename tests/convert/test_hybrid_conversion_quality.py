"""Trained tiny hybrids converted at 4.0 bpw with the real trellis encoder keep their perplexity
(issue 35): a Qwen3.5 (gated delta nets + gated attention) and a NemotronH (Mamba-2, attention and
squared-ReLU MLP blocks), trained by tools/train_tiny_hybrid.py (tests/data/tiny-hybrids/), each
convert, load back with every projection quantized, and score within 3% of the unquantized model's
perplexity on tests/data/public_domain.txt, text that neither their training nor the converter's
calibration saw.

Trained rather than random models: a random model's perplexity is ~its vocabulary whatever its
weights, so a broken conversion would pass; the test first checks the source scores far below.

CPU cost: the Viterbi encoder runs at ~60 ms per 256-weight tile on two cores, and the default
scale search encodes 16 candidate scales x 128 sampled columns per linear (~1,000 tiles for a
128-wide input, ~16x the main pass of these small linears). The test keeps the real encoder for
every stored tile but samples one tile column in that search (1/8 of the default) and calibrates on
32 rows x 512 tokens instead of 250 x 2048 (the Hessians are at most 256 x 256 here); everything
else is the converter's default.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine.convert.quantize as quantize_mod
from engine.commands.ppl import score, text_windows
from engine.convert.options import ConvertOptions
from engine.convert.pipeline import convert_model
from engine.exl3 import EXL3Linear

DATA = Path(__file__).parents[1] / "data"
MODELS = DATA / "tiny-hybrids"
TEXT = DATA / "public_domain.txt"
CTX = 256  # the models' training sequence length
BOUND = 1.03
# Far above the trained models' held-out perplexity, far below a random model's (~2,000).
TRAINED_PPL = 400.0


def _load(directory: Path):
    from engine.model import load_model

    return load_model(directory, device="cpu", dtype=torch.float32, context=CTX)


def _windows(directory: Path) -> list[list[int]]:
    from engine.tokenizer import Tokenizer

    return text_windows(Tokenizer.from_dir(directory), TEXT.read_text(encoding="utf-8"), CTX)


@pytest.mark.slow
@pytest.mark.convert_quality
@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_4bpw_conversion_keeps_perplexity_within_3_percent(name: str, tmp_path: Path, monkeypatch) -> None:
    src, dst = MODELS / name, tmp_path / "exl3"
    # One tile column per candidate scale in the scale search (module docstring).
    monkeypatch.setattr(quantize_mod, "SEARCH_COLUMNS", 16)
    options = ConvertOptions(bits=4.0, device="cpu", cal_rows=32, cal_cols=512)
    report = convert_model(src, dst, options, log=lambda m: None)
    assert 3.9 <= report.bits <= 4.0

    windows = _windows(src)
    base = score(_load(src), windows, None)["ppl"]
    assert base < TRAINED_PPL, f"{name}: the source model scores like an untrained one ({base:.1f})"
    quantized = _load(dst)
    linears = [m for m in quantized.module.modules() if isinstance(m, EXL3Linear)]
    assert len(linears) == sum(len(block["bits"]) for block in report.blocks) + 1  # and the head
    ppl = score(quantized, windows, None)["ppl"]
    ratio = ppl / base
    print(f"{name}: ppl {base:.3f} -> {ppl:.3f} at {report.bits} bpw ({ratio:.4f}x), {report.seconds:.0f} s")
    assert 1 / BOUND <= ratio <= BOUND, f"{name}: ppl {base:.3f} -> {ppl:.3f} ({ratio:.4f}x)"
