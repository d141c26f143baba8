"""The fused decode-step kernels (ext/fused_ops.cu) against the torch modules they replace."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import capture

from engine import ops
from engine.modules.mlp import ACTIVATIONS
from engine.modules.norms import RMSNorm
from engine.modules.rope import RopeSpec, RotaryEmbedding

pytestmark = pytest.mark.cuda

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _tol(dtype: torch.dtype) -> dict:
    # One rounding of the output dtype (rsqrt/exp may differ from torch's by an ulp in fp32).
    return {
        torch.float16: {"rtol": 1e-3, "atol": 1e-3},
        torch.bfloat16: {"rtol": 8e-3, "atol": 8e-3},
        torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    }[dtype]


def _torch_path(module, *args):
    """The module's own torch code on the GPU (the fused op switched off)."""
    saved = ops._kernel_ready
    ops._kernel_ready = lambda *t: None
    try:
        return module(*args)
    finally:
        ops._kernel_ready = saved


@pytest.fixture(autouse=True)
def _need_extension():
    if ops.extension() is None:
        pytest.skip(f"CUDA extension unavailable: {ops.status()['reason']}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 576, 2048, 4096, 5120, 2304])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("rows", [1, 3, 257])
def test_rms_norm_matches_module(dtype, width, offset, rows) -> None:
    torch.manual_seed(width + rows)
    weight = (torch.randn(width, device="cuda") * 0.2 + (0.0 if offset else 1.0)).to(dtype)
    norm = RMSNorm(weight, 1e-6, offset)
    x = (torch.randn(rows, width, device="cuda") * 3).to(dtype)
    fused = ops.rms_norm(x, norm.weight, norm.eps, norm.offset)
    assert fused is not None and fused.dtype == dtype and fused.shape == x.shape
    torch.testing.assert_close(fused, _torch_path(norm, x), **_tol(dtype))
    # The module takes the fused path on its own.
    torch.testing.assert_close(norm(x), fused, rtol=0, atol=0)


def test_rms_norm_strided_rows() -> None:
    x = torch.randn(5, 3 * 256, device="cuda", dtype=torch.float16)[:, 256:512]
    norm = RMSNorm(torch.ones(256, device="cuda", dtype=torch.float16), 1e-5)
    torch.testing.assert_close(norm(x), _torch_path(norm, x.contiguous()), **_tol(torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "partial"), [(64, 1.0), (128, 1.0), (256, 1.0), (96, 0.5)])
@pytest.mark.parametrize("tokens", [1, 7, 130])
def test_rope_matches_module(dtype, head_dim, partial, tokens) -> None:
    torch.manual_seed(head_dim + tokens)
    rope = RotaryEmbedding(RopeSpec(theta=10000.0, partial_rotary_factor=partial), head_dim, 4096).cuda()
    positions = torch.randint(0, 4000, (tokens,), device="cuda")
    tables = rope.tables(positions, dtype)
    # q and k as the column slices of one fused projection output, as in attention.
    qkv = torch.randn(tokens, (8 + 2 + 2) * head_dim, device="cuda").to(dtype)
    q = qkv[:, : 8 * head_dim].view(tokens, 8, head_dim)
    k = qkv[:, 8 * head_dim : 10 * head_dim].view(tokens, 2, head_dim)
    fq, fk = rope.apply_pair(q, k, tables)
    tq, tk = _torch_path(lambda a, b: (rope.apply(a, tables), rope.apply(b, tables)), q, k)
    torch.testing.assert_close(fq, tq, **_tol(dtype))
    torch.testing.assert_close(fk, tk, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh", "gelu", "relu"])
@pytest.mark.parametrize(("rows", "width"), [(1, 14336), (5, 1536), (64, 8192)])
def test_act_mul_matches_torch(dtype, activation, rows, width) -> None:
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * width, device="cuda") * 2).to(dtype)
    gate, up = gate_up[:, :width], gate_up[:, width:]
    fused = ops.act_mul(gate, up, activation)
    assert fused is not None
    expected = ACTIVATIONS[activation](gate) * up
    torch.testing.assert_close(fused, expected, **_tol(dtype))


def test_fused_ops_in_a_cuda_graph() -> None:
    x = torch.randn(4, 1024, device="cuda", dtype=torch.float16)
    norm = RMSNorm(torch.rand(1024, device="cuda", dtype=torch.float16) + 0.5, 1e-5)
    eager = norm(x)
    static_x = x.clone()
    graph, out = capture(lambda: norm(static_x))
    static_x.copy_(x * 2)
    graph.replay()
    torch.testing.assert_close(out, norm(x * 2), rtol=0, atol=0)
    assert not torch.equal(out, eager)
