"""The converter's tail-biting Viterbi encoder on the GPU (``ext/viterbi.cu``)."""

from __future__ import annotations

import torch

from engine.kernels import loader
from engine.kernels.loader import CODEBOOK_IDS

# Back-pointer workspace per call (tiles run in chunks that fit it).
VITERBI_WORKSPACE_BYTES = 1 << 30


def viterbi_encode(x: torch.Tensor, k: int, codebook: str) -> torch.Tensor | None:
    """Tail-biting Viterbi states ``(N, 256)`` int32 for tiles ``x`` ``(N, 256)`` at ``k`` bits in
    ``codebook`` (the kernel computes the codebook's values arithmetically), the same results as
    ``engine.convert.viterbi.encode_tiles_batch`` (same float operations and first-index tie rule).
    None where the kernel does not apply (CPU tensors, no extension, an unknown codebook): the
    caller then runs that torch path."""
    if x.ndim != 2 or x.shape[1] != 256 or not 1 <= k <= 8 or codebook not in CODEBOOK_IDS:
        return None
    ext = loader.kernel_ready(x)
    if ext is None or not hasattr(ext, "viterbi_encode"):
        return None
    return ext.viterbi_encode(x.float().contiguous(), k, CODEBOOK_IDS[codebook], VITERBI_WORKSPACE_BYTES)
