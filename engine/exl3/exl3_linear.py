"""``EXL3Linear``: an ``nn.Linear``-equivalent layer backed by the stored EXL3 tensors.

Two modes, same function (``y = x @ W.T + bias`` with ``W`` in HF orientation ``(out, in)``):

- ``"dense"``: reconstruct ``W`` once at load and keep it (the CPU reference path; fastest on
  CPU, but costs ``in*out`` floats of memory).
- ``"streaming"``: keep only the packed trellis (K bits/weight) and the scales; every call
  rotates the input, decodes ``Q`` in blocks of input rows and accumulates, then rotates the
  output. This is docs/EXL3_FORMAT.md section 4's order of operations, and bounds the temporary
  memory to one row block.

Padding (section 3.3): stored tensors may be larger than the layer (``in``/``out`` rounded up
to 128). ``in_features``/``out_features`` are the layer's true sizes; narrower inputs are
zero-extended (padded input rows only ever meet zeros) and outputs are trimmed.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engine import kernels
from engine.exl3.codebooks import codebook_from_flags
from engine.exl3.errors import MissingTensorError, TensorShapeError
from engine.exl3.hadamard import HADAMARD_SIZE, blockwise_hadamard
from engine.exl3.reconstruct import apply_scales, decode_trellis, expand_sign_bits
from engine.exl3.trellis import MAX_BITS, TILE

MODES = ("dense", "streaming")

# Streaming decodes this many weights per block (~2^22 fp16 values + int32 states: ~25 MB).
_STREAM_BLOCK_WEIGHTS = 1 << 22


def _short_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accept both ``{"trellis": ...}`` and ``{"model.layers.0.q_proj.trellis": ...}`` keys."""
    return {name.rsplit(".", 1)[-1]: t for name, t in tensors.items()}


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class EXL3Linear(nn.Module):
    """A linear layer whose weight is an EXL3 trellis (see module docstring for the modes)."""

    def __init__(
        self,
        trellis: torch.Tensor,
        suh: torch.Tensor,
        svh: torch.Tensor,
        codebook: str,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
        mode: str = "dense",
        dtype: torch.dtype = torch.float32,
        name: str = "",
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"EXL3Linear mode must be one of {MODES}, got {mode!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.codebook = codebook
        self.mode = mode
        self.name = name
        self.padded_in = trellis.shape[0] * TILE
        self.padded_out = trellis.shape[1] * TILE
        self.bits = trellis.shape[2] // TILE
        if bias is not None:
            self.register_buffer("bias", bias[:out_features].to(dtype).contiguous())
        else:
            self.register_buffer("bias", None)
        if mode == "dense":
            self.register_buffer("weight", self._reconstruct_from(trellis, suh, svh).to(dtype).contiguous())
        else:
            self.register_buffer("trellis", trellis.contiguous())
            self.register_buffer("suh", suh.to(torch.float16).contiguous())
            self.register_buffer("svh", svh.to(torch.float16).contiguous())

    @property
    def key(self) -> str:
        """The checkpoint key (``name``), as every linear of the module library has it."""
        return self.name

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor],
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None,
        mode: str = "dense",
        dtype: torch.dtype = torch.float32,
        name: str = "",
    ) -> EXL3Linear:
        """Build from the stored tensors of one linear (section 3.1/3.2), validating shapes.

        ``tensors`` holds ``trellis``, ``suh`` (or legacy ``su``), ``svh`` (or ``sv``) and the
        optional ``mcg``/``mul1`` flag and ``bias`` (full or short names). ``bias`` overrides a
        stored bias. ``dtype`` is the dense weight's dtype (dense mode) and the bias dtype.
        ``name`` (the module key) only serves error messages.
        """
        t = _short_names(tensors)
        where = f"EXL3 linear {name!r}" if name else "EXL3 linear"
        if "trellis" not in t:
            raise MissingTensorError(f"{where}: missing tensor 'trellis'")
        trellis = t["trellis"]
        if trellis.ndim != 3 or trellis.shape[2] % TILE or not 1 <= trellis.shape[2] // TILE <= MAX_BITS:
            raise TensorShapeError(
                f"{where}: trellis shape {list(trellis.shape)} is not (in/16, out/16, 16*K) with K in 1..8"
            )
        if trellis.dtype not in (torch.int16, torch.uint16):
            raise TensorShapeError(f"{where}: trellis dtype must be int16, got {trellis.dtype}")
        padded_in, padded_out = trellis.shape[0] * TILE, trellis.shape[1] * TILE
        if padded_in % HADAMARD_SIZE or padded_out % HADAMARD_SIZE:
            raise TensorShapeError(
                f"{where}: stored dims in={padded_in}, out={padded_out} are not multiples of {HADAMARD_SIZE}"
            )
        if not (
            padded_in == _round_up(in_features, HADAMARD_SIZE)
            and padded_out == _round_up(out_features, HADAMARD_SIZE)
        ):
            raise TensorShapeError(
                f"{where}: trellis {list(trellis.shape)} encodes a {padded_in}x{padded_out} (in x out) "
                f"weight but the layer is {in_features}x{out_features}"
            )
        suh = cls._scale_vector(t, "suh", "su", padded_in, where)
        svh = cls._scale_vector(t, "svh", "sv", padded_out, where)
        try:
            codebook = codebook_from_flags("mcg" in t, "mul1" in t)
        except ValueError as exc:
            raise TensorShapeError(f"{where}: {exc}") from exc
        if bias is None:
            bias = t.get("bias")
        if bias is not None and bias.shape not in ((out_features,), (padded_out,)):
            raise TensorShapeError(f"{where}: bias shape {list(bias.shape)} does not fit out={out_features}")
        return cls(trellis, suh, svh, codebook, in_features, out_features, bias, mode, dtype, name)

    @staticmethod
    def _scale_vector(
        t: Mapping[str, torch.Tensor], name: str, legacy: str, size: int, where: str
    ) -> torch.Tensor:
        """``suh``/``svh`` as fp16 ``(size,)``; legacy packed sign bits are expanded (section 3.2)."""
        if name in t:
            v = t[name]
            if v.shape != (size,):
                raise TensorShapeError(f"{where}: {name} has shape {list(v.shape)}, expected [{size}]")
            return v.to(torch.float16)
        if legacy in t:
            v = t[legacy]
            if v.shape != (size // 16,):
                raise TensorShapeError(
                    f"{where}: {legacy} has shape {list(v.shape)}, expected [{size // 16}]"
                )
            return expand_sign_bits(v)
        raise MissingTensorError(f"{where}: missing tensor '{name}' (or legacy '{legacy}')")

    # -- weights ----------------------------------------------------------------------------

    def _reconstruct_from(self, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
        q = decode_trellis(trellis, self.codebook)
        w = apply_scales(q, suh, svh, torch.float32)  # (in, out)
        return w[: self.in_features, : self.out_features].t()

    def reconstruct(self) -> torch.Tensor:
        """The weight in HF orientation ``(out_features, in_features)``, float32."""
        if self.mode == "dense":
            return self.weight.float()
        return self._reconstruct_from(self.trellis, self.suh, self.svh)

    def inner_weight(self) -> torch.Tensor:
        """The decoded ``Q`` ``(padded_in, padded_out)`` fp16 (streaming mode only keeps the trellis)."""
        if self.mode == "dense":
            raise RuntimeError("inner_weight() needs the packed trellis, which dense mode drops")
        return decode_trellis(self.trellis, self.codebook)

    # -- forward ----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "dense":
            w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
            b = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
            return F.linear(x, w, b)
        y = kernels.gemv.exl3_gemm(x, self)  # CUDA kernels where they apply, else None
        return y if y is not None else self._forward_streaming(x)

    def _forward_streaming(self, x: torch.Tensor) -> torch.Tensor:
        # Section 4 order: u = (x * suh) H_in; v = u Q; y = (v H_out) * svh. float32 throughout
        # (fp16 Q, suh, svh are exact in it), so the result is within fp32 rounding of exact.
        lead = x.shape[:-1]
        u = x.reshape(-1, x.shape[-1]).float()
        if u.shape[1] < self.padded_in:
            u = F.pad(u, (0, self.padded_in - u.shape[1]))
        u = blockwise_hadamard(u * self.suh.float(), dim=1)
        v = torch.zeros(u.shape[0], self.padded_out, dtype=torch.float32, device=x.device)
        tiles_per_block = max(1, _STREAM_BLOCK_WEIGHTS // (TILE * TILE * self.trellis.shape[1]))
        for a0 in range(0, self.trellis.shape[0], tiles_per_block):
            a1 = min(a0 + tiles_per_block, self.trellis.shape[0])
            q = decode_trellis(self.trellis[a0:a1], self.codebook).float()
            v.addmm_(u[:, a0 * TILE : a1 * TILE], q)
        y = blockwise_hadamard(v, dim=1) * self.svh.float()
        y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"codebook={self.codebook}, mode={self.mode}, bias={self.bias is not None}"
        )
