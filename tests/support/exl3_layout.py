"""A tiny model rewritten in ExLlamaV3's EXL3 layout, for the tests that load a family's
quantized checkpoints: the linears a test names (the keys ExLlamaV3's architecture file for the
family quantizes) become EXL3 tensors with random trellis codes (``{key}.trellis`` int16
``(in/16, out/16, 16 K)``, ``{key}.suh`` / ``{key}.svh`` fp16 sign vectors, the ``mul1`` codebook
flag; docs/EXL3_FORMAT.md section 3), everything else is copied as fp16, and config.json gets the
``quantization_config`` ExLlamaV3 writes. Which keys become EXL3 is the test's list, not the
engine's: a loader that looks for a family's linears under other names fails."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TILE, HADAMARD = 16, 128
MUL1_FLAG = -2082680531


def _padded(n: int) -> int:
    return -(-n // HADAMARD) * HADAMARD


def exl3_linear(
    in_features: int, out_features: int, bits: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """One linear's EXL3 tensors (without the key prefix), random codes at ``bits``."""
    n_in, n_out = _padded(in_features), _padded(out_features)
    trellis = torch.randint(-(1 << 15), 1 << 15, (n_in // TILE, n_out // TILE, TILE * bits), generator=gen)

    def signs(size: int, used: int) -> torch.Tensor:
        s = torch.randint(0, 2, (size,), generator=gen).to(torch.float16) * 2 - 1
        s[used:] = 0  # padded channels carry no weight
        return s

    return {
        "trellis": trellis.to(torch.int16),
        "suh": signs(n_in, in_features) / math.sqrt(in_features),
        "svh": signs(n_out, out_features),
        "mul1": torch.tensor(MUL1_FLAG, dtype=torch.int32),
    }


def write_exl3_model(
    src: Path,
    dst: Path,
    linears: dict[str, tuple[int, int]],
    bits: int = 4,
    drop: tuple[str, ...] = (),
    seed: int = 0,
) -> None:
    """Rewrite the dense checkpoint ``src`` into ``dst``: each key of ``linears`` (``key ->
    (in_features, out_features)``) becomes EXL3 tensors at ``bits``, replacing ``key.weight``
    (a ``key.bias`` stays, fp16); source keys starting with any of ``drop`` (fused tensors the
    layout stores split, one linear per expert) are left out; the rest is copied as fp16."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    out = {
        k: v.to(torch.float16) if v.is_floating_point() else v
        for k, v in tensors.items()
        if not k.startswith(drop) and k.removesuffix(".weight") not in linears
    }
    for key, (n_in, n_out) in linears.items():
        out.update({f"{key}.{name}": t for name, t in exl3_linear(n_in, n_out, bits, gen).items()})
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "exl3",
        "version": "0.0.4",
        "bits": float(bits),
        "head_bits": bits,
        "calibration": {"rows": 100, "cols": 2048},
        "out_scales": "auto",
        "codebook": "mul1",
    }
    (dst / "config.json").write_text(json.dumps(config, indent=4))
