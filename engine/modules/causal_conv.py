"""The depthwise causal convolution of recurrent mixers, with the rolling window it keeps between
steps.

Gated delta nets (Qwen3-Next, Qwen3.5, OLMo-Hybrid), Mamba-2 and LFM2's short convolution mix each
channel ``c`` with its own last ``K`` inputs, ``K`` the kernel size:

    y[t, c] = bias[c] + sum_{j < K} weight[c, j] * x[t - (K - 1) + j, c]

so ``weight[c, K - 1]`` multiplies the current input and ``weight[c, 0]`` the oldest. Inputs before
a sequence's first token are zeros. Between steps a sequence keeps its last ``K - 1`` inputs, its
*window*, laid out ``[channels, K - 1]`` oldest first: a new sequence's window is all zeros, and
running a sequence in pieces, each piece starting from the window the previous one left, gives
the outputs of running it whole.

The weight is ``[channels, K]`` (a checkpoint's ``nn.Conv1d`` weight ``[channels, 1, K]`` without
its middle axis). The convolution runs in the inputs' dtype; windows may be stored in another
(float32 holds bf16/fp16 inputs exactly) and are cast on the way in and out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import recurrent
from engine.modules.batch import BatchLayout, decode_states_before

ACTIVATIONS = (None, "silu")


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's next ``T`` inputs ``x`` ``[T, channels]`` after ``window``
    ``[channels, K - 1]``: returns the outputs ``[T, channels]`` and the window after them."""
    channels, kernel = weight.shape
    inputs = torch.cat([window.to(x.dtype), x.transpose(0, 1)], dim=1)  # [channels, K - 1 + T]
    y = F.conv1d(inputs[None], weight[:, None, :], bias, groups=channels)[0]
    return y.transpose(0, 1), inputs[:, inputs.shape[1] - (kernel - 1) :]


def causal_conv_step(
    x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One next input each for ``B`` sequences: ``x`` ``[B, channels]`` after their ``windows``
    ``[B, channels, K - 1]``. Returns the outputs ``[B, channels]`` and the windows after them."""
    channels = weight.shape[0]
    inputs = torch.cat([windows.to(x.dtype), x[:, :, None]], dim=2)  # [B, channels, K]
    y = F.conv1d(inputs, weight[:, None, :], bias, groups=channels)[:, :, 0]
    return y, inputs[:, :, 1:]


class CausalConv1d(nn.Module):
    """A depthwise causal convolution of ``weight`` ``[channels, K]`` (and optional ``bias``),
    followed by ``activation`` (None or "silu"), over a step's flat batch of sequences."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported convolution activation '{activation}'")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.activation = activation

    @property
    def channels(self) -> int:
        return self.weight.shape[0]

    @property
    def kernel_size(self) -> int:
        return self.weight.shape[1]

    def forward(self, x: torch.Tensor, batch: BatchLayout, windows: torch.Tensor) -> torch.Tensor:
        """The outputs for the rows ``x`` ``[tokens, channels]`` of ``batch``. ``windows``
        ``[slots + 1, channels, K - 1]`` holds each sequence's window in its state slot: read
        (zeros at position 0) and written back after the sequence's last row."""
        if batch.decode is not None:  # one token per row, slots on the device: no host work
            stepped = self.decode_kernel(x, batch, windows)
            if stepped is not None:
                return stepped
            slots, before = decode_states_before(windows, batch)
            y, windows[slots] = causal_conv_step(x, self.weight, before, self.bias)
            return self._activate(y)
        y = torch.empty_like(x)
        for seq in batch.sequences:
            rows = seq.rows
            before = seq.state_before(windows)
            y[rows], windows[seq.state_slot] = causal_conv(x[rows], self.weight, before, self.bias)
        return self._activate(y)

    def decode_kernel(
        self, x: torch.Tensor, batch: BatchLayout, windows: torch.Tensor
    ) -> torch.Tensor | None:
        """A fixed-shape decode step in one launch (``engine.kernels.recurrent.conv_step``), the
        windows advanced in place; None where the kernel does not apply (nothing was changed)."""
        if batch.positions.dtype != torch.int64:
            return None
        return recurrent.conv_step(
            x.contiguous(),
            windows,
            self.weight,
            self.bias,
            batch.decode.state_slots,
            batch.positions,
            self.activation == "silu",
        )

    def _activate(self, y: torch.Tensor) -> torch.Tensor:
        return F.silu(y) if self.activation == "silu" else y
