"""The gated delta rule's two forms (chunked prefill, one-token decode) and the causal
convolution, against references written out token by token here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.modules.causal_conv import causal_conv, causal_conv_step
from engine.modules.gated_delta_net import gated_delta_chunked, gated_delta_step, l2_normalize


def _inputs(length: int, heads: int = 3, dk: int = 16, dv: int = 8, seed: int = 0):
    """Random q/k/v as the mixer hands them over (q/k normalised, q scaled), decays g <= 0 as
    -exp(A_log) * softplus(.) gives them, write strengths in (0, 2), and a non-zero state."""
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(length, heads, dk, generator=gen)) * dk**-0.5
    k = l2_normalize(torch.randn(length, heads, dk, generator=gen))
    v = torch.randn(length, heads, dv, generator=gen)
    g = -torch.rand(heads, generator=gen).exp() * F.softplus(torch.randn(length, heads, generator=gen))
    beta = 2 * torch.rand(length, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, state


def _token_by_token(q, k, v, g, beta, state):
    """The recurrence as written: decay, then move S's answer to k towards v, then read with q."""
    out = []
    S = state.clone()
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            S[h] = S[h] * torch.exp(g[t, h])
            S[h] = S[h] + beta[t, h] * torch.outer(k[t, h], v[t, h] - S[h].T @ k[t, h])
        out.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(out), S


@pytest.mark.parametrize("length", [1, 5, 64, 150])
def test_chunked_and_step_forms_agree_with_the_recurrence(length):
    """Inside one chunk, on a chunk boundary and across a partial last chunk, from a non-zero
    state: the chunked form, the step form run token by token, and the plain recurrence give the
    same outputs and final state within float32 rounding."""
    q, k, v, g, beta, state = _inputs(length)
    expected, expected_state = _token_by_token(q, k, v, g, beta, state)

    chunked, chunked_state = gated_delta_chunked(q, k, v, g, beta, state, chunk_size=64)
    torch.testing.assert_close(chunked, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(chunked_state, expected_state, rtol=1e-4, atol=1e-5)

    stepped, S = [], state[None]
    for t in range(length):
        o, S = gated_delta_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], S)
        stepped.append(o[0])
    torch.testing.assert_close(torch.stack(stepped), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S[0], expected_state, rtol=1e-4, atol=1e-5)


def test_chunked_form_does_not_depend_on_the_chunk_size():
    q, k, v, g, beta, state = _inputs(100, seed=3)
    reference = gated_delta_chunked(q, k, v, g, beta, state, chunk_size=64)
    for size in (16, 37, 128):
        out, final = gated_delta_chunked(q, k, v, g, beta, state, chunk_size=size)
        torch.testing.assert_close(out, reference[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(final, reference[1], rtol=1e-4, atol=1e-5)


def test_a_sequence_in_pieces_continues_from_its_state():
    """Two pieces, the second starting from the first's final state, give the whole run."""
    q, k, v, g, beta, state = _inputs(90, seed=5)
    whole, whole_state = gated_delta_chunked(q, k, v, g, beta, state)
    first, mid = gated_delta_chunked(q[:70], k[:70], v[:70], g[:70], beta[:70], state)
    second, last = gated_delta_chunked(q[70:], k[70:], v[70:], g[70:], beta[70:], mid)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(last, whole_state, rtol=1e-4, atol=1e-5)


def test_step_form_runs_sequences_independently():
    """A batch of sequences, each from its own state: row b's result is sequence b's alone."""
    rows = [_inputs(1, seed=s) for s in range(4)]
    q, k, v, g, beta = (torch.cat([r[i] for r in rows]) for i in range(5))
    states = torch.stack([r[5] for r in rows])
    out, after = gated_delta_step(q, k, v, g, beta, states)
    for b, r in enumerate(rows):
        expected, expected_state = _token_by_token(*r)
        torch.testing.assert_close(out[b], expected[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(after[b], expected_state, rtol=1e-4, atol=1e-5)


def test_causal_conv_in_pieces_equals_the_zero_padded_convolution():
    """The convolution as transformers computes it (zero padding on the left), against a prefill
    in two pieces and then one-token steps, each continuing from the window the last one left."""
    gen = torch.Generator().manual_seed(7)
    channels, kernel, length = 6, 4, 13
    x = torch.randn(length, channels, generator=gen)
    weight, bias = torch.randn(channels, kernel, generator=gen), torch.randn(channels, generator=gen)
    padded = F.pad(x.T[None], (kernel - 1, 0))
    expected = F.conv1d(padded, weight[:, None, :], bias, groups=channels)[0].T

    window = torch.zeros(channels, kernel - 1)
    a, window = causal_conv(x[:2], weight, window, bias)  # shorter than the window
    b, window = causal_conv(x[2:9], weight, window, bias)
    steps = []
    for t in range(9, length):
        y, windows = causal_conv_step(x[t : t + 1], weight, window[None], bias)
        steps.append(y)
        window = windows[0]
    torch.testing.assert_close(torch.cat([a, b, *steps]), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(window, x[length - (kernel - 1) :].T)  # the last K - 1 inputs
