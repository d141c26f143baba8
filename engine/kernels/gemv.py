"""EXL3 linears on the GPU: the GEMV kernels (1-16 rows) and the whole-weight kernel (prefill).

Two GEMV kernels compute ``y = had(had(x * suh) @ Q) * svh`` with ``Q`` decoded from the trellis
on the fly, for one to three matrices of one input per launch:

- the **cluster split-K GEMV** (``ext/exl3_gemv_cluster.cuh``, sm_90+): the splits of a column
  group are one thread-block cluster and sum through distributed shared memory; no workspace, no
  atomics, deterministic. MUL1 weights at 1..:data:`GEMV_INT8_ROWS` rows multiply on the integer
  tensor cores (the int8 variant). Its split count is tuned per launch shape
  (:mod:`engine.kernels.tuning`). It runs wherever the GPU has clusters;
- the **workspace split-K GEMV** (``ext/exl3_gemv.cuh``), the portable one for GPUs before sm_90:
  splits sum through a global workspace and an atomic ticket.

Both skip the fp16 rounding of each decoded weight (results within one fp16 rounding per weight of
the exact product, docs/KERNELS.md section 3.1). Above :data:`GEMV_MAX_ROWS` rows (prefill) the
whole weight ``W`` is decoded once with both Hadamards and the scales folded in
(``ext/exl3_weight.cu``) and one GEMM runs in the activations' dtype; projections that share an
input get one ``W`` buffer and one GEMM while it stays under :data:`FUSED_WEIGHT_BYTES`.

Every function returns its result, or None where no kernel applies (CPU tensors, no extension,
a case the kernels do not cover): the caller then runs its torch path. Arguments a kernel would
refuse raise ``ValueError`` here, before the extension sees them (docs/KERNELS.md, "Pitfalls").

Layers are passed in, not imported: a streaming EXL3 linear is anything with ``mode ==
"streaming"``, ``trellis``, ``suh``, ``svh``, ``codebook``, ``in_features``/``out_features``, their
padded sizes and ``bias``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from engine.kernels import loader, tuning
from engine.kernels.loader import CODEBOOK_IDS, KERNEL_DTYPES

# Rows per GEMV launch: the MMA's N = 8, twice (9..16 rows decode each tile once for two column
# groups of 8), so a speculative verify step of up to 15 drafts per sequence stays on the GEMV.
GEMV_ROWS = 16
# Up to this many rows the GEMV runs; above it the weight is decoded once for a GEMM (re-reading
# the packed weight per 16-row launch loses to that: docs/KERNELS.md section 3.7).
GEMV_MAX_ROWS = 16
FUSED_WEIGHT_BYTES = 1 << 30
GEMV_MAX_MATRICES = 3  # ext/trellis_ext.h kGemvMaxMats
GEMV_INT8_ROWS = 2  # ext/exl3_gemv_cluster.cuh kClusterInt8MaxRows: no faster than fp16 at 3-4 rows
_MAX_CHUNKS_PER_SPLIT = 16  # ext/exl3_gemv.cuh kGemvMaxChunks
_GROUP_ROWS = 8  # ext/exl3_gemv.cuh kGemvMaxRows: rows of one MMA column group
_MAX_CLUSTER = 16  # ext/exl3_gemv_cluster.cuh: largest cluster (non-portable above 8)

_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def clear_workspaces() -> None:
    """Drop the workspace GEMV's buffers (a reset of the extension)."""
    _workspaces.clear()


def workspaces() -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """The workspace GEMV's current buffers: a CUDA graph bakes their addresses in, so it keeps
    them alive (a later, larger model gets new ones)."""
    return tuple(_workspaces.values())


def _workspace_chunks(rows: int) -> int:
    """Input chunks per block of the workspace GEMV at ``rows`` rows (ext/exl3_gemv.cuh
    gemv_max_chunks): its static shared memory holds half the chunks for two column groups."""
    return _MAX_CHUNKS_PER_SPLIT if rows <= _GROUP_ROWS else _MAX_CHUNKS_PER_SPLIT // 2


def _workspace_split_range(in_features: int, rows: int) -> tuple[int, int]:
    """The split counts of a workspace GEMV launch: at least the shared-memory bound on input chunks
    per block, at most 16 (ext/trellis_ext.cpp choose_splits) or that bound, whichever is larger."""
    n_chunks = in_features // 128
    low = math.ceil(n_chunks / _workspace_chunks(rows))
    return low, max(low, min(n_chunks, 16))


def _workspace(
    device: torch.device, in_features: int, out_features: int, rows: int = GEMV_ROWS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partial sums and the per-column-group tickets of the workspace GEMV (kept zeroed by
    the kernel), for up to ``rows`` rows and the most splits :func:`_workspace_split_range` allows."""
    groups = out_features // 128
    floats = _workspace_split_range(in_features, rows)[1] * rows * out_features
    ws = _workspaces.get(device)
    if ws is None or ws[0].numel() < floats or ws[1].numel() < groups:
        old_f = ws[0].numel() if ws else 0
        old_g = ws[1].numel() if ws else 0
        ws = (
            torch.empty(max(floats, old_f), dtype=torch.float32, device=device),
            torch.zeros(max(groups, old_g), dtype=torch.int32, device=device),
        )
        _workspaces[device] = ws
    return ws


# -- which GEMV -------------------------------------------------------------------------------


def _cluster_runs(ext: ModuleType | None, device: torch.device, cluster: bool | None) -> bool:
    """The cluster GEMV runs: asked for (``cluster``; None: wherever it can), built, and the GPU
    has thread-block clusters (sm_90+)."""
    if cluster is False or not hasattr(ext, "exl3_gemv_cluster"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _use_cluster(ext: ModuleType, x: torch.Tensor, cluster: bool | None, splits: int = 0) -> bool:
    if not _cluster_runs(ext, x.device, cluster):
        if cluster:
            raise ValueError("the cluster GEMV needs sm_90 or newer and an extension built with it")
        return False
    # Checked here, not left to the extension: a failed argument check inside the extension once
    # killed the process on the GPU machine instead of raising (docs/KERNELS.md, "Pitfalls"), and
    # Python can name the problem more clearly anyway.
    chunks = x.shape[-1] // 128
    low, high = -(-chunks // _MAX_CHUNKS_PER_SPLIT), min(chunks, _MAX_CLUSTER)
    if splits and not low <= splits <= high:
        raise ValueError(f"splits must be in [{low}, {high}] for {x.shape[-1]} in features, got {splits}")
    return True


def int8_gemv_available(device: torch.device) -> bool:
    """True where MUL1 GEMVs at 1..GEMV_INT8_ROWS rows run the int8 kernel (the cluster GEMV runs
    there): for reports."""
    if device.type != "cuda":
        return False
    return _cluster_runs(loader.extension(), device, None)


def _int8(codebook: str, int8: bool | None, rows: int) -> bool:
    """Whether the int8 variant of the cluster GEMV runs. ``int8=None``: wherever it applies (MUL1,
    1..GEMV_INT8_ROWS rows); ``True`` insists (a ValueError where it cannot); ``False``: the fp16
    variant."""
    applies = codebook == "mul1" and rows <= GEMV_INT8_ROWS
    if int8 and not applies:
        raise ValueError(
            f"the int8 GEMV takes MUL1 weights and 1..{GEMV_INT8_ROWS} rows (got {codebook}, {rows} rows)"
        )
    return applies if int8 is None else bool(int8)


def _variant(int8: bool) -> str:
    return "int8" if int8 else "fp16"


def _cluster_launch(
    ext: ModuleType,
    x: torch.Tensor,
    trellises: Sequence[torch.Tensor],
    suhs: Sequence[torch.Tensor],
    svhs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    codebook: str,
    splits: int,
    int8: bool,
) -> int:
    """One cluster GEMV launch of 1..3 matrices of one input (``splits`` 0: the kernel's choice);
    returns the split count it ran with."""
    return ext.exl3_gemv_cluster(
        x, list(trellises), list(suhs), list(svhs), list(ys), CODEBOOK_IDS[codebook], splits, int8=int8
    )


def _cluster_splits(
    ext: ModuleType, x: torch.Tensor, trellises: Sequence[torch.Tensor], codebook: str, int8: bool
) -> int:
    """The measured split count of this cluster GEMV launch shape (0: the kernel's)."""

    def launch(x, ts, suhs, svhs, ys, splits) -> None:
        _cluster_launch(ext, x, ts, suhs, svhs, ys, codebook, splits, int8)

    candidates = tuning.split_range(x.shape[-1], _MAX_CHUNKS_PER_SPLIT, _MAX_CLUSTER)
    return tuning.tuned_splits(x, trellises, codebook, _variant(int8), launch, candidates)


# -- the GEMV entry points ------------------------------------------------------------------------


def exl3_gemv(
    x: torch.Tensor,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: str,
    splits: int = 0,
    cluster: bool | None = None,
    int8: bool | None = None,
) -> torch.Tensor | None:
    """``had(had(x * suh) @ Q) * svh`` for ``x`` ``(m <= 16, in)`` on the GPU; None without the
    extension or for CPU tensors.

    ``splits`` forces the split-K count (0: the tuned count); ``cluster`` the kernel (None: the
    cluster GEMV where the GPU has clusters, else the workspace GEMV); ``int8`` the integer-MMA
    variant for MUL1 (None: where it applies); all for tests and benchmarks.
    """
    ys = _gemv_launch(x, [trellis], [suh], [svh], codebook, splits, cluster, int8)
    return None if ys is None else ys[0]


def exl3_gemv_multi(
    x: torch.Tensor,
    trellises: list[torch.Tensor],
    suhs: list[torch.Tensor],
    svhs: list[torch.Tensor],
    codebook: str,
    splits: int = 0,
    cluster: bool | None = None,
    int8: bool | None = None,
) -> list[torch.Tensor] | None:
    """:func:`exl3_gemv` of up to three matrices that share ``x`` and the codebook, in one launch.

    The matrices may differ in out features and bits per weight. ``splits`` forces the split-K
    count of every matrix (0: the tuned count for the whole launch). With the same ``splits``
    each output equals :func:`exl3_gemv`'s up to the order of fp32 additions (same sums per block).
    """
    if not 1 <= len(trellises) <= GEMV_MAX_MATRICES or not len(trellises) == len(suhs) == len(svhs):
        raise ValueError(f"exl3_gemv_multi takes 1..{GEMV_MAX_MATRICES} matrices with one suh/svh each")
    in_f = trellises[0].shape[0] * 16
    if x.ndim != 2 or not 1 <= x.shape[0] <= GEMV_ROWS or x.shape[1] != in_f:
        raise ValueError(f"exl3_gemv takes (1..{GEMV_ROWS}, {in_f}) activations, got {tuple(x.shape)}")
    if any(t.shape[0] * 16 != in_f for t in trellises) or any(s.numel() != in_f for s in suhs):
        raise ValueError("exl3_gemv_multi: every matrix must have the same in features as x")
    ext = loader.kernel_ready(x, *trellises)
    if ext is None:
        return None
    outs = [t.shape[1] * 16 for t in trellises]
    ys = [torch.empty(x.shape[0], o, dtype=x.dtype, device=x.device) for o in outs]
    if _use_cluster(ext, x, cluster, splits):
        use_int8 = _int8(codebook, int8, x.shape[0])
        splits = splits or _cluster_splits(ext, x, trellises, codebook, use_int8)
        _cluster_launch(ext, x, trellises, suhs, svhs, ys, codebook, splits, use_int8)
        return ys
    if int8:
        raise ValueError("the int8 GEMV is a variant of the cluster GEMV (sm_90 or newer)")
    # As in _use_cluster, checked here rather than in the extension; at most what _workspace holds.
    low, high = _workspace_split_range(in_f, x.shape[0])
    if splits and not low <= splits <= high:
        raise ValueError(
            f"splits must be in [{low}, {high}] for {x.shape[0]} rows of {in_f} features, got {splits}"
        )
    # One workspace holds every matrix's region (sized as for one matrix of sum(outs) features).
    partial, counters = _workspace(x.device, in_f, sum(outs), x.shape[0])
    if len(trellises) == 1:
        ext.exl3_gemv(
            x, trellises[0], suhs[0], svhs[0], ys[0], partial, counters, CODEBOOK_IDS[codebook], splits
        )
        return ys
    ext.exl3_gemv_multi(
        x, list(trellises), list(suhs), list(svhs), ys, partial, counters, CODEBOOK_IDS[codebook], splits
    )
    return ys


# exl3_gemv's own reference to the launch, so that a test replacing exl3_gemv_multi (to count
# projection-group launches) does not count single launches.
_gemv_launch = exl3_gemv_multi


# -- layers -------------------------------------------------------------------------------------


def _kernel_rows(x: torch.Tensor, padded_in: int) -> torch.Tensor:
    """``x`` as contiguous ``(rows, padded_in)`` in a kernel dtype (others go to fp32), zero-extended
    to the stored in features (docs/EXL3_FORMAT.md section 3.3, padding)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype not in KERNEL_DTYPES:
        x2 = x2.float()
    if x2.shape[1] < padded_in:
        x2 = F.pad(x2, (0, padded_in - x2.shape[1]))
    return x2.contiguous()


def _layer_output(y: torch.Tensor, layer: Any, x: torch.Tensor) -> torch.Tensor:
    """A layer's ``(rows, >= out)`` kernel result as its output: the padding cut, the bias added,
    ``x``'s dtype and leading dims."""
    if y.shape[1] != layer.out_features:
        y = y[:, : layer.out_features]
    if layer.bias is not None:
        y = y + layer.bias.to(y.dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)


def _streaming_exl3(layer: Any) -> bool:
    """A streaming EXL3 linear (its packed trellis, for the GEMV kernels)."""
    return getattr(layer, "mode", None) == "streaming" and hasattr(layer, "trellis")


def exl3_weight(layers: list[Any], dtype: torch.dtype) -> torch.Tensor | None:
    """The whole weights ``W`` ``(padded_in, padded_out)`` of streaming EXL3 linears of one input,
    side by side in one ``dtype`` buffer (``ext/exl3_weight.cu``: decode, both Hadamards on the
    tensor cores and the scales in one pass). The prefill path multiplies the activations by it
    with one GEMM. None without the extension."""
    first = layers[0]
    # Checked here rather than in the extension (see _use_cluster on why).
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"exl3_weight makes fp16, bf16 or fp32 weights, not {dtype}")
    if any(layer.padded_in != first.padded_in for layer in layers):
        raise ValueError("exl3_weight: the layers of one buffer must share their (padded) in features")
    if any(layer.trellis.device != first.trellis.device for layer in layers):
        raise ValueError("exl3_weight: the layers of one buffer must be on one device")
    ext = loader.kernel_ready(*(layer.trellis for layer in layers))
    if ext is None or not hasattr(ext, "exl3_weight_into"):
        return None
    w = torch.empty(
        first.padded_in, sum(layer.padded_out for layer in layers), dtype=dtype, device=first.trellis.device
    )
    col = 0
    for layer in layers:
        ext.exl3_weight_into(layer.trellis, layer.suh, layer.svh, CODEBOOK_IDS[layer.codebook], w, col)
        col += layer.padded_out
    return w


def _exl3_gemm_fused(x: torch.Tensor, layers: list[Any]) -> list[torch.Tensor] | None:
    """Many rows through projections of one input: one ``W`` buffer for all of them, one GEMM."""
    first = layers[0]
    dtype = x.dtype if x.dtype in KERNEL_DTYPES else torch.float32
    if sum(layer.padded_out for layer in layers) * first.padded_in * dtype.itemsize > FUSED_WEIGHT_BYTES:
        return None  # each layer on its own: a smaller temporary
    x2 = _kernel_rows(x, first.padded_in)
    w = exl3_weight(layers, x2.dtype)
    if w is None:
        return None
    y_all = x2 @ w
    outs, col = [], 0
    for layer in layers:
        outs.append(_layer_output(y_all[:, col : col + layer.padded_out], layer, x))
        col += layer.padded_out
    return outs


def exl3_gemm(x: torch.Tensor, layer: Any) -> torch.Tensor | None:
    """``layer(x)`` for a streaming EXL3 linear through the kernels, or None where none applies
    (CPU tensors, dense layers, no extension): the layer then runs its torch path. Up to
    :data:`GEMV_MAX_ROWS` rows: the GEMV in one launch; more rows: the whole weight and one GEMM."""
    if getattr(layer, "mode", None) != "streaming":
        return None
    ext = loader.kernel_ready(x, layer.trellis)
    if ext is None:
        return None
    x2 = _kernel_rows(x, layer.padded_in)
    m = x2.shape[0]
    if m == 0:
        y = x2.new_empty(0, layer.padded_out)
    elif m <= GEMV_MAX_ROWS:
        parts = [
            exl3_gemv(x2[i : i + GEMV_ROWS], layer.trellis, layer.suh, layer.svh, layer.codebook)
            for i in range(0, m, GEMV_ROWS)
        ]
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
    else:
        w = exl3_weight([layer], x2.dtype)
        if w is None:
            return None
        y = x2 @ w
    return _layer_output(y, layer, x)


def exl3_gemm_multi(x: torch.Tensor, layers: list[Any]) -> list[torch.Tensor] | None:
    """``[layer(x) for layer in layers]`` in one GEMV launch (or, above :data:`GEMV_MAX_ROWS`
    rows, one whole-weight buffer and one GEMM), or None where that does not apply: 2..3 streaming
    EXL3 linears on the GPU with the same codebook and (padded) in features. The caller then runs
    each layer itself. One launch instead of three took q/k/v from 30.8 to 17.4 us at 1 row
    (docs/KERNELS.md section 3.4)."""
    if not x.is_cuda or not 2 <= len(layers) <= GEMV_MAX_MATRICES:
        return None
    first = layers[0]
    for layer in layers:
        if not _streaming_exl3(layer):
            return None
        if layer.codebook != first.codebook or layer.padded_in != first.padded_in:
            return None
        if layer.in_features != first.in_features or not layer.trellis.is_cuda:
            return None
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    ext = loader.kernel_ready(x)
    if ext is None:
        return None
    if m > GEMV_MAX_ROWS:
        return _exl3_gemm_fused(x, layers) if hasattr(ext, "exl3_weight_into") else None
    if m < 1 or not hasattr(ext, "exl3_gemv_multi"):
        return None
    x2 = _kernel_rows(x, first.padded_in)
    ys = exl3_gemv_multi(
        x2, [l.trellis for l in layers], [l.suh for l in layers], [l.svh for l in layers], first.codebook
    )
    if ys is None:
        return None
    return [_layer_output(y, layer, x) for layer, y in zip(layers, ys)]


def exl3_qkv_rope_write(
    x: torch.Tensor,
    layers: list[Any],
    tables: tuple[torch.Tensor, torch.Tensor],
    keys,
    values,
    slots: torch.Tensor,
    head_dim: int,
) -> torch.Tensor | None:
    """A decode step's ``q, k, v = layers(x)``, rotate-half RoPE of q and k with ``tables`` and
    the write of k and v into the dense cache stores ``keys``/``values`` at ``slots``, in one int8
    GEMV launch (the cluster GEMV's q/k/v epilogue: one launch fewer per layer, the separate RoPE +
    KV-write kernel's numbers bit for bit); returns q rotated ``(rows, q out)``. None where that
    launch does not apply (then the caller projects, rotates and writes apart, with the same
    numbers): three streaming MUL1 EXL3 linears without bias or padding at 1..GEMV_INT8_ROWS rows,
    fp16/bf16, head_dim 64 or 128 rotated whole, dense caches of x's dtype, sm_90+."""
    if not x.is_cuda or len(layers) != 3 or x.dtype not in (torch.float16, torch.bfloat16):
        return None
    rows = x.numel() // x.shape[-1]
    if rows > GEMV_INT8_ROWS or slots.numel() != rows:
        return None
    for layer in layers:
        if not _streaming_exl3(layer) or layer.bias is not None:
            return None
        if layer.codebook != "mul1" or not layer.trellis.is_cuda:
            return None
        if (
            layer.in_features != x.shape[-1]
            or layer.padded_in != x.shape[-1]
            or layer.padded_out != layer.out_features
        ):
            return None
    cos, sin = tables
    if head_dim not in (64, 128) or cos.shape[-1] != head_dim or cos.numel() != rows * head_dim:
        return None
    if not cos.dtype == sin.dtype == x.dtype or not cos.is_contiguous() or not sin.is_contiguous():
        return None
    caches = []
    for store, layer in ((keys, layers[1]), (values, layers[2])):
        data = getattr(store, "data", None)  # a dense store's [slots, kv heads, head_dim]
        if data is None or not data.is_cuda or data.dtype != x.dtype or not data.is_contiguous():
            return None
        if data.ndim != 3 or data.shape[1] * data.shape[2] != layer.out_features:
            return None
        caches.append(data)
    ext = loader.kernel_ready(x)
    if ext is None or not _cluster_runs(ext, x.device, None):
        return None
    x2 = x.reshape(rows, x.shape[-1]).contiguous()
    trellises = [layer.trellis for layer in layers]
    splits = _cluster_splits(ext, x2, trellises, "mul1", True)
    q = torch.empty(rows, layers[0].out_features, dtype=x.dtype, device=x.device)
    ext.exl3_gemv_cluster(
        x2,
        trellises,
        [layer.suh for layer in layers],
        [layer.svh for layer in layers],
        [q, q, q],  # k's and v's go to the caches
        CODEBOOK_IDS["mul1"],
        splits,
        int8=True,
        caches=[None, *caches],
        rope=[True, True, False],
        cos=cos,
        sin=sin,
        slots=slots.to(torch.int64).contiguous(),
        head_dim=head_dim,
    )
    return q
