"""Whole-model logits of the three reference-converted models (fixtures README section 3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quant_helpers import VARIANTS

from engine.cache.paged import PagedKVCache
from engine.exl3 import EXL3Linear
from engine.generation.step import score_tokens
from engine.model import load_model

# README section 3, "whole model, quantized" (logit RMS is ~3.0).
MAX_ABS = 0.03
RMS = 0.003
KL = 1e-5


def _logits(model_dir: Path, ids: list[int], exl3_mode: str | None = None) -> torch.Tensor:
    model = load_model(model_dir, device="cpu", dtype=torch.float32, exl3_mode=exl3_mode)
    cache = PagedKVCache.for_model(model.spec, len(ids), page_size=16)
    return score_tokens(model.module, cache, ids, chunk=13), model


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of KL(p || q)."""
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def _check(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape == (32, 2048)
    diff = (got - expected).double()
    assert diff.abs().max().item() <= MAX_ABS
    assert diff.pow(2).mean().sqrt().item() <= RMS
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert _kl(expected, got) <= KL


@pytest.mark.parametrize("variant", VARIANTS)
def test_quantized_model_logits(exl3_dir: Path, ref, variant: str) -> None:
    logits = ref("logits")
    ids = logits["input_ids"][0].tolist()
    got, model = _logits(exl3_dir / f"tiny-llama-exl3-{variant}", ids)
    exl3_linears = [m for m in model.module.modules() if isinstance(m, EXL3Linear)]
    assert len(exl3_linears) == 15  # every projection and the head went through engine.exl3
    _check(got, logits[f"exl3.{variant}"][0])
    # The spec decoder (float64 W into fp32 transformers) is what an exact decoder lands on.
    assert (got - logits[f"spec_fp32.{variant}"][0]).abs().max().item() < 1e-3


def test_quantized_model_logits_streaming(exl3_dir: Path, ref) -> None:
    # The same model with every EXL3 linear in streaming mode (decode per call).
    logits = ref("logits")
    variant = "2.5bpw-h4-mcg"
    got, model = _logits(
        exl3_dir / f"tiny-llama-exl3-{variant}", logits["input_ids"][0].tolist(), "streaming"
    )
    assert all(m.mode == "streaming" for m in model.module.modules() if isinstance(m, EXL3Linear))
    _check(got, logits[f"exl3.{variant}"][0])


def test_unquantized_source_logits(exl3_dir: Path, ref) -> None:
    logits = ref("logits")
    got, _ = _logits(exl3_dir / "tiny-llama-hf", logits["input_ids"][0].tolist())
    assert (got - logits["hf_fp32"][0]).abs().max().item() <= 0.02
    assert (got - logits["exl3.original_fp16"][0]).abs().max().item() <= 0.02
