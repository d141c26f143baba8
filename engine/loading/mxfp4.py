"""MXFP4 tensors as gpt-oss checkpoints store them, dequantized when read.

The OCP microscaling format: weights in blocks of 32 along the input dimension, each weight a
4-bit float (E2M1: sign, two exponent bits, one mantissa bit, values 0 0.5 1 1.5 2 3 4 6) and
each block one shared power-of-two scale (E8M0: ``2 ** (byte - 127)``).

A quantized tensor ``name`` is stored as two (``quantization_config.quant_method`` "mxfp4"):

- ``name_blocks``, uint8 ``[*lead, rows, blocks, 16]``: a block's 32 codes, two per byte, the
  first in the low nibble;
- ``name_scales``, uint8 ``[*lead, rows, blocks]``: the blocks' exponents.

``rows`` are the output features and ``blocks * 32`` the input ones. transformers keeps gpt-oss's
experts as ``[experts, in, out]`` (``gate_up_proj``, ``down_proj``), and that is what a read of
``name`` gives here: the same tensor, to the bit, that its own dequantization makes, so a
quantized checkpoint and an unquantized one look the same to the builder and the converter. Every
E2M1 value times a power of two within E8M0's range is exact in bfloat16, the dtype it is read in
unless the reader asks for another.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

BLOCKS, SCALES = "_blocks", "_scales"
CODES_PER_BYTE = 2  # a block: 16 bytes, 32 weights
SCALE_BIAS = 127
DTYPE = torch.bfloat16

# E2M1 by code: bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def packed_pairs(keys: Iterable[str]) -> dict[str, tuple[str, str]]:
    """``{name: (name_blocks, name_scales)}`` for every such pair among ``keys``."""
    keys = set(keys)
    pairs = {}
    for key in keys:
        if key.endswith(BLOCKS):
            name = key[: -len(BLOCKS)]
            if name + SCALES in keys:
                pairs[name] = (key, name + SCALES)
    return pairs


def dequantized_shape(blocks_shape: Iterable[int]) -> list[int]:
    """The shape a read gives for ``name_blocks`` of ``blocks_shape``: ``[*lead, in, out]``."""
    *lead, rows, blocks, width = blocks_shape
    return [*lead, blocks * width * CODES_PER_BYTE, rows]


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """The weights of ``blocks`` / ``scales`` (see the module's docstring) as ``[*lead, in, out]``
    in ``dtype`` (contiguous)."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    *lead, rows, n_blocks, width = blocks.shape
    out = torch.empty(*lead, n_blocks * width * CODES_PER_BYTE, rows, dtype=dtype, device=blocks.device)
    matrices = out.view(-1, *out.shape[-2:])
    # One matrix (an expert's projection) at a time: a whole layer's float32 temporaries would
    # take gigabytes for the released models.
    for i, (b, e) in enumerate(
        zip(blocks.reshape(-1, rows, n_blocks, width), scales.reshape(-1, rows, n_blocks))
    ):
        matrices[i] = _matrix(b, e).T
    return out


def _matrix(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One ``[rows, blocks, 16]`` / ``[rows, blocks]`` pair as float32 ``[rows, blocks * 32]``."""
    rows, n_blocks, width = blocks.shape
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.uint8)
    # [..., bytes, 2]: the low nibble is the earlier weight of the pair.
    pairs = torch.stack((codes & 0x0F, codes >> 4), dim=-1).int()
    values = table[pairs].reshape(rows, n_blocks, width * CODES_PER_BYTE)
    # Exact: a power of two times an E2M1 value, in float32 and then in the output dtype alike.
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents[..., None].float()).reshape(rows, -1)
