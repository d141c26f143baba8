"""Scale tuning of a quantized block against its output (engine.convert.finetune)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from quant_helpers import cheap_encoder

import engine.convert.quantize as quantize_mod
from engine.convert.finetune import ScaledCore, TuneOptions, make_trainable, tune_block_scales
from engine.exl3 import EXL3Linear


def _quantized(gen: torch.Generator, n_in: int, n_out: int, monkeypatch) -> dict[str, torch.Tensor]:
    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    w = torch.randn(n_out, n_in, generator=gen) * 0.05
    x = torch.randn(256, n_in, generator=gen)
    qt = quantize_mod.quantize_weight(w, x.T @ x / 256, 4, "mul1", seed=1)
    return {k.split(".", 1)[1]: v for k, v in qt.tensors("layer").items()}


def _core(t: dict[str, torch.Tensor], n_in: int, n_out: int) -> ScaledCore:
    return ScaledCore(EXL3Linear.from_tensors(t, n_in, n_out, None, mode="streaming"))


def test_scaled_core_is_the_stored_linear(monkeypatch) -> None:
    # With its multipliers at zero the tunable layer computes what the stored EXL3 linear does,
    # padding included (200 -> 256 in, 136 -> 256 out), and hands back the stored scales.
    gen = torch.Generator().manual_seed(0)
    t = _quantized(gen, 200, 136, monkeypatch)
    layer = _core(t, 200, 136)
    x = torch.randn(5, 200, generator=gen)
    stored = EXL3Linear.from_tensors(t, 200, 136, None)
    torch.testing.assert_close(layer(x), stored(x), rtol=1e-5, atol=1e-5)
    suh, svh = layer.scales(t["suh"], t["svh"])
    assert torch.equal(suh, t["suh"]) and torch.equal(svh, t["svh"])
    # Moved multipliers land in the stored scales, as fp16, padding left as it was.
    with torch.no_grad():
        layer.a.fill_(0.5)
        layer.c[:10] = -0.25
    suh, svh = layer.scales(t["suh"], t["svh"])
    assert suh.dtype == torch.float16 and suh.shape == t["suh"].shape
    torch.testing.assert_close(suh[:200].float(), t["suh"][:200].float() * 1.5, rtol=1e-3, atol=0)
    torch.testing.assert_close(svh[:10].float(), t["svh"][:10].float() * 0.75, rtol=1e-3, atol=0)
    assert torch.equal(svh[10:], t["svh"][10:]) and torch.equal(suh[200:], t["suh"][200:])


def _two_layer_block(first: ScaledCore, second: ScaledCore):
    return lambda h: h + second(F.silu(first(h)))


def test_tuning_recovers_scales_that_were_moved(monkeypatch) -> None:
    # The target is the same two-layer block with some scales changed by up to +-20%: tuning the
    # multipliers must find most of the way back, judged on rows it did not train on.
    gen = torch.Generator().manual_seed(1)
    t1, t2 = _quantized(gen, 128, 256, monkeypatch), _quantized(gen, 256, 128, monkeypatch)
    truth = [_core(t1, 128, 256), _core(t2, 256, 128)]
    with torch.no_grad():
        for layer in truth:
            layer.a.uniform_(-0.2, 0.2, generator=gen)
            layer.c.uniform_(-0.2, 0.2, generator=gen)
    hidden = torch.randn(16, 32, 128, generator=gen)
    with torch.no_grad():
        target = _two_layer_block(*truth)(hidden)
    layers = [_core(t1, 128, 256), _core(t2, 256, 128)]
    result = tune_block_scales(
        _two_layer_block(*layers), layers, hidden, target, TuneOptions(steps=300, lr=1e-2, rows=4)
    )
    assert result.kept and result.after < 0.1 * result.before
    moved = torch.cat([layers[0].a, layers[1].c]).detach()
    wanted = torch.cat([truth[0].a, truth[1].c]).detach()
    assert F.cosine_similarity(moved, wanted, dim=0) > 0.9


def test_tuning_that_does_not_help_is_not_kept(monkeypatch) -> None:
    # A learning rate far too large wrecks the scales; the held-out rows catch it and the
    # multipliers go back to zero (the stored scales unchanged).
    gen = torch.Generator().manual_seed(2)
    t1, t2 = _quantized(gen, 128, 256, monkeypatch), _quantized(gen, 256, 128, monkeypatch)
    reference = [_core(t1, 128, 256), _core(t2, 256, 128)]
    hidden = torch.randn(8, 16, 128, generator=gen)
    with torch.no_grad():
        target = _two_layer_block(*reference)(hidden) + 0.01 * torch.randn(8, 16, 128, generator=gen)
    layers = [_core(t1, 128, 256), _core(t2, 256, 128)]
    result = tune_block_scales(
        _two_layer_block(*layers), layers, hidden, target, TuneOptions(steps=20, lr=50.0)
    )
    assert not result.kept and result.after > result.before
    assert all((layer.a == 0).all() and (layer.c == 0).all() for layer in layers)
    assert torch.equal(layers[0].scales(t1["suh"], t1["svh"])[0], t1["suh"])


def test_make_trainable_replaces_inference_tensors() -> None:
    with torch.inference_mode():
        norm = torch.nn.LayerNorm(8)
        norm.register_buffer("table", torch.ones(3))
    assert norm.weight.is_inference() and norm.table.is_inference()
    make_trainable(norm)
    assert not norm.weight.is_inference() and not norm.table.is_inference()
    assert not norm.weight.requires_grad
    x = torch.randn(2, 8, requires_grad=True)
    norm(x).sum().backward()  # would raise with the inference weight saved for backward
    assert x.grad is not None


@pytest.mark.slow
def test_conversion_with_scale_tuning(exl3_dir: Path, tmp_path: Path, monkeypatch) -> None:
    # Tuning lowers each block's output error against the unquantized block (the report's rfn),
    # says what it did in the log, and the result loads back.
    from engine.convert.options import ConvertOptions
    from engine.convert.pipeline import convert_model
    from engine.model import load_model

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    src = exl3_dir / "tiny-llama-hf"
    rfn = {}
    for steps in (0, 60):
        options = ConvertOptions(
            bits=4.0, head_bits=16, cal_rows=16, cal_cols=128, device="cpu", tune_steps=steps
        )
        logs: list[str] = []
        report = convert_model(src, tmp_path / f"out{steps}", options, log=logs.append)
        rfn[steps] = [b["rfn"] for b in report.blocks]
        assert sum("scale tuning" in line for line in logs) == (2 if steps else 0)
    assert all(tuned < plain for tuned, plain in zip(rfn[60], rfn[0])), rfn
    model = load_model(tmp_path / "out60", device="cpu", dtype=torch.float32)
    assert sum(isinstance(m, EXL3Linear) for m in model.module.modules()) == 14
