"""A decoder block run over calibration rows, each row its own causal sequence.

Every forward the converter makes goes through here: the unquantized block with the Hessian hooks
on, the quantized block producing the next block's input, the sensitivity pre-pass, scale tuning.
The states may live on the host while the block runs on a CUDA device
(:mod:`engine.convert.host_states`); each chunk of rows goes there to run, and the numbers are the
same wherever the states live.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

# Rows per forward chunk bound the attention score matrix and the activations to ~256 MB
# (2**26 float32 values).
CHUNK_VALUES = 2**26


def rows_per_chunk(cols: int, width: int) -> int:
    """Calibration rows of ``cols`` tokens per forward chunk of a block whose widest activation is
    ``width`` (the MLP's intermediate size) wide."""
    return max(1, int(CHUNK_VALUES // (cols * max(width, cols))))


def block_device(block: nn.Module) -> torch.device:
    """The device a block's weights are on (where it runs)."""
    return next(t for t in (*block.parameters(), *block.buffers())).device


def run_rows(block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """One DecoderBlock over ``hidden`` ``(n, cols, dim)``, each row its own causal sequence, in one
    forward (autograd sees through it where its inputs or weights need gradients). It runs where
    the block is; the output goes where ``hidden`` is (the host, when the states are kept there)."""
    return forward_rows(block, hidden).to(hidden.device)


def forward_rows(block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """:func:`run_rows` with the output left on the block's device: what runs there next (the
    tuning loss, a norm, a copy into a page-locked host buffer) then reads it without a round trip
    through host memory, and computes the same numbers whether the states live on the host or
    on the device."""
    from engine.cache.paged import PagedKVCache
    from engine.modules.batch import BatchLayout, SequenceSlice

    n, cols, dim = hidden.shape
    device = block_device(block)
    hidden = hidden.to(device, non_blocking=True)  # page-locked host states copy asynchronously
    # The state the block's mixer declares, for n sequences: one page per row (row i owns slots
    # i*cols .. (i+1)*cols - 1), and row i's recurrent state in slot i.
    cache = PagedKVCache.for_layers([block.state], n, cols, hidden.dtype, device, max_sequences=n).layer(0)
    seqs = [
        SequenceSlice(i * cols, cols, 0, torch.arange(i * cols, (i + 1) * cols, device=device), state_slot=i)
        for i in range(n)
    ]
    positions = torch.arange(cols, device=device).repeat(n)
    batch = BatchLayout(seqs, positions, torch.arange(n * cols, device=device))
    return block(hidden.reshape(n * cols, dim), batch, cache).view(n, cols, dim)


def run_block(
    block: nn.Module,
    hidden: torch.Tensor,
    chunk_rows: int,
    in_place: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run one DecoderBlock over ``hidden`` ``(rows, cols, dim)`` in chunks of ``chunk_rows``;
    ``in_place`` writes each chunk's output over its input (every row is its own sequence, so a
    chunk is read whole before it is written), which saves a copy of the states; ``out`` (a buffer
    like ``hidden``) receives the output instead of a new one, so host states are not allocated
    (and page-faulted in) again for every block.

    Host states on a CUDA device: each chunk's output is copied straight from the device into its
    rows of ``out`` without waiting (from page-locked memory that runs while the next chunk is
    queued); one synchronisation at the end makes ``out`` readable."""
    if out is None:
        out = hidden if in_place else torch.empty_like(hidden)
    device = block_device(block)
    asynchronous = out.device.type == "cpu" and device.type == "cuda"
    for r0 in range(0, hidden.shape[0], chunk_rows):
        rows = forward_rows(block, hidden[r0 : r0 + chunk_rows])
        out[r0 : r0 + chunk_rows].copy_(rows, non_blocking=asynchronous)
    if asynchronous:
        torch.cuda.synchronize(device)
    return out


def relative_frobenius(
    output: torch.Tensor, reference: torch.Tensor, chunk_rows: int, device: torch.device
) -> float:
    """``||output - reference|| / ||reference||`` over states ``(rows, cols, dim)``, a chunk of
    ``chunk_rows`` rows at a time on ``device`` with float64 sums: no state-sized temporary (8.4 GB
    for an 8B model's calibration), and the same number whether the states live on the host or on
    the device (a float32 norm over 2e9 host values is off in the third digit)."""
    num = torch.zeros((), dtype=torch.float64, device=device)
    den = torch.zeros((), dtype=torch.float64, device=device)
    for r0 in range(0, reference.shape[0], chunk_rows):
        ref = reference[r0 : r0 + chunk_rows].to(device).double()
        num += (output[r0 : r0 + chunk_rows].to(device).double() - ref).pow(2).sum()
        den += ref.pow(2).sum()
    return float(num.sqrt() / den.sqrt()) if float(den) > 0 else 0.0


@contextlib.contextmanager
def calibration_matmuls(device: torch.device, tf32: bool) -> Iterator[None]:
    """Inside, float32 matrix products on ``device`` (the calibration forwards and the Hessians)
    may use TF32 tensor cores when ``tf32`` is set: ~8x the fp32 rate on an H200, products of
    10-bit mantissas accumulated in fp32. On by default (``convert --no-tf32`` for fp32): a
    Llama-3.2-1B shape converts in ~3.0 instead of ~4.6 min on an H200, as fast as ExLlamaV3 1.6.5
    there (3.04 min), and SmolLM2-135M at 4.0 bpw scored the same over 3 seeds (mean KL 0.0946
    against 0.0947 in fp32; docs/PERFORMANCE.md). No effect on CPU."""
    if device.type != "cuda" or not tf32:
        yield
        return
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


__all__ = [
    "block_device",
    "calibration_matmuls",
    "forward_rows",
    "relative_frobenius",
    "rows_per_chunk",
    "run_block",
    "run_rows",
]
