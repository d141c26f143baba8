"""Round-trip MSE of the trellis code on unit-Gaussian data, per K and codebook.

``python -m engine.convert.mse [--tiles N] [--device cuda] [--codebook mul1 ...] [--bits 1 2 ...]``

For each K: draw ``N`` tiles of iid N(0, 1) values, encode ``a * x`` with the tail-biting Viterbi
(:mod:`engine.convert.viterbi`) for a few scales ``a``, decode, and report the best
``mean((decode / a - x)**2)`` next to the Gaussian distortion-rate bound ``2**(-2K)``. The best
scale per (K, codebook) is also what the converter uses as its starting point for the global
scale search (:data:`engine.convert.quantize.DEFAULT_SCALE`).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.convert.viterbi import encode_tiles
from engine.exl3.codebooks import CODEBOOKS, codebook_table

# Best-scale MSE per element on unit-Gaussian data, per K, MUL1 codebook (the default; the
# three codebooks are within a few per cent of each other). Measured with this command, 32 tiles
# on CPU (``--tiles 32 --codebook mul1``): 1.10x the distortion-rate bound 2**(-2K) at K=1-2
# (QTIP reports 0.069 at K=2 for its 16-bit trellis), rising to 1.38x at K=8. The sensitivity pre-pass
# (:mod:`engine.convert.sensitivity`) uses it to predict LDLQ's error and to move between K.
TRELLIS_MSE = {
    1: 0.2751,
    2: 0.06879,
    3: 0.01758,
    4: 0.004540,
    5: 0.001161,
    6: 0.0003010,
    7: 0.00008036,
    8: 0.00002106,
}


def tile_mse(x: torch.Tensor, k: int, codebook: str, scale: float) -> float:
    """MSE of quantizing tiles ``x`` ``(N, 256)`` at K bits with the codebook, at input scale ``scale``."""
    table = codebook_table(codebook, x.device)
    states = encode_tiles(x * scale, k, table)
    return float(((table[states.long()].float() / scale - x) ** 2).mean())


def best_scale_mse(
    x: torch.Tensor, k: int, codebook: str, grid: list[float] | None = None
) -> tuple[float, float]:
    """(best scale, its MSE) over ``grid`` (relative to the codebook's std), refined once around the best."""
    std = float(codebook_table(codebook).float().std())
    grid = grid or [0.6, 0.7, 0.8, 0.9, 1.0]
    results = {g: tile_mse(x, k, codebook, g * std) for g in grid}
    g0 = min(results, key=results.get)
    for g in (g0 - 0.05, g0 + 0.05):
        if g > 0:
            results[g] = tile_mse(x, k, codebook, g * std)
    g_best = min(results, key=results.get)
    return g_best * std, results[g_best]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.convert.mse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiles", type=int, default=64, help="tiles of 256 Gaussian values per K (default 64)")
    ap.add_argument("--bits", type=int, nargs="*", default=list(range(1, 9)))
    ap.add_argument("--codebook", nargs="*", default=list(CODEBOOKS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.tiles, 256, generator=gen).to(args.device)
    rows = []
    print(f"{'codebook':8} {'K':>2} {'MSE':>10} {'D(R)=2^-2K':>11} {'ratio':>6} {'scale':>6} {'s/tile':>8}")
    for cb in args.codebook:
        for k in args.bits:
            t0 = time.perf_counter()
            scale, mse = best_scale_mse(x, k, cb)
            dt = (time.perf_counter() - t0) / args.tiles
            bound = 2.0 ** (-2 * k)
            rows.append({"codebook": cb, "bits": k, "mse": mse, "bound": bound, "scale": scale})
            print(f"{cb:8} {k:>2} {mse:>10.6f} {bound:>11.6f} {mse / bound:>6.3f} {scale:>6.3f} {dt:>8.4f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"tiles": args.tiles, "device": args.device, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
