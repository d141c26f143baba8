"""Token selection on the GPU: the argmax of greedy rows (``ext/argmax.cu``) and the sampler
(``ext/sampling.cu``: penalties, temperature, top-k, min-p, top-p and the draw in one launch).

Each returns the chosen ids, or None where no kernel applies (CPU tensors, no extension, a layout
the kernel does not take): the caller then runs torch's ``argmax`` or the sampler's torch
reference (``engine.generation.sampling.sample_reference``), which take the same decision.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.kernels import loader
from engine.kernels.loader import KERNEL_DTYPES

# Columns of a batch's settings table (``SamplingRows.settings``): the kernel's layout, which
# ``engine.generation.sampling.SETTING_FIELDS`` names in order (ext/sampling.cu kSettings).
SETTING_COLUMNS = 7


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """``logits.argmax(dim=-1)`` of float32 ``[rows, vocab]`` logits: torch's answer (the first
    maximum, a NaN above every number), through one block per row, or for wide rows on sm_90 a
    cluster of blocks per row (torch's reduction took 28 us for a 128K vocabulary, one block
    16.6; the cluster +1.1% on the 1B model, docs/KERNELS.md section 7)."""
    ext = loader.kernel_ready(logits)
    if (
        ext is None
        or not hasattr(ext, "argmax_rows")
        or logits.dtype != torch.float32
        or logits.ndim != 2
        or logits.stride(-1) != 1
    ):
        return None
    return ext.argmax_rows(logits)


def sample_tokens(
    logits: torch.Tensor,
    rows: Any,
    u: torch.Tensor,
    out: torch.Tensor | None = None,
    pending: torch.Tensor | None = None,
    cluster: bool = True,
) -> torch.Tensor | None:
    """One token id per row of ``logits`` ``[rows, vocab]`` (fp32/bf16/fp16) after penalties,
    temperature, top-k, min-p and top-p, drawn with the uniform ``u`` ``[rows]`` (float32, one per
    row): ``engine.generation.sampling.sample_reference``'s decision. ``rows``: the batch's
    ``SamplingRows`` (settings, penalty lists) on the logits' device.

    One launch, no host sync, no allocation outside torch's allocator (CUDA-graph capturable);
    ``out`` (int64 or int32 ``[rows]``) receives the ids. Returns ``out`` (a new int64 tensor if
    None), or None where the kernel does not apply: the caller runs the reference.

    ``pending`` (int64 ``[rows]``, on the logits' device): each row's last generated token that
    ``rows``' lists do not hold yet (< 0: none), e.g. a pipelined step's input still on the
    device. The penalties then treat it as appended to the job's tokens: the same ids as packing
    the lists with it.

    ``cluster=False`` runs the one-block-per-row kernel where the cluster kernel would (sm_90; the
    cluster took a 128K top-p draw from ~0.9 to ~0.07 ms): both take the same decision bit for
    bit, which the tests check; the one-block kernel serves older GPUs and larger vocabularies.
    """
    if logits.ndim != 2 or logits.shape[0] < 1 or logits.shape[1] < 1:
        raise ValueError(f"sample_tokens takes [rows, vocab] logits, got {tuple(logits.shape)}")
    n, vocab = logits.shape
    if logits.dtype not in KERNEL_DTYPES:
        raise ValueError(f"sample_tokens takes fp32, bf16 or fp16 logits, not {logits.dtype}")
    if vocab >= 2**31:
        raise ValueError(f"sample_tokens: vocabulary of {vocab} tokens does not fit int32 ids")
    if rows.settings.shape != (n, SETTING_COLUMNS) or rows.settings.dtype != torch.float32:
        raise ValueError(
            f"sample_tokens: settings must be float32 [{n}, {SETTING_COLUMNS}], "
            f"got {rows.settings.dtype} {tuple(rows.settings.shape)}"
        )
    if u.shape != (n,) or u.dtype != torch.float32:
        raise ValueError(f"sample_tokens: u must be float32 [{n}], got {u.dtype} {tuple(u.shape)}")
    lists = {"rep_ids": rows.rep_ids, "gen_ids": rows.gen_ids, "gen_counts": rows.gen_counts}
    for name, t in (*lists.items(), ("rep_len", rows.rep_len), ("gen_len", rows.gen_len)):
        if t.dtype != torch.int32 or t.shape[0] != n:
            raise ValueError(
                f"sample_tokens: {name} must be int32 with {n} rows, got {t.dtype} {tuple(t.shape)}"
            )
    for name, t in lists.items():
        if t.ndim != 2:
            raise ValueError(f"sample_tokens: {name} must be [rows, capacity], got {tuple(t.shape)}")
    if rows.gen_counts.shape != rows.gen_ids.shape:
        raise ValueError("sample_tokens: gen_counts must have gen_ids' shape")
    for name, t in (("rep_len", rows.rep_len), ("gen_len", rows.gen_len)):
        if t.ndim != 1:
            raise ValueError(f"sample_tokens: {name} must be [rows], got {tuple(t.shape)}")
    if out is not None and (out.shape != (n,) or out.dtype not in (torch.int64, torch.int32)):
        raise ValueError(
            f"sample_tokens: out must be int64 or int32 [{n}], got {out.dtype} {tuple(out.shape)}"
        )
    if pending is not None and (pending.shape != (n,) or pending.dtype != torch.int64):
        raise ValueError(
            f"sample_tokens: pending must be int64 [{n}], got {pending.dtype} {tuple(pending.shape)}"
        )
    tensors = (logits, u, rows.settings, *lists.values(), rows.rep_len, rows.gen_len)
    if out is not None:
        tensors += (out,)
    if pending is not None:
        tensors += (pending,)
    if any(t.device != logits.device for t in tensors):
        raise ValueError("sample_tokens: every tensor must be on the logits' device")

    ext = loader.kernel_ready(logits)
    if ext is None or not hasattr(ext, "sample_tokens") or logits.stride(1) != 1:
        return None
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=logits.device)
    work = torch.empty(n, vocab, dtype=torch.float32, device=logits.device)
    ext.sample_tokens(
        logits,
        rows.settings.contiguous(),
        u.contiguous(),
        rows.rep_ids.contiguous(),
        rows.rep_len.contiguous(),
        rows.gen_ids.contiguous(),
        rows.gen_counts.contiguous(),
        rows.gen_len.contiguous(),
        work,
        out,
        None if pending is None else pending.contiguous(),
        cluster=cluster,
    )
    return out
