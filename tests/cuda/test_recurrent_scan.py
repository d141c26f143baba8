"""The recurrent mixers' prefill scans (ext/recurrent_scan.cu) against the torch recurrences run
token by token in float64, on random inputs and states: head sizes 32-128, 1-32 heads, sequences
of 1 to 300 tokens (across the chunked form's 64-token chunks), grouped B/C; then the mixers
themselves, whose prefill takes the scan on the GPU and the chunked form otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import kernels
from engine.kernels import recurrent
from engine.modules.gated_delta_net import gated_delta_chunked, gated_delta_step, l2_normalize
from engine.modules.mamba2 import ssd_step

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _need_extension():
    if kernels.extension() is None:
        pytest.skip(f"CUDA extension unavailable: {kernels.status()['reason']}")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _delta_inputs(T: int, heads: int, dk: int, dv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(T, heads, dk, generator=gen)) * dk**-0.5
    k = l2_normalize(torch.randn(T, heads, dk, generator=gen))
    v = torch.randn(T, heads, dv, generator=gen)
    g = -F.softplus(torch.randn(T, heads, generator=gen)) * 0.3  # log decays, <= 0
    beta = torch.rand(T, heads, generator=gen) * 2.0  # OLMo-Hybrid's range included
    state = torch.randn(heads, dk, dv, generator=gen) * 0.2
    return q, k, v, g, beta, state


def _delta_reference(q, k, v, g, beta, state):
    """Token by token in float64 (the decode form, which defines the recurrence)."""
    q, k, v, g, beta, s = (t.double() for t in (q, k, v, g, beta, state))
    outs = []
    for t in range(q.shape[0]):
        o, s = gated_delta_step(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s[None]
        )
        outs.append(o[0])
        s = s[0]
    return torch.stack(outs), s


@pytest.mark.parametrize(
    "T,heads,dk,dv",
    [
        (1, 1, 128, 128),
        (7, 4, 64, 64),
        (64, 2, 128, 128),
        (65, 3, 32, 96),
        (300, 32, 128, 128),
        (130, 16, 128, 32),
    ],
)
def test_gated_delta_scan_equals_the_recurrence(T, heads, dk, dv):
    inputs = _delta_inputs(T, heads, dk, dv, seed=T + heads + dk + dv)
    scanned = recurrent.gated_delta_scan(*(t.cuda() for t in inputs))
    assert scanned is not None
    out, after = scanned
    ref_out, ref_after = _delta_reference(*inputs)
    assert rel_err(out.cpu(), ref_out) < 2e-5
    assert rel_err(after.cpu(), ref_after) < 2e-5
    # The chunked torch form the scan replaces on the GPU agrees to the same rounding.
    chunk_out, chunk_after = gated_delta_chunked(*(t.cuda() for t in inputs))
    assert rel_err(out, chunk_out) < 1e-4 and rel_err(after, chunk_after) < 1e-4


def test_gated_delta_scan_declines_sizes_it_does_not_take():
    q, k, v, g, beta, state = (t.cuda() for t in _delta_inputs(5, 2, 96, 64, seed=0))  # 96 / 4 = 24 rows
    assert recurrent.gated_delta_scan(q, k, v, g, beta, state) is None
    q, k, v, g, beta, state = (t.cuda() for t in _delta_inputs(5, 2, 64, 48, seed=0))  # 48 columns
    assert recurrent.gated_delta_scan(q, k, v, g, beta, state) is None
    assert recurrent.gated_delta_scan(*_delta_inputs(5, 2, 64, 64, seed=0)) is None  # on the CPU


def _ssd_inputs(T: int, heads: int, P: int, N: int, groups: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, heads, P, generator=gen)
    dt = F.softplus(torch.randn(T, heads, generator=gen) - 1.0)
    A = -torch.rand(heads, generator=gen) * 2.0 - 0.1
    B = torch.randn(T, groups, N, generator=gen) * 0.5
    C = torch.randn(T, groups, N, generator=gen) * 0.5
    state = torch.randn(heads, P, N, generator=gen) * 0.2
    return x, dt, A, B, C, state


def _ssd_reference(x, dt, A, B, C, state):
    x, dt, A, B, C, s = (t.double() for t in (x, dt, A, B, C, state))
    ys = []
    for t in range(x.shape[0]):
        y, s = ssd_step(x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], s[None])
        ys.append(y[0])
        s = s[0]
    return torch.stack(ys), s


@pytest.mark.parametrize(
    "T,heads,P,N,groups",
    [(1, 1, 32, 128, 1), (9, 4, 64, 64, 2), (129, 8, 64, 128, 1), (300, 32, 64, 128, 8), (70, 2, 96, 32, 2)],
)
def test_ssd_scan_equals_the_recurrence(T, heads, P, N, groups):
    inputs = _ssd_inputs(T, heads, P, N, groups, seed=T + heads + P + N)
    scanned = recurrent.ssd_scan(*(t.cuda() for t in inputs))
    assert scanned is not None
    y, after = scanned
    ref_y, ref_after = _ssd_reference(*inputs)
    assert rel_err(y.cpu(), ref_y) < 2e-5
    assert rel_err(after.cpu(), ref_after) < 2e-5


# Small hybrids whose recurrent heads the scans take (dk = dv = 32; Mamba-2 P = 32, N = 32).
_QWEN3_5 = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 320,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}
_NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 320,
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "hybrid_override_pattern": "M-M*",
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "mamba_num_heads": 8,
    "mamba_head_dim": 32, "n_groups": 2, "ssm_state_size": 32, "conv_kernel": 4, "expand": 2,
    "layer_norm_epsilon": 1e-5, "max_position_embeddings": 1024, "tie_word_embeddings": False,
    "mlp_hidden_act": "relu2",
}  # fmt: skip


@pytest.mark.parametrize("config", [_QWEN3_5, _NEMOTRON_H], ids=["qwen3_5", "nemotron_h"])
def test_a_hybrid_prefills_through_the_scans_as_through_the_chunked_form(config, monkeypatch):
    """A prompt of 150 tokens in chunks of 70 (the second and third chunks continue from the slot's
    state) through a random-weight hybrid on the GPU: the logits with the scans equal those of the
    chunked torch form (the scans declined)."""
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens
    from engine.loading.synthetic_store import synthetic_model

    model = synthetic_model(config, bits=None, device="cuda", dtype=torch.float32)
    ids = torch.randint(3, 320, (150,), generator=torch.Generator().manual_seed(5)).tolist()

    def logits() -> torch.Tensor:
        cache = PagedKVCache.for_model(model.spec, 256, page_size=16, dtype=model.dtype, device=model.device)
        return score_tokens(model.module, cache, ids, chunk=70)

    calls = {"delta": 0, "ssd": 0}
    for name, kind in (("gated_delta_scan", "delta"), ("ssd_scan", "ssd")):
        real = getattr(recurrent, name)

        def counted(*args, _real=real, _kind=kind):
            calls[_kind] += 1
            return _real(*args)

        monkeypatch.setattr(recurrent, name, counted)
    with_scan = logits()
    assert calls["delta" if config is _QWEN3_5 else "ssd"] > 0
    monkeypatch.setattr(recurrent, "gated_delta_scan", lambda *a: None)
    monkeypatch.setattr(recurrent, "ssd_scan", lambda *a: None)
    assert rel_err(with_scan, logits()) < 1e-4
