"""The recurrent mixers' one-token kernels (ext/recurrent_step.cu) against torch references written
here from the recurrences (fp64), on random inputs and states: many head counts and sizes, batch
1-8, rows that start their sequence, slots in any order, and other slots left untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import kernels
from engine.kernels import recurrent

pytestmark = pytest.mark.cuda

TOL = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.float16: {"rtol": 5e-3, "atol": 5e-3},
    torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2},
}


@pytest.fixture(autouse=True)
def _need_extension():
    if kernels.extension() is None:
        pytest.skip(f"CUDA extension unavailable: {kernels.status()['reason']}")


def _rows(batch: int, slots: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct slots in random order, and positions with some rows at 0 (a fresh sequence)."""
    chosen = torch.randperm(slots, generator=gen)[:batch].to(torch.int32)
    positions = torch.randint(0, 3, (batch,), generator=gen) * torch.randint(1, 50, (batch,), generator=gen)
    return chosen.cuda(), positions.cuda()


def _live(state: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Each row's state as the step reads it: zeros where the row starts its sequence."""
    s = state[slots.long()].double()
    return torch.where((positions == 0).view(-1, *[1] * (s.dim() - 1)), 0.0, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window_fp32", [False, True])
@pytest.mark.parametrize("channels,K,batch", [(96, 4, 1), (8192 + 64, 4, 3), (1000, 3, 8), (256, 2, 5)])
def test_conv_step(dtype, window_fp32, channels, K, batch):
    gen = torch.Generator().manual_seed(channels + K + batch)
    slots_total = 9
    x = torch.randn(batch, channels, generator=gen).to(dtype).cuda()
    weight = (torch.randn(channels, K, generator=gen) * 0.5).to(dtype).cuda()
    bias = torch.randn(channels, generator=gen).to(dtype).cuda() if K == 3 else None
    window = torch.randn(slots_total + 1, channels, K - 1, generator=gen)
    window = window.to(torch.float32 if window_fp32 else dtype).cuda()
    slots, positions = _rows(batch, slots_total, gen)
    before = window.clone()
    full = torch.cat([_live(before, positions, slots), x.double()[:, :, None]], dim=2)
    expected = (full * weight.double()).sum(-1) + (bias.double() if bias is not None else 0.0)
    for silu in (True, False):
        window.copy_(before)
        y = recurrent.conv_step(x, window, weight, bias, slots, positions, silu)
        ref = F.silu(expected) if silu else expected
        torch.testing.assert_close(y.double(), ref, **TOL[dtype])
        torch.testing.assert_close(window[slots.long()].double(), full[:, :, 1:].to(window.dtype).double())
        untouched = torch.ones(slots_total + 1, dtype=torch.bool)
        untouched[slots.long().cpu()] = False
        assert torch.equal(window[untouched.cuda()], before[untouched.cuda()])


def _delta_reference(qkv, a, b, z, a_log, dt_bias, w, state, slots, positions, hk, dk, beta_scale, eps):
    """The gated delta rule as the papers write it, in fp64, then the gated RMSNorm."""
    rows, hv, dv = qkv.shape[0], state.shape[1], state.shape[3]
    q, k, v = qkv.double().split([hk * dk, hk * dk, hv * dv], dim=1)
    q = F.normalize(q.view(rows, hk, dk), dim=-1, eps=0) * dk**-0.5
    k = F.normalize(k.view(rows, hk, dk), dim=-1, eps=0)
    q, k = (t.repeat_interleave(hv // hk, dim=1) for t in (q, k))
    v = v.view(rows, hv, dv)
    g = -a_log.double().exp() * F.softplus(a.double() + dt_bias.double())
    beta = beta_scale * torch.sigmoid(b.double())
    S = _live(state, positions, slots) * g.exp()[..., None, None]
    u = torch.einsum("rhkv,rhk->rhv", S, k)
    S = S + k[..., None] * ((v - u) * beta[..., None])[:, :, None, :]
    o = torch.einsum("rhkv,rhk->rhv", S, q)
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    return (normed * F.silu(z.double().view(rows, hv, dv))).view(rows, hv * dv), S


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "hk,hv,dk,dv,batch",
    [
        (1, 1, 128, 128, 1),
        (16, 32, 128, 128, 1),
        (16, 32, 128, 128, 8),
        (2, 6, 64, 64, 3),
        (4, 4, 256, 128, 2),
        (8, 16, 64, 128, 5),
        (16, 48, 128, 128, 4),
    ],
)
@pytest.mark.parametrize("beta_scale", [1.0, 2.0])
def test_gated_delta_step(dtype, hk, hv, dk, dv, batch, beta_scale):
    gen = torch.Generator().manual_seed(hk * 1000 + hv * 10 + dk + batch)
    slots_total, eps = 9, 1e-6
    qkv = torch.randn(batch, 2 * hk * dk + hv * dv, generator=gen).to(dtype).cuda()
    a, b = (torch.randn(batch, hv, generator=gen).to(dtype).cuda() for _ in range(2))
    z = torch.randn(batch, hv * dv, generator=gen).to(dtype).cuda()
    a_log = torch.randn(hv, generator=gen).cuda() * 0.5
    dt_bias = torch.randn(hv, generator=gen).cuda()
    w = (1 + 0.1 * torch.randn(dv, generator=gen)).to(dtype).cuda()
    state = (0.3 * torch.randn(slots_total + 1, hv, dk, dv, generator=gen)).cuda()
    slots, positions = _rows(batch, slots_total, gen)
    before = state.clone()
    expected, expected_state = _delta_reference(
        qkv, a, b, z, a_log, dt_bias, w, before, slots, positions, hk, dk, beta_scale, eps
    )
    out = recurrent.gated_delta_step(
        qkv, a, b, z, a_log, dt_bias, w, state, slots, positions,
        key_heads=hk, key_dim=dk, beta_scale=beta_scale, norm_eps=eps, l2_eps=1e-12,
    )  # fmt: skip
    assert out is not None
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])
    torch.testing.assert_close(state[slots.long()].double(), expected_state, rtol=1e-4, atol=1e-4)
    untouched = torch.ones(slots_total + 1, dtype=torch.bool)
    untouched[slots.long().cpu()] = False
    assert torch.equal(state[untouched.cuda()], before[untouched.cuda()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,P,N,groups,batch",
    [(1, 64, 128, 1, 1), (128, 64, 128, 8, 1), (24, 32, 64, 2, 6), (8, 64, 16, 8, 8)],
)
def test_ssd_step(dtype, heads, P, N, groups, batch):
    gen = torch.Generator().manual_seed(heads + P + N + groups + batch)
    slots_total, dt_limit = 9, (0.001, 0.5)
    x = torch.randn(batch, heads * P, generator=gen).to(dtype).cuda()
    B, C = (torch.randn(batch, groups * N, generator=gen).to(dtype).cuda() for _ in range(2))
    dt = torch.randn(batch, heads, generator=gen).to(dtype).cuda()
    dt_bias, a_log, D = (torch.randn(heads, generator=gen).cuda() for _ in range(3))
    state = torch.randn(slots_total + 1, heads, P, N, generator=gen).cuda()
    slots, positions = _rows(batch, slots_total, gen)
    before = state.clone()
    y = recurrent.ssd_step(
        x, B, C, dt, dt_bias, a_log, D, state, slots, positions, groups=groups, dt_limit=dt_limit
    )
    step = F.softplus(dt.double() + dt_bias.double()).clamp(*dt_limit)  # [rows, heads]
    decay = torch.exp(step * -a_log.double().exp())
    xs = x.double().view(batch, heads, P)
    Bh, Ch = (t.double().view(batch, groups, N).repeat_interleave(heads // groups, dim=1) for t in (B, C))
    S = (
        _live(before, positions, slots) * decay[..., None, None]
        + (step[..., None] * xs)[..., None] * Bh[:, :, None]
    )
    ref = torch.einsum("rhpn,rhn->rhp", S, Ch) + D.double()[:, None] * xs
    torch.testing.assert_close(y.double(), ref.view(batch, -1), **TOL[dtype])
    torch.testing.assert_close(state[slots.long()].double(), S, rtol=1e-4, atol=1e-4)
    untouched = torch.ones(slots_total + 1, dtype=torch.bool)
    untouched[slots.long().cpu()] = False
    assert torch.equal(state[untouched.cuda()], before[untouched.cuda()])


def test_the_steps_replay_in_a_cuda_graph():
    """Captured once, replayed on new inputs: each replay advances the state as eager steps do."""
    gen = torch.Generator().manual_seed(0)
    hk, hv, dk, dv, batch, K = 2, 4, 64, 64, 2, 4
    channels = 2 * hk * dk + hv * dv
    weight = torch.randn(channels, K, generator=gen).cuda() * 0.3
    a_log, dt_bias = torch.zeros(hv).cuda(), torch.zeros(hv).cuda()
    w = torch.ones(dv).cuda()
    slots = torch.tensor([3, 1], dtype=torch.int32).cuda()
    positions = torch.tensor([5, 7]).cuda()
    x, a, b = (
        torch.zeros(batch, channels).cuda(),
        torch.zeros(batch, hv).cuda(),
        torch.zeros(batch, hv).cuda(),
    )
    z = torch.zeros(batch, hv * dv).cuda()

    def step(window, state):
        qkv = recurrent.conv_step(x, window, weight, None, slots, positions, True)
        return recurrent.gated_delta_step(
            qkv, a, b, z, a_log, dt_bias, w, state, slots, positions, key_heads=hk, key_dim=dk
        )

    windows = [torch.zeros(5, channels, K - 1).cuda() for _ in range(2)]
    states = [torch.zeros(5, hv, dk, dv).cuda() for _ in range(2)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step(windows[0].clone(), states[0].clone())  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(windows[0], states[0])
    for _ in range(3):
        for t in (x, a, b, z):
            t.copy_(torch.randn(t.shape, generator=gen).cuda())
        graph.replay()
        expected = step(windows[1], states[1])
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(states[0], states[1], rtol=0, atol=0)
