"""EXL3 codebooks: the map from a 16-bit trellis state to an fp16 weight value.

Three codebooks exist (docs/EXL3_FORMAT.md section 6.2): 3INST (no flag tensor), MCG (flag ``mcg``)
and MUL1 (flag ``mul1``). Each is an exact integer/fp16 function of the state, so the whole
codebook is a 65 536-entry fp16 table; decoding a state is one gather. Tables are computed once
per process (vectorised, on the CPU) and cached per device.

Bit-exactness matters here: the reference implementation's kernels compute these values with
specific fp16 roundings, and a decoder that rounds differently (e.g. MUL1 via the tempting
``(b - 510) / 147.7``) is measurably off (fixtures README section 3).
"""

from __future__ import annotations

from functools import cache, lru_cache

import torch

# Codebook names as they appear in quantization_config["codebook"].
INST3 = "3inst"
MCG = "mcg"
MUL1 = "mul1"
CODEBOOKS: tuple[str, ...] = (INST3, MCG, MUL1)

# Multipliers and constants of section 6.2. The MCG/MUL1 multipliers are fixed since ExLlamaV3
# v0.0.9 (section 8); the value stored in the flag tensor is informational.
INST3_MULT = 89226354
INST3_ADD = 64248484
MCG_MULT = 0xCBAC1FED
MUL1_MULT = 0x83DCD12D
_MASK = 0x8FFF8FFF
_XOR = 0x3B603B60
_MUL1_K_INV_BITS = 0x1EEE  # fp16 0.00676727294921875
_MUL1_K_BIAS_BITS = 0xC931  # fp16 -10.3828125

# The int32 values written into the flag tensors (the multipliers reinterpreted as int32).
FLAG_VALUES: dict[str, int] = {MCG: MCG_MULT - (1 << 32), MUL1: MUL1_MULT - (1 << 32)}

_U32 = 0xFFFFFFFF


def bits_to_fp16(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret integers holding 16-bit patterns (0..65535, any int dtype) as fp16 values."""
    b = bits.to(torch.int32) & 0xFFFF
    # int16 is signed: fold 32768..65535 down so the cast keeps the bit pattern.
    b = torch.where(b >= 0x8000, b - 0x10000, b)
    return b.to(torch.int16).view(torch.float16)


def fp16_to_bits(x: torch.Tensor) -> torch.Tensor:
    """The fp16 bit patterns of ``x`` as int32 values 0..65535 (for bit-exact comparisons)."""
    return x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF


def round_to_fp16(v: torch.Tensor) -> torch.Tensor:
    """Round float64 values to fp16 with one round-to-nearest-even step.

    ``tensor.half()`` on a float64 tensor may go through float32 first (a double rounding that
    can be off by one ulp); doing the rounding in float64 on the fp16 grid avoids that. Normal
    and subnormal fp16 ranges are handled; values here never overflow.
    """
    v = v.to(torch.float64)
    _, exp = torch.frexp(v)  # v = m * 2**exp, 0.5 <= |m| < 1
    # fp16 has an 11-bit significand: ulp = 2**(exp - 11); below the normal range the ulp is
    # fixed at 2**-24 (subnormals).
    ulp_exp = torch.clamp(exp.to(torch.int64) - 11, min=-24)
    ulp = torch.pow(torch.full_like(v, 2.0), ulp_exp.to(torch.float64))
    # v / ulp is exact (power-of-two scaling); torch.round rounds half to even.
    return (torch.round(v / ulp) * ulp).to(torch.float16)


def _inst_halves_sum(x: torch.Tensor) -> torch.Tensor:
    """Shared tail of 3INST and MCG: mask/xor, split into two fp16 halves, one fp16 addition."""
    x = (x & _MASK) ^ _XOR
    lo = bits_to_fp16(x & 0xFFFF)
    hi = bits_to_fp16(x >> 16)
    # Both halves lie in +-[0.125, 2), so their float32 sum is exact; converting it to fp16
    # is then the single RN step of the fp16 addition in the reference kernel.
    return (lo.float() + hi.float()).to(torch.float16)


def decode_3inst(states: torch.Tensor) -> torch.Tensor:
    """3INST codebook (section 6.2): ``x = s*89226354 + 64248484 mod 2**32``, then halves."""
    s = states.to(torch.int64) & 0xFFFF
    # s < 2**16 and the multiplier < 2**27, so the int64 product is exact before masking.
    return _inst_halves_sum((s * INST3_MULT + INST3_ADD) & _U32)


def decode_mcg(states: torch.Tensor) -> torch.Tensor:
    """MCG codebook: like 3INST with ``x = s*0xCBAC1FED mod 2**32`` and no additive constant."""
    s = states.to(torch.int64) & 0xFFFF
    return _inst_halves_sum((s * MCG_MULT) & _U32)


@lru_cache(maxsize=1)
def _mul1_sum_table() -> torch.Tensor:
    """fp16 value of MUL1 for every byte sum b = 0..1020 (section 6.2).

    The reference computes ``fma(h, k_inv, k_bias)`` in fp16 with one rounding. In float64 the
    product and sum are exact (11-bit operands), so rounding that once to fp16 reproduces it.
    """
    k_inv = bits_to_fp16(torch.tensor(_MUL1_K_INV_BITS)).double()
    k_bias = bits_to_fp16(torch.tensor(_MUL1_K_BIAS_BITS)).double()
    h = 1024.0 + torch.arange(1021, dtype=torch.float64)
    return round_to_fp16(h * k_inv + k_bias)


def decode_mul1(states: torch.Tensor) -> torch.Tensor:
    """MUL1 codebook: byte sum of ``s*0x83DCD12D mod 2**32`` mapped through one fp16 fma."""
    s = states.to(torch.int64) & 0xFFFF
    x = (s * MUL1_MULT) & _U32
    b = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
    return _mul1_sum_table().to(states.device)[b]


_DECODERS = {INST3: decode_3inst, MCG: decode_mcg, MUL1: decode_mul1}


def check_codebook(name: str) -> str:
    """Return ``name`` normalised to lower case, or raise ValueError for an unknown codebook."""
    key = name.lower()
    if key not in _DECODERS:
        raise ValueError(f"unknown EXL3 codebook {name!r}; expected one of {', '.join(CODEBOOKS)}")
    return key


# The cached tables are made outside inference mode whatever mode their first caller runs in: a
# cache outlives that mode, and an inference tensor can neither tell its version (which
# engine.convert.viterbi reads) nor enter autograd-recorded code.
@cache
def _cpu_table(name: str) -> torch.Tensor:
    with torch.inference_mode(False):
        return _DECODERS[name](torch.arange(65536, dtype=torch.int64))


@cache
def _device_table(name: str, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):
        return _cpu_table(name).to(device)


def codebook_table(name: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """The full fp16 table ``(65536,)`` of codebook ``name``: entry ``s`` = value of state ``s``.

    Cached per (codebook, device); treat the result as read-only.
    """
    return _device_table(check_codebook(name), torch.device(device))


def decode_states(states: torch.Tensor, codebook: str) -> torch.Tensor:
    """Decode 16-bit states (any int dtype, any shape, values read as uint16) to fp16 values."""
    table = codebook_table(codebook, states.device)
    return table[states.to(torch.int64) & 0xFFFF]


def codebook_from_flags(has_mcg: bool, has_mul1: bool) -> str:
    """Choose the codebook from the flag tensors present (section 3.1): mcg, else mul1, else 3INST."""
    if has_mcg and has_mul1:
        # ExLlamaV3 refuses this combination; so do we (a corrupted or hand-edited file).
        raise ValueError("both 'mcg' and 'mul1' flag tensors are present; a linear has one codebook")
    if has_mcg:
        return MCG
    if has_mul1:
        return MUL1
    return INST3
