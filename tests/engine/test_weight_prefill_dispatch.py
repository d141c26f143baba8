"""The prefill path through whole EXL3 weights (engine.kernels.gemv.exl3_weight / _exl3_gemm_fused),
checked on the CPU with a stand-in extension that writes the torch reference weight; the kernel
itself is tested against the same reference in tests/cuda/test_exl3_weight.py."""

from __future__ import annotations

import types

import pytest
import torch

from engine.exl3 import EXL3Linear
from engine.exl3.codebooks import FLAG_VALUES
from engine.exl3.reconstruct import apply_scales, decode_trellis
from engine.kernels import gemv, loader

CODEBOOK_NAMES = {v: k for k, v in loader.CODEBOOK_IDS.items()}


class ReferenceExtension(types.SimpleNamespace):
    """``exl3_weight_into`` with the torch reference, recording each call."""

    def __init__(self) -> None:
        super().__init__(calls=[])

    def exl3_weight_into(self, trellis, suh, svh, codebook, w, col0):
        self.calls.append((trellis.shape, codebook, col0))
        ref = apply_scales(decode_trellis(trellis, CODEBOOK_NAMES[codebook]), suh, svh, torch.float32)
        w[:, col0 : col0 + ref.shape[1]] = ref.to(w.dtype)


def _layer(in_f: int, out_f: int, k: int, seed: int, bias: bool = False) -> EXL3Linear:
    g = torch.Generator().manual_seed(seed)
    pin, pout = -(-in_f // 128) * 128, -(-out_f // 128) * 128
    sign = torch.where(torch.rand(pin + pout, generator=g) < 0.5, -1.0, 1.0)
    tensors = {
        "trellis": torch.randint(
            -(2**15), 2**15, (pin // 16, pout // 16, 16 * k), dtype=torch.int16, generator=g
        ),
        "suh": (sign[:pin] * (torch.rand(pin, generator=g) + 0.5)).half(),
        "svh": (sign[pin:] * (torch.rand(pout, generator=g) + 0.5)).half(),
        "mcg": torch.tensor(FLAG_VALUES["mcg"]),
    }
    b = torch.randn(out_f, generator=g).half() if bias else None
    return EXL3Linear.from_tensors(tensors, in_f, out_f, b, mode="streaming")


@pytest.fixture
def fake(monkeypatch) -> ReferenceExtension:
    ext = ReferenceExtension()
    monkeypatch.setattr(loader, "kernel_ready", lambda *tensors: ext)  # CPU tensors take the "kernel"
    return ext


def test_group_outputs_are_sliced_padded_and_biased(fake) -> None:
    # Padded widths (200 in -> 256, 300/100 out -> 384/128) and a bias: each output must equal the
    # layer's own reference forward, from one buffer laid out column block after column block.
    layers = [_layer(200, 300, 4, 1, bias=True), _layer(200, 100, 3, 2), _layer(200, 100, 2, 3)]
    x = torch.randn(2, 20, 200)
    outs = gemv._exl3_gemm_fused(x, layers)
    assert [c[2] for c in fake.calls] == [0, 384, 512]
    for layer, y in zip(layers, outs, strict=True):
        assert y.shape == (2, 20, layer.out_features) and y.dtype == x.dtype
        torch.testing.assert_close(y, layer(x), rtol=1e-4, atol=1e-4)


def test_group_too_large_for_one_buffer_is_left_to_each_layer(fake, monkeypatch) -> None:
    layers = [_layer(128, 128, 4, 4), _layer(128, 128, 4, 5)]
    monkeypatch.setattr(gemv, "FUSED_WEIGHT_BYTES", 128 * 256 * 4 - 1)  # one byte short (fp32)
    assert gemv._exl3_gemm_fused(torch.randn(9, 128), layers) is None
    assert fake.calls == []


def test_weight_buffer_checks_its_layers_in_python(fake) -> None:
    a, b = _layer(128, 128, 4, 6), _layer(256, 128, 4, 7)
    with pytest.raises(ValueError, match="in features"):
        gemv.exl3_weight([a, b], torch.float16)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        gemv.exl3_weight([a], torch.int8)
    assert fake.calls == []
    w = gemv.exl3_weight([a], torch.bfloat16)
    assert w.shape == (128, 128) and w.dtype == torch.bfloat16


def test_single_layer_prefill_through_the_weight(fake, monkeypatch) -> None:
    # exl3_gemm above GEMV_MAX_ROWS: padded input (200 -> 256), padded output cut, bias, dtype and
    # leading dims back as the caller gave them.
    layer = _layer(200, 300, 4, 8, bias=True)
    x = torch.randn(3, 7, 200, dtype=torch.float64)  # not a kernel dtype: computed in fp32
    y = gemv.exl3_gemm(x, layer)
    assert fake.calls == [(layer.trellis.shape, loader.CODEBOOK_IDS["mcg"], 0)]
    assert y.shape == (3, 7, 300) and y.dtype == torch.float64
    ref = x.float() @ layer.reconstruct().t() + layer.bias.float()  # torch reference, not the hook
    torch.testing.assert_close(y, ref.double(), rtol=1e-4, atol=1e-4)
