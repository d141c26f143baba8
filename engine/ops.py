"""The one dispatch point between the engine and its CUDA kernels.

Every function here computes the same thing as a torch reference in :mod:`engine.quant`; the
CUDA extension (``ext/``, built by :mod:`engine.ext_build`) is used when the tensors are on a
GPU and the extension is available, otherwise the caller keeps its reference path.

Importing this module is free: the extension is built or loaded on the first call that sees a
CUDA tensor, never on a CPU-only machine. Where it cannot be had (no toolkit, old GPU, build
error, ``TRELLIS_NO_EXT=1``) the engine says so once on stderr and runs the torch path.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

DISABLE_ENV = "TRELLIS_NO_EXT"
CODEBOOK_IDS = {"3inst": 0, "mcg": 1, "mul1": 2}
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

GEMV_ROWS = 8  # rows per GEMV launch (the MMA's N)
# Up to this many rows the GEMV runs in 8-row launches (each re-reads the packed weight); above it,
# decode Q once and use cuBLAS. H200, 4096x14336 at 4 bpw: 16 rows take 86 us either way, 32 rows
# 172 us as GEMV launches vs 86 us reconstruct + cuBLAS, so the GEMV stops at 8.
GEMV_MAX_ROWS = int(os.environ.get("TRELLIS_GEMV_MAX_ROWS", "8"))
# Above GEMV_MAX_ROWS (prefill): decode the whole weight W once (both Hadamards and the scales
# folded in, ext/exl3_weight.cu) and run one GEMM in the activations' dtype; projections that
# share an input get one W buffer and one GEMM while it stays under FUSED_WEIGHT_BYTES.
# TRELLIS_WEIGHT_PREFILL=0 selects the older path (rotate x, decode Q, fp16 GEMM, rotate y).
WEIGHT_PREFILL = os.environ.get("TRELLIS_WEIGHT_PREFILL", "1") != "0"
# Which whole-weight kernel: 2 (Hadamards on the tensor cores, default) or 1 (warp shuffles), for A/B.
WEIGHT_KERNEL = int(os.environ.get("TRELLIS_WEIGHT_KERNEL", "2"))
FUSED_WEIGHT_BYTES = 1 << 30
_MAX_CHUNKS_PER_SPLIT = 16  # ext/exl3_gemv.cuh kGemvMaxChunks
_V5_MAX_CLUSTER = 16  # ext/exl3_gemv_v5.cuh: largest cluster (non-portable above 8)
# The fast GEMV skips the fp16 rounding of each decoded weight (ext/exl3_gemv.cuh, FAST): fewer
# integer instructions per weight, results within one fp16 rounding per weight of the exact
# product. TRELLIS_GEMV_EXACT=1 selects the variant that multiplies the bit-exact fp16 weights.
GEMV_FAST = os.environ.get("TRELLIS_GEMV_EXACT", "") in ("", "0")
# The int8 GEMV (ext/exl3_gemv_v5.cuh, I8): MUL1 weights at 1..GEMV_INT8_ROWS rows multiply on the
# integer tensor cores, each hash word used as four u8 MMA operands as it is, the inputs as 15-bit
# fixed point (hi and lo bytes in the MMA's idle batch columns). Needs GEMV v5. docs/KERNELS.md has
# its accuracy and speed; TRELLIS_GEMV_INT8=0 turns it off (A/B runs).
GEMV_INT8 = os.environ.get("TRELLIS_GEMV_INT8", "1") not in ("", "0")
GEMV_INT8_ROWS = 2  # ext/exl3_gemv_v5.cuh kV5Int8MaxRows
# TRELLIS_GEMV_ILP=1 (read by the extension itself, once per process): experimental fast
# 3INST/MCG kernels with two accumulators per tile and 2 blocks per SM (docs/KERNELS.md).

_ext: ModuleType | None = None
_tried = False
_reason = "not loaded yet"
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def extension() -> ModuleType | None:
    """The CUDA extension (built/loaded on first call), or None where it is not available."""
    global _ext, _tried, _reason
    if _tried:
        return _ext
    _tried = True
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        _reason = f"disabled by {DISABLE_ENV}"
        return None
    if not torch.cuda.is_available():
        _reason = "no CUDA GPU"  # the normal CPU case: nothing to say
        return None
    from engine import ext_build

    try:
        _ext = ext_build.load()
        _reason = "loaded"
    except ext_build.ExtensionUnavailable as exc:
        _reason = str(exc)
        print(f"trellis: CUDA extension unavailable ({exc}); using the torch reference path", file=sys.stderr)
    return _ext


def status() -> dict[str, Any]:
    """Whether the extension is in use and why not (after :func:`extension` was called)."""
    from engine import ext_build

    info = ext_build.info()
    return {
        "available": _ext is not None,
        "reason": _reason,
        "module": info.module_path if info else None,
        "build_seconds": info.seconds if info else None,
        "prebuilt": info.prebuilt if info else None,
    }


def reset() -> None:
    """Forget the loaded extension so the next call tries again (tests, ``build-ext``)."""
    global _ext, _tried, _reason
    _ext, _tried, _reason = None, False, "not loaded yet"
    _workspaces.clear()


def _kernel_ready(*tensors: torch.Tensor) -> ModuleType | None:
    if not all(t.is_cuda for t in tensors):
        return None
    # The kernels have no backward: where autograd must see through an op (the converter's
    # scale tuning, engine.quant.finetune) it takes the torch path.
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return extension()


def _workspace(
    device: torch.device, in_features: int, out_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partial sums and the per-column-group tickets of the GEMV (kept zeroed by the kernel).

    Sized for the most splits the kernel can choose (ext/trellis_ext.cpp choose_splits): at most
    16, or the shared-memory bound of 16 input chunks per block, whichever is larger.
    """
    n_chunks, groups = in_features // 128, out_features // 128
    max_splits = max(math.ceil(n_chunks / _MAX_CHUNKS_PER_SPLIT), min(n_chunks, 16))
    floats = max_splits * GEMV_ROWS * out_features
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


# The v5 GEMV (ext/exl3_gemv_v5.cuh: split-K over a thread-block cluster, no workspace, no
# atomics) runs every single and multi-matrix GEMV on sm_90+ (elsewhere v4 runs); 8B decode 176 ->
# 204-209 tok/s on the H200, and all of its GPU tests pass (docs/KERNELS.md). TRELLIS_GEMV_V5=0
# selects v4 for A/B runs; the ``v5`` argument of exl3_gemv / exl3_gemv_multi overrides it per call.
GEMV_V5 = os.environ.get("TRELLIS_GEMV_V5", "1") not in ("", "0")
# Chained launches (ext/chained_launch.cuh: programmatic dependent launch, sm_90+): inside
# ``chained_launches()`` our decode-step kernels (GEMV v5, norms, RoPE, KV write, attention,
# activation) launch while the previous one still runs; each waits for it before it reads or
# writes anything but weights, so a GEMV fetches its first weight rows during the previous
# kernel. Only valid where no kernel writes a weight the chain reads (a loaded model's decode
# step). TRELLIS_CHAINED=0 turns it off (A/B runs).
CHAINED = os.environ.get("TRELLIS_CHAINED", "1") not in ("", "0")


def chained_launches_supported(device: torch.device) -> bool:
    """True where :func:`chained_launches` can turn chaining on: a GPU of sm_90 or newer and an
    extension built with it."""
    if device.type != "cuda":
        return False
    ext = extension()
    if ext is None or not hasattr(ext, "set_chained_launches"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@contextlib.contextmanager
def chained_launches(device: torch.device, enabled: bool = True) -> Iterator[None]:
    """Within the block, decode-step kernels on ``device`` launch chained (see :data:`CHAINED`).

    A no-op on CPU, before sm_90, without the extension, or with ``TRELLIS_CHAINED=0``;
    ``enabled=False`` turns chaining off inside an enclosing block (timing fresh weight copies).
    The switch is per process: the previous setting is restored on exit.
    """
    if not chained_launches_supported(device):
        yield
        return
    ext = extension()
    previous = ext.set_chained_launches(enabled and CHAINED)
    try:
        yield
    finally:
        ext.set_chained_launches(previous)


def _v5_runs(ext: ModuleType | None, device: torch.device, v5: bool | None) -> bool:
    """GEMV v5 is selected (``v5``, default :data:`GEMV_V5`), built, and the GPU has clusters."""
    if not (GEMV_V5 if v5 is None else v5) or not hasattr(ext, "exl3_gemv_v5"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _use_v5(ext: ModuleType, x: torch.Tensor, v5: bool | None, splits: int = 0) -> bool:
    if not _v5_runs(ext, x.device, v5):
        return False
    # Checked here, not left to the extension: a failed argument check inside the extension once
    # killed the process on the GPU machine instead of raising (not reproduced since, docs/KERNELS.md),
    # and Python can name the problem more clearly anyway.
    chunks = x.shape[-1] // 128
    low, high = -(-chunks // _MAX_CHUNKS_PER_SPLIT), min(chunks, _V5_MAX_CLUSTER)
    if splits and not low <= splits <= high:
        raise ValueError(f"splits must be in [{low}, {high}] for {x.shape[-1]} in features, got {splits}")
    return True


def int8_gemv_available(device: torch.device) -> bool:
    """True where MUL1 GEMVs at 1..GEMV_INT8_ROWS rows run the int8 kernel by default (sm_90+, the
    extension with GEMV v5, the fast variant, ``TRELLIS_GEMV_INT8`` not 0): for reports."""
    if device.type != "cuda" or not (GEMV_INT8 and GEMV_FAST):
        return False
    return _v5_runs(extension(), device, None)


def _v5_variant(codebook: str, fast: bool, int8: bool | None, rows: int) -> str:
    """Which v5 kernel runs: "int8", "fast" or "exact". ``int8=None`` takes the int8 kernel where
    it applies and :data:`GEMV_INT8` allows it; ``int8=True`` insists (a ValueError where it cannot)."""
    int8_ok = codebook == "mul1" and fast and rows <= GEMV_INT8_ROWS
    if int8 and not int8_ok:
        raise ValueError(
            f"the int8 GEMV takes MUL1 weights, the fast variant and 1..{GEMV_INT8_ROWS} rows "
            f"(got {codebook}, {'fast' if fast else 'exact'}, {rows} rows)"
        )
    if int8 is None:
        int8 = GEMV_INT8 and int8_ok
    return "int8" if int8 else ("fast" if fast else "exact")


def _v5_splits(
    ext: ModuleType, x: torch.Tensor, trellises: Sequence[torch.Tensor], codebook: str, variant: str
) -> int:
    """The measured split count of this v5 launch shape (engine.gemv_tuning; 0: the kernel's)."""
    from engine import gemv_tuning

    def launch(x, ts, suhs, svhs, ys, splits) -> None:
        _v5_launch(ext, x, ts, suhs, svhs, ys, codebook, splits, variant)

    candidates = gemv_tuning.split_range(x.shape[-1], _MAX_CHUNKS_PER_SPLIT, _V5_MAX_CLUSTER)
    return gemv_tuning.tuned_splits(x, trellises, codebook, variant, launch, candidates)


def _v5_launch(
    ext: ModuleType,
    x: torch.Tensor,
    trellises: Sequence[torch.Tensor],
    suhs: Sequence[torch.Tensor],
    svhs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    codebook: str,
    splits: int,
    variant: str,
) -> int:
    """One v5 launch of 1..3 matrices of one input (``splits`` 0: the kernel's choice); returns
    the split count it ran with."""
    ids = CODEBOOK_IDS[codebook]
    fast, int8 = variant != "exact", variant == "int8"
    return ext.exl3_gemv_v5(x, list(trellises), list(suhs), list(svhs), list(ys), ids, splits, fast, int8)


def exl3_gemv(
    x: torch.Tensor,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: str,
    splits: int = 0,
    fast: bool | None = None,
    v5: bool | None = None,
    int8: bool | None = None,
) -> torch.Tensor:
    """``had(had(x * suh) @ Q) * svh`` for ``x`` ``(m <= 8, in)`` on the GPU (the kernel, no fallback).

    ``splits`` forces the split-K count (0: the tuned count); ``fast`` picks the variant
    (default :data:`GEMV_FAST`); ``v5`` the kernel version (default :data:`GEMV_V5`); ``int8`` the
    integer-MMA kernel for MUL1 (default :data:`GEMV_INT8` where it applies); all for tests and
    benchmarks.
    """
    return _gemv_launch(x, [trellis], [suh], [svh], codebook, splits, fast, v5, int8)[0]


GEMV_MAX_MATRICES = 3  # ext/trellis_ext.h kGemvMaxMats
# TRELLIS_GEMV_MULTI=0 turns the multi-matrix launch off (ProjectionGroup then runs one launch
# per matrix): for A/B timing and as an escape hatch.
GEMV_MULTI = os.environ.get("TRELLIS_GEMV_MULTI", "1") not in ("", "0")


def exl3_gemv_multi(
    x: torch.Tensor,
    trellises: list[torch.Tensor],
    suhs: list[torch.Tensor],
    svhs: list[torch.Tensor],
    codebook: str,
    splits: int = 0,
    fast: bool | None = None,
    v5: bool | None = None,
    int8: bool | None = None,
) -> list[torch.Tensor]:
    """:func:`exl3_gemv` of up to three matrices that share ``x`` and the codebook, in one launch.

    The matrices may differ in out features and bits per weight. ``splits`` forces the split-K
    count of every matrix (0: the tuned count for the whole launch). With the same ``splits``
    each output equals :func:`exl3_gemv`'s up to the order of fp32 additions (same sums per block).
    """
    ext = extension()
    if ext is None:
        raise RuntimeError(f"CUDA extension unavailable: {_reason}")
    if not 1 <= len(trellises) <= GEMV_MAX_MATRICES or not len(trellises) == len(suhs) == len(svhs):
        raise ValueError(f"exl3_gemv_multi takes 1..{GEMV_MAX_MATRICES} matrices with one suh/svh each")
    in_f = trellises[0].shape[0] * 16
    if x.ndim != 2 or not 1 <= x.shape[0] <= GEMV_ROWS or x.shape[1] != in_f:
        raise ValueError(f"exl3_gemv takes (1..{GEMV_ROWS}, {in_f}) activations, got {tuple(x.shape)}")
    if any(t.shape[0] * 16 != in_f for t in trellises) or any(s.numel() != in_f for s in suhs):
        raise ValueError("exl3_gemv_multi: every matrix must have the same in features as x")
    outs = [t.shape[1] * 16 for t in trellises]
    ys = [torch.empty(x.shape[0], o, dtype=x.dtype, device=x.device) for o in outs]
    fast = GEMV_FAST if fast is None else fast
    if _use_v5(ext, x, v5, splits):
        variant = _v5_variant(codebook, fast, int8, x.shape[0])
        splits = splits or _v5_splits(ext, x, trellises, codebook, variant)
        _v5_launch(ext, x, trellises, suhs, svhs, ys, codebook, splits, variant)
        return ys
    if int8:
        raise ValueError("the int8 GEMV is a GEMV v5 kernel (sm_90 or newer, TRELLIS_GEMV_V5 on)")
    # One workspace holds every matrix's region (sized as for one matrix of sum(outs) features).
    partial, counters = _workspace(x.device, in_f, sum(outs))
    if len(trellises) == 1:
        ext.exl3_gemv(
            x, trellises[0], suhs[0], svhs[0], ys[0], partial, counters, CODEBOOK_IDS[codebook], splits, fast
        )
        return ys
    ext.exl3_gemv_multi(
        x,
        list(trellises),
        list(suhs),
        list(svhs),
        ys,
        partial,
        counters,
        CODEBOOK_IDS[codebook],
        splits,
        fast,
    )
    return ys


# exl3_gemv's own reference to the launch, so that a test replacing ops.exl3_gemv_multi (to count
# projection-group launches) does not count single launches.
_gemv_launch = exl3_gemv_multi


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


def _exl3_gemm_fused(x: torch.Tensor, layers: list[Any]) -> list[torch.Tensor] | None:
    """Many rows through projections of one input: one ``W`` buffer for all of them, one GEMM."""
    first = layers[0]
    dtype = x.dtype if x.dtype in KERNEL_DTYPES else torch.float32
    if sum(layer.padded_out for layer in layers) * first.padded_in * dtype.itemsize > FUSED_WEIGHT_BYTES:
        return None  # each layer on its own: a smaller temporary
    x2 = _kernel_rows(x, first.padded_in)
    y_all = x2 @ exl3_weight(layers, x2.dtype)
    outs, col = [], 0
    for layer in layers:
        outs.append(_layer_output(y_all[:, col : col + layer.padded_out], layer, x))
        col += layer.padded_out
    return outs


def _streaming_exl3(layer: Any) -> bool:
    """A streaming :class:`~engine.quant.EXL3Linear` (its packed trellis, for the GEMV kernels)."""
    return getattr(layer, "mode", None) == "streaming" and hasattr(layer, "trellis")


def exl3_gemm_multi(x: torch.Tensor, layers: list[Any]) -> list[torch.Tensor] | None:
    """``[layer(x) for layer in layers]`` in one GEMV launch, or None where that does not apply.

    Applies on the GPU to 2..3 streaming :class:`~engine.quant.EXL3Linear` layers with the same
    codebook and (padded) in features, for 1..8 rows; the caller then runs each layer itself.
    """
    if not GEMV_MULTI or not x.is_cuda or not 2 <= len(layers) <= GEMV_MAX_MATRICES:
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
    ext = _kernel_ready(x)
    if m > GEMV_MAX_ROWS and WEIGHT_PREFILL and ext is not None and hasattr(ext, "exl3_weight_into"):
        return _exl3_gemm_fused(x, layers)
    if not 1 <= m <= min(GEMV_ROWS, GEMV_MAX_ROWS):
        return None
    if ext is None or not hasattr(ext, "exl3_gemv_multi"):
        return None
    x2 = _kernel_rows(x, first.padded_in)
    ys = exl3_gemv_multi(
        x2, [l.trellis for l in layers], [l.suh for l in layers], [l.svh for l in layers], first.codebook
    )
    return [_layer_output(y, layer, x) for layer, y in zip(layers, ys)]


# The decode step's q/k/v GEMV can rotate q and k by RoPE and store k and v into a dense KV cache
# itself (ext/exl3_gemv_v5.cuh, a branch of its int8 kernel: one launch fewer per layer, the RoPE + KV-write
# kernel's numbers bit for bit). TRELLIS_QKV_EPILOGUE=0 turns it off (A/B runs).
QKV_EPILOGUE = os.environ.get("TRELLIS_QKV_EPILOGUE", "1") not in ("", "0")


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
    GEMV launch; returns q rotated ``(rows, q out)``. None where that launch does not apply (then
    the caller projects, rotates and writes apart, with the same numbers bit for bit): three
    streaming MUL1 EXL3 linears without bias or padding at 1..GEMV_INT8_ROWS rows, fp16/bf16,
    head_dim 64 or 128 rotated whole, dense caches of x's dtype, sm_90+."""
    if (
        not QKV_EPILOGUE
        or not x.is_cuda
        or len(layers) != 3
        or x.dtype not in (torch.float16, torch.bfloat16)
    ):
        return None
    rows = x.numel() // x.shape[-1]
    if _v5_variant("mul1", GEMV_FAST, None, rows) != "int8" or slots.numel() != rows:
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
        data = getattr(store, "data", None)  # a DenseStore's [slots, kv heads, head_dim]
        if data is None or not data.is_cuda or data.dtype != x.dtype or not data.is_contiguous():
            return None
        if data.ndim != 3 or data.shape[1] * data.shape[2] != layer.out_features:
            return None
        caches.append(data)
    ext = _kernel_ready(x)
    if ext is None or not _v5_runs(ext, x.device, None):
        return None
    x2 = x.reshape(rows, x.shape[-1]).contiguous()
    trellises = [layer.trellis for layer in layers]
    splits = _v5_splits(ext, x2, trellises, "mul1", "int8")
    q = torch.empty(rows, layers[0].out_features, dtype=x.dtype, device=x.device)
    ext.exl3_gemv_v5(
        x2,
        trellises,
        [layer.suh for layer in layers],
        [layer.svh for layer in layers],
        [q, q, q],  # k's and v's go to the caches
        CODEBOOK_IDS["mul1"],
        splits,
        True,
        True,
        caches=[None, *caches],
        rope=[True, True, False],
        cos=cos,
        sin=sin,
        slots=slots.to(torch.int64).contiguous(),
        head_dim=head_dim,
    )
    return q


def exl3_weight(layers: list[Any], dtype: torch.dtype, version: int | None = None) -> torch.Tensor:
    """The whole weights ``W`` ``(padded_in, padded_out)`` of streaming EXL3 linears of one input,
    side by side in one ``dtype`` buffer (``ext/exl3_weight.cu``: decode, both Hadamards and the
    scales in one pass). The prefill path multiplies the activations by it with one GEMM.
    ``version``: the kernel (default :data:`WEIGHT_KERNEL`).
    """
    ext = extension()
    if ext is None:
        raise RuntimeError(f"CUDA extension unavailable: {_reason}")
    first = layers[0]
    # Checked here rather than in the extension (see _use_v5 on why).
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"exl3_weight makes fp16, bf16 or fp32 weights, not {dtype}")
    if any(layer.padded_in != first.padded_in for layer in layers):
        raise ValueError("exl3_weight: the layers of one buffer must share their (padded) in features")
    if any(layer.trellis.device != first.trellis.device for layer in layers):
        raise ValueError("exl3_weight: the layers of one buffer must be on one device")
    version = WEIGHT_KERNEL if version is None else version
    if version not in (1, 2):
        raise ValueError(f"exl3_weight: kernel version must be 1 or 2, got {version}")
    w = torch.empty(
        first.padded_in, sum(layer.padded_out for layer in layers), dtype=dtype, device=first.trellis.device
    )
    col = 0
    for layer in layers:
        ext.exl3_weight_into(
            layer.trellis, layer.suh, layer.svh, CODEBOOK_IDS[layer.codebook], w, col, version
        )
        col += layer.padded_out
    return w


def exl3_decode(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """Decoded ``Q`` ``(in, out)`` fp16, bit-exact (kernel on the GPU, else the torch reference)."""
    ext = _kernel_ready(trellis)
    if ext is None:
        from engine.quant.reconstruct import decode_trellis

        return decode_trellis(trellis, codebook)
    return ext.exl3_reconstruct(trellis.contiguous(), CODEBOOK_IDS[codebook])


def hadamard128(
    x: torch.Tensor,
    pre: torch.Tensor | None = None,
    post: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``had128(x * pre) * post`` blockwise along the last dim (fp32 inside), in ``out_dtype``."""
    out_dtype = out_dtype or x.dtype
    ext = _kernel_ready(x)
    if ext is None or x.dtype not in KERNEL_DTYPES or out_dtype not in KERNEL_DTYPES:
        from engine.quant.hadamard import blockwise_hadamard

        v = x.float() if pre is None else x.float() * pre.float()
        v = blockwise_hadamard(v, dim=-1)
        return (v if post is None else v * post.float()).to(out_dtype)
    return ext.hadamard128(x.contiguous(), pre, post, out_dtype)


def exl3_gemm(x: torch.Tensor, layer: Any) -> torch.Tensor | None:
    """``layer(x)`` for a streaming :class:`~engine.quant.EXL3Linear` through the CUDA kernels.

    Returns None when no kernel applies (CPU tensors, dense layers, no extension), so the layer
    runs its torch reference instead. Up to :data:`GEMV_MAX_ROWS` rows: the on-the-fly GEMV in
    8-row launches; more rows: rotate the input, decode ``Q`` once, cuBLAS, rotate the output.
    """
    if getattr(layer, "mode", None) != "streaming":
        return None
    ext = _kernel_ready(x, layer.trellis)
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
    elif WEIGHT_PREFILL and hasattr(ext, "exl3_weight_into"):
        y = x2 @ exl3_weight([layer], x2.dtype)
    else:
        # fp16 activations/weights for cuBLAS, as the reference kernels do; an fp32 caller asked
        # for reference precision, so it gets an fp32 product (Q is exact in fp32).
        mm_dtype = torch.float32 if x2.dtype == torch.float32 else torch.float16
        u = ext.hadamard128(x2, layer.suh, None, mm_dtype)
        q = ext.exl3_reconstruct(layer.trellis, CODEBOOK_IDS[layer.codebook]).to(mm_dtype)
        y = ext.hadamard128(u @ q, None, layer.svh, x2.dtype)
    return _layer_output(y, layer, x)


def paged_decode_attention(
    q: torch.Tensor,
    layer,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    page_size: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor | None:
    """Decode attention over the paged cache on the GPU (``ext/paged_attention.cu``).

    Returns None where the kernel does not apply (CPU tensors, no extension, a case it does not
    cover); the caller then runs :func:`engine.cache.decode_attention.paged_decode_attention_reference`.
    Graph-safe: no host sync; the split count depends only on the shapes (``block_tables``' width).
    """
    ext = _kernel_ready(q, block_tables, lengths)
    if ext is None or not hasattr(ext, "paged_decode_attention"):
        return None
    if q.ndim != 3 or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[2] not in PAGED_HEAD_DIMS:
        return None
    k_side, v_side = _cache_side(layer.keys, q), _cache_side(layer.values, q)
    if k_side is None or v_side is None or q.shape[1] % k_side[0] != 0:
        return None
    return ext.paged_decode_attention(
        q.contiguous(),
        *k_side[1:],
        *v_side[1:],
        block_tables.to(torch.int32).contiguous(),
        lengths.to(torch.int32).contiguous(),
        int(page_size),
        float(scale),
        int(window or 0),
        float(softcap or 0.0),
    )


PAGED_HEAD_DIMS = (64, 128, 256)  # ext/paged_attention.cu instantiations


def _cache_side(store, q: torch.Tensor) -> tuple | None:
    """``(kv_heads, dense, codes, scales, bits)`` of a cache store for the kernel, or None if it can't."""
    data = getattr(store, "data", None)
    if data is not None:  # DenseStore: must already be in q's dtype (no conversion per step)
        if data.dtype != q.dtype or not data.is_cuda or not data.is_contiguous():
            return None
        return data.shape[1], data, None, None, 16
    codes = getattr(store, "codes", None)
    if codes is None or getattr(store, "group", None) != 32 or not codes.is_cuda:
        return None
    return codes.shape[1], None, codes, store.scales, store.bits


def quantized_cache_write(store, slots: torch.Tensor, x: torch.Tensor) -> bool:
    """Quantize ``x`` ``[n, kv_heads, head_dim]`` into a :class:`~engine.cache.quantized.QuantizedStore`
    at ``slots`` with one fused kernel (``ext/paged_attention.cu``). Returns False where it does not
    apply (CPU, no extension, groups other than 32); the store then runs its torch path.

    Codes equal :meth:`QuantizedStore.quantize`'s except where a rotated number lands within
    float32 rounding of a level boundary (the kernel rotates with a butterfly, torch with a
    matmul, so the rotated numbers may differ in the last bit).
    """
    ext = _kernel_ready(x, store.codes, slots)
    if ext is None or not hasattr(ext, "quantized_cache_write") or store.group != 32:
        return False
    if x.dtype not in KERNEL_DTYPES or x.ndim != 3 or x.shape[2] != store.head_dim:
        return False
    slots = slots.to(torch.int64).contiguous()
    ext.quantized_cache_write(x.contiguous(), slots, store.codes, store.scales, store.bits)
    return True


QUANTIZED_READ_DTYPES = (torch.float16, torch.bfloat16)  # ext/quantized_cache_read.cu outputs
QUANTIZED_READ_MAX_UNITS = 2**31 - 1 - 256  # 8-number units per launch (its int32 thread index)


def quantized_cache_read(store, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Rows ``slots`` of a :class:`~engine.cache.quantized.QuantizedStore`, dequantized to
    ``[n, kv_heads, head_dim]`` in ``dtype`` by one gather-dequantize-rotate kernel
    (``ext/quantized_cache_read.cu``).

    Returns None where it does not apply (CPU, no extension, groups other than 32, an output dtype
    other than fp16/bf16: fp32 reads are the exact references the tests compare against); the store
    then runs its torch path. Results are within fp32 rounding of :meth:`QuantizedStore.dequantize`
    before the cast to ``dtype`` (at most one unit in the last place of ``dtype`` apart). Graph-safe.
    """
    if dtype not in QUANTIZED_READ_DTYPES or store.group != 32:
        return None
    if slots.numel() * store.codes.shape[1] * (store.head_dim // 8) > QUANTIZED_READ_MAX_UNITS:
        return None  # beyond the kernel's 32-bit thread index (32 GB of output: never in practice)
    ext = _kernel_ready(store.codes, slots)
    if ext is None or not hasattr(ext, "quantized_cache_read"):
        return None
    slots = slots.to(torch.int64).contiguous()
    return ext.quantized_cache_read(store.codes, store.scales, slots, store.bits, dtype)


def viterbi_encode(x: torch.Tensor, k: int, table: torch.Tensor) -> torch.Tensor | None:
    """Tail-biting Viterbi for tiles ``x`` ``(N, 256)`` on the GPU (``ext/viterbi.cu``).

    Returns None where the kernel does not apply (CPU tensors, no extension, a table that is none
    of the three codebooks); the caller then runs :func:`engine.quant.viterbi.encode_tiles`. Same
    results as that path (same float operations and first-index tie rule).
    """
    if x.ndim != 2 or x.shape[1] != 256 or not 1 <= k <= 8:
        return None
    ext = _kernel_ready(x, table)
    if ext is None or not hasattr(ext, "viterbi_encode"):
        return None
    codebook = _codebook_of_table(table)
    if codebook is None:
        return None
    return ext.viterbi_encode(x.float().contiguous(), k, CODEBOOK_IDS[codebook], VITERBI_WORKSPACE_BYTES)


# Back-pointer workspace per viterbi_encode call (tiles run in chunks that fit it).
VITERBI_WORKSPACE_BYTES = 1 << 30


def _codebook_of_table(table: torch.Tensor) -> str | None:
    """Which codebook a value table is (the kernel computes values arithmetically), else None.

    The converter passes the cached :func:`~engine.quant.codebooks.codebook_table` tensors, so
    the identity test is the usual answer; any other table is compared by value.
    """
    from engine.quant.codebooks import CODEBOOKS, codebook_table

    for known, name in _viterbi_tables:
        if known is table and table._version == 0:  # unchanged since it was recognised
            return name
    found = None
    if table.shape == (65536,):
        for name in CODEBOOKS:
            ref = codebook_table(name, table.device)
            if ref is table or torch.equal(ref, table.to(ref.dtype)):
                found = name
                break
    if found is not None and not table.requires_grad and table._version == 0:
        # Remember it (held alive, so the identity test stays valid): the converter passes the
        # same table for every strip, and torch.equal would sync the host each time.
        _viterbi_tables.append((table, found))
        del _viterbi_tables[:-8]
    return found


_viterbi_tables: list[tuple[torch.Tensor, str]] = []


# Fused elementwise kernels of the decode step (ext/fused_ops.cu). Each returns None where it does
# not apply, and the caller runs its torch code; results agree to one rounding of the dtype.
ACT_IDS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1, "gelu_tanh": 1, "gelu": 2, "relu": 3}


# TRELLIS_ARGMAX_CLUSTER=0: one block per row always (A/B runs; ext/argmax.cu).
ARGMAX_CLUSTER = os.environ.get("TRELLIS_ARGMAX_CLUSTER", "1") not in ("", "0")


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of a ``[rows, vocab]`` tensor: torch's answer (the first maximum,
    a NaN above every number), through one block (or on sm_90 a cluster of blocks) per row on
    the GPU where it can (ext/argmax.cu: torch's reduction took 28 us for a 128K vocabulary), else
    torch's own."""
    ext = _kernel_ready(logits)
    if (
        ext is None
        or not hasattr(ext, "argmax_rows")
        or logits.dtype != torch.float32
        or logits.ndim != 2
        or logits.stride(-1) != 1
    ):
        return logits.argmax(dim=-1)
    return ext.argmax_rows(logits, cluster=ARGMAX_CLUSTER)


def _fused_ready(*tensors: torch.Tensor) -> ModuleType | None:
    if not all(t.dtype in KERNEL_DTYPES for t in tensors):
        return None
    ext = _kernel_ready(*tensors)
    return ext if ext is not None and hasattr(ext, "rms_norm") else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor | None:
    """:class:`engine.modules.norms.RMSNorm` over the last dim of ``x`` in one launch."""
    ext = _fused_ready(x, weight)
    if ext is None or weight.dtype != x.dtype or x.shape[-1] != weight.numel() or x.stride(-1) != 1:
        return None
    if not weight.is_contiguous():  # a copy is a kernel's output: a chained norm reads weights early
        return None
    rows = x.reshape(-1, x.shape[-1])
    return ext.rms_norm(rows, weight, eps, offset).view(x.shape)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(h + delta, RMSNorm(h + delta))`` in one launch: the residual add fused with the next norm.
    The sum is bit-identical to torch's ``h + delta``; the norm equals :func:`rms_norm` of it."""
    ext = _fused_ready(h, delta, weight)
    if ext is None or not hasattr(ext, "add_rms_norm"):
        return None
    # Checked here, not in the extension (see _use_v5 on why).
    if not h.dtype == delta.dtype == weight.dtype or h.shape != delta.shape or h.ndim == 0:
        return None
    if h.shape[-1] != weight.numel() or h.stride(-1) != 1 or delta.stride(-1) != 1:
        return None
    if not weight.is_contiguous():  # see rms_norm
        return None
    n = h.shape[-1]
    h_out, y = ext.add_rms_norm(h.reshape(-1, n), delta.reshape(-1, n), weight, eps, offset)
    return h_out.view(h.shape), y.view(h.shape)


def _dense_cache_sides(keys, values, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``(keys tensor, values tensor)`` of two dense cache stores where ``k`` and ``v`` ``[n,
    kv_heads, head_dim]`` (heads contiguous, rows may be strided) go into them at ``slots`` as they
    are (same dtype, the stores' row shapes, one slot per token), else None."""
    kd, vd = getattr(keys, "data", None), getattr(values, "data", None)
    if kd is None or vd is None or slots.ndim != 1:
        return None
    if not k.dtype == v.dtype == kd.dtype == vd.dtype:
        return None
    if not (kd.is_contiguous() and vd.is_contiguous()) or kd.shape[0] != vd.shape[0]:
        return None
    if k.ndim != 3 or v.ndim != 3 or k.shape[1:] != kd.shape[1:] or v.shape[1:] != vd.shape[1:]:
        return None
    if not k.shape[0] == v.shape[0] == slots.shape[0]:
        return None
    if any(t.stride(2) != 1 or t.stride(1) != t.shape[2] for t in (k, v)):
        return None
    return kd, vd


def kv_cache_write(keys, values, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Write ``k`` and ``v`` ``[n, kv_heads, head_dim]`` into two dense cache stores
    (:class:`~engine.cache.quantized.DenseStore`) at ``slots`` with one kernel instead of two
    ``index_copy_``. Returns False where it does not apply (CPU, no extension, a quantized side,
    a dtype conversion, heads not contiguous); the stores then write themselves. Graph-safe."""
    sides = _dense_cache_sides(keys, values, slots, k, v)
    if sides is None or k.dtype not in KERNEL_DTYPES:
        return False
    ext = _kernel_ready(k, v, *sides, slots)
    if ext is None or not hasattr(ext, "kv_cache_write"):
        return False
    ext.kv_cache_write(k, v, slots.to(torch.int64).contiguous(), *sides)
    return True


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """RoPE's cos and sin ``[tokens, 1, 2 * len(inv_freq)]`` in ``dtype`` for int64 ``positions``
    in one launch (ext/fused_ops.cu; torch's formula is nine), equal to
    :meth:`engine.modules.rope.RotaryEmbedding.tables` bit for bit; None where it does not run."""
    if dtype not in KERNEL_DTYPES or positions.dtype != torch.int64 or positions.ndim != 1:
        return None
    ext = _kernel_ready(positions)
    if ext is None or not hasattr(ext, "rope_tables"):
        return None
    cos, sin = ext.rope_tables(positions.contiguous(), inv_freq.float().contiguous(), factor, dtype)
    return cos, sin


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rotate-half RoPE of ``q`` and ``k`` ``[tokens, heads, d]`` with ``[tokens, 1, rot]`` tables."""
    ext = _fused_ready(q, k, cos, sin)
    if ext is None or q.ndim != 3 or k.ndim != 3 or not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        return None
    if any(t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] for t in (q, k)):
        return None
    q_out, k_out = ext.rope(q, k, cos.contiguous(), sin.contiguous())
    return q_out, k_out


# TRELLIS_ROPE_KV_FUSED=0: RoPE and the KV write as two launches (A/B runs, escape hatch).
ROPE_KV_FUSED = os.environ.get("TRELLIS_ROPE_KV_FUSED", "1") not in ("", "0")


def rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys,
    values,
    slots: torch.Tensor,
) -> torch.Tensor | None:
    """:func:`rope` of ``q`` and ``k`` and :func:`kv_cache_write` of the rotated keys and ``v`` in
    one launch; returns ``q`` rotated, or None where either does not apply (the caller then runs
    them apart). Graph-safe."""
    sides = None if not ROPE_KV_FUSED else _dense_cache_sides(keys, values, slots, k, v)
    if sides is None or k.shape != v.shape or q.ndim != 3 or slots.shape[0] != q.shape[0]:
        return None
    if not q.dtype == cos.dtype == sin.dtype == k.dtype or q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]:
        return None
    ext = _fused_ready(q, k, v, cos, sin)
    if ext is None or not hasattr(ext, "rope_kv_write"):
        return None
    slots = slots.to(torch.int64).contiguous()
    return ext.rope_kv_write(q, k, v, cos.contiguous(), sin.contiguous(), slots, *sides)


def act_mul(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor | None:
    """``act(gate) * up`` in one launch (the gated MLP's middle)."""
    ext = _fused_ready(gate, up)
    act = ACT_IDS.get(activation)
    if ext is None or act is None or gate.shape != up.shape or gate.dtype != up.dtype:
        return None
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        return None
    g, u = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
    return ext.act_mul(g, u, act).view(gate.shape)


# Sampling on the device (ext/sampling.cu): a cluster of blocks per row, or one block where the
# row does not fit the cluster's shared memory.
def sample_tokens(
    logits: torch.Tensor,
    rows: Any,
    u: torch.Tensor,
    out: torch.Tensor | None = None,
    pending: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token id per row of ``logits`` ``[rows, vocab]`` (fp32/bf16/fp16) after penalties,
    temperature, top-k, min-p and top-p, drawn with the uniform ``u`` ``[rows]`` (float32, one per
    row): :func:`engine.generation.device_sampling.sample_reference`'s decision. ``rows``: the
    batch's :class:`~engine.generation.device_sampling.SamplingRows` on the logits' device.

    On a GPU with the extension: one launch, no host sync, no allocation outside torch's
    allocator (CUDA-graph capturable); ``out`` (int64 or int32 ``[rows]``) receives the ids.
    Elsewhere the torch reference computes them. Returns ``out`` (a new int64 tensor if None).

    ``pending`` (int64 ``[rows]``, on the logits' device): each row's last generated token that
    ``rows``' lists do not hold yet (< 0: none), e.g. a pipelined step's input still on the
    device. The penalties then treat it as appended to the job's tokens: the same ids as packing
    the lists with it."""
    from engine.generation.device_sampling import SETTING_FIELDS, sample_reference

    if logits.ndim != 2 or logits.shape[0] < 1 or logits.shape[1] < 1:
        raise ValueError(f"sample_tokens takes [rows, vocab] logits, got {tuple(logits.shape)}")
    n, vocab = logits.shape
    if logits.dtype not in KERNEL_DTYPES:
        raise ValueError(f"sample_tokens takes fp32, bf16 or fp16 logits, not {logits.dtype}")
    if vocab >= 2**31:
        raise ValueError(f"sample_tokens: vocabulary of {vocab} tokens does not fit int32 ids")
    if rows.settings.shape != (n, len(SETTING_FIELDS)) or rows.settings.dtype != torch.float32:
        raise ValueError(
            f"sample_tokens: settings must be float32 [{n}, {len(SETTING_FIELDS)}], "
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

    ext = _kernel_ready(logits)
    if ext is None or not hasattr(ext, "sample_tokens") or logits.stride(1) != 1:
        ids = sample_reference(logits, rows, u, pending)
        if out is None:
            return ids
        out.copy_(ids)
        return out
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
    )
    return out
