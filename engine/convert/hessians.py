"""The input Hessians ``E[x^T x]`` of a block's linears, recorded while the block runs.

A forward pre-hook on each distinct linear input (:func:`input_groups`: q/k/v share one, gate/up
another) sums ``x^T x`` over the calibration rows; :meth:`HessianHook.hessian` is the mean. With
``sequential`` the converter captures a group again once the groups before it are quantized
(:func:`capture_hessians`), running each chunk of rows only as far as that group's input.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.convert.block_runner import block_device, forward_rows
from engine.convert.slots import LinearSlot


class HessianHook:
    """Accumulates ``sum x^T x`` and the row count of a linear's inputs (a forward pre-hook).

    ``min_rows`` (set for mixture-of-experts experts, which see only the calibration tokens the
    router sends them) is how many rows a Hessian needs to be trusted alone: with fewer, the
    rows missing are filled with the identity at the seen rows' scale (their mean diagonal),
    ``H = (sum x^T x + (min_rows - n) * s * I) / min_rows``. The estimate is thereby shrunk
    towards plain rounding in proportion to what is missing, so a rarely chosen expert is not
    fitted to a rank-deficient few tokens, and one that no calibration token reached is quantized
    with ``H = I`` (no error feedback: each weight rounded on its own, in the Hadamard basis)
    rather than with a zero Hessian. ``min_rows`` is the input width: fewer rows cannot give a
    full-rank estimate.
    """

    def __init__(self, in_features: int, device: torch.device, min_rows: int = 0) -> None:
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.count = 0
        self.min_rows = min_rows

    def __call__(self, module: nn.Module, args: tuple) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        self.sum.addmm_(x.T, x)
        self.count += x.shape[0]

    def hessian(self) -> torch.Tensor:
        h = self.sum / max(self.count, 1)
        if self.count >= self.min_rows:
            return h
        scale = float(h.diagonal().mean()) if self.count else 0.0
        filled = self.count / self.min_rows
        h *= filled
        h.diagonal().add_((1.0 - filled) * (scale if scale > 0 else 1.0))
        return h


def input_groups(slots: list[LinearSlot]) -> list[list[LinearSlot]]:
    """``slots`` grouped by the input they read, in forward order: the projections of one
    ``ModuleList`` (q/k/v, gate/up) read the same input; any other linear reads its own."""
    groups: list[list[LinearSlot]] = []
    seen: dict[int, list[LinearSlot]] = {}
    for s in slots:
        shared = id(s.parent) if s.attr.isdigit() else id(s)
        if shared not in seen:
            seen[shared] = []
            groups.append(seen[shared])
        seen[shared].append(s)
    return groups


def hessian_hooks(
    slots: list[LinearSlot], device: torch.device, stop: bool = False
) -> tuple[dict[str, HessianHook], list]:
    """One :class:`HessianHook` per distinct linear input of a block (:func:`input_groups`: one
    ``x^T x`` for q/k/v instead of three), keyed by each slot's key, and the hook handles (remove
    them after the forward). With ``stop``, the last group's hook ends the forward once it has
    its input (:class:`_Captured`): nothing after it is needed."""
    hooks: dict[str, HessianHook] = {}
    handles = []
    groups = input_groups(slots)
    for j, group in enumerate(groups):
        last = stop and j == len(groups) - 1
        min_rows = group[0].in_features if group[0].routed else 0
        hook = (_StoppingHessianHook if last else HessianHook)(group[0].in_features, device, min_rows)
        handles.append(group[0].get().register_forward_pre_hook(hook))
        for s in group:
            hooks[s.key] = hook
    return hooks, handles


class _Captured(Exception):
    """Raised by a :class:`_StoppingHessianHook` to cut a capture forward short."""


class _StoppingHessianHook(HessianHook):
    def __call__(self, module: nn.Module, args: tuple) -> None:
        super().__call__(module, args)
        raise _Captured


def capture_hessians(
    block: nn.Module, hidden: torch.Tensor, slots: list[LinearSlot], chunk_rows: int
) -> dict[str, HessianHook]:
    """The input Hessians of ``slots`` with the block as it is now (some linears quantized),
    running each chunk of rows only as far as the last of their inputs."""
    hooks, handles = hessian_hooks(slots, block_device(block), stop=True)
    try:
        with torch.inference_mode():
            for r0 in range(0, hidden.shape[0], chunk_rows):
                try:
                    forward_rows(block, hidden[r0 : r0 + chunk_rows])
                except _Captured:
                    pass
    finally:
        for h in handles:
            h.remove()
    return hooks


__all__ = ["HessianHook", "capture_hessians", "hessian_hooks", "input_groups"]
