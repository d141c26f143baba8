"""``bench-kernels``: EXL3 matrix kernels vs a cuBLAS fp16 matmul of the same shape, in the same run.

For each shape (``in x out``), bits per weight and batch size it reports the median time of the
EXL3 layer (rotate input, decode + multiply, rotate output: one launch at batch <= 8), the
bytes it must read (packed weight + scales + activations), the effective bandwidth, the same for
``x @ W.T`` with an fp16 ``W`` through torch/cuBLAS, and the speed ratio. Timing uses CUDA events
around CUDA-graph replays of many calls (so launch gaps are not counted), on random tiles and
random activations, rotating through several weight copies so the L2 (60 MB on an H200) does
not hold the weight between calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from engine.bench import help_for
from engine.commands.common import run_alone
from engine.exl3.codebooks import CODEBOOKS

LLAMA8B_SHAPES = ["4096x4096", "4096x14336", "14336x4096", "4096x1024"]
# Projections of one input (in features, out features per matrix): separate launches vs one
# multi-matrix launch (kernels.gemv.exl3_gemv_multi).
LLAMA8B_GROUPS = {"q/k/v": (4096, [4096, 1024, 1024]), "gate/up": (4096, [14336, 14336])}
# The decoder's other two GEMVs, timed as launches of one matrix when --multi-sweep is given (the
# split sweep then covers every GEMV of a Llama-8B layer).
LLAMA8B_SINGLES = {"o": (4096, [4096]), "down": (14336, [4096])}


def register(sub) -> None:
    p = sub.add_parser("bench-kernels", help=help_for("bench-kernels"))
    p.add_argument(
        "--shapes", default=",".join(LLAMA8B_SHAPES), help="comma-separated IN x OUT (EXL3 orientation)"
    )
    p.add_argument("--bits", default="2,3,4,5,6,8", help="comma-separated K values")
    p.add_argument("--batch", default="1,8", help="comma-separated row counts")
    p.add_argument("--codebook", default="mcg", choices=CODEBOOKS)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--iters", type=int, default=50, help="calls per timed graph replay")
    p.add_argument("--repeats", type=int, default=7, help="timed replays (median reported)")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.add_argument(
        "--multi",
        default="on",
        choices=["on", "off", "only"],
        help="also time the Llama-8B q/k/v and gate/up groups: separate launches vs one multi launch",
    )
    p.add_argument(
        "--multi-sweep",
        default="",
        help="comma-separated split counts to also time the multi launch with (e.g. 2,3,4,6,8): "
        "checks the launch's own split choice",
    )
    p.add_argument(
        "--gemv-ab",
        action="store_true",
        help="only A/B the workspace split-K GEMV (ext/exl3_gemv.cuh, the pre-sm_90 one) vs the cluster "
        "split-K GEMV (ext/exl3_gemv_cluster.cuh) in this process: every --shapes/--bits/--batch "
        "(<= 8 rows) as single launches, and the q/k/v, gate/up multi launches",
    )
    p.add_argument(
        "--weight-ab",
        action="store_true",
        help="only time the whole-weight kernel of the prefill path (ext/exl3_weight.cu) for every "
        "--shapes/--bits in --dtype",
    )
    p.set_defaults(func=run)


def _parse_shape(text: str) -> tuple[int, int]:
    a, b = text.lower().split("x")
    return int(a), int(b)


def _time_graph(fn, iters: int, repeats: int) -> float:
    """Median seconds per call of ``fn`` (captured ``iters`` times in one CUDA graph)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # warm-up outside the graph (workspaces, cuBLAS handles)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times)


def bench_one(
    in_f: int, out_f: int, k: int, m: int, codebook: str, dtype, iters: int, repeats: int, copy_bw: float
) -> dict:
    import types

    import torch

    from engine.kernels import gemv

    dev = torch.device("cuda")
    w_bytes = in_f * out_f * k // 8
    # Enough copies that one pass over them exceeds the L2 several times.
    copies = max(2, min(128, (512 << 20) // max(w_bytes, 1)))
    gen = torch.Generator(device=dev).manual_seed(0)
    layers = []
    for _ in range(copies):
        t = torch.randint(
            -(2**15), 2**15, (in_f // 16, out_f // 16, 16 * k), dtype=torch.int16, device=dev, generator=gen
        )
        suh = (torch.rand(in_f, device=dev, generator=gen) + 0.5).half()
        svh = (torch.rand(out_f, device=dev, generator=gen) + 0.5).half()
        layers.append((t, suh, svh))
    x = torch.randn(m, in_f, device=dev, dtype=dtype, generator=gen)
    state = {"i": 0}

    def ours():
        """The GEMV in 8-row launches."""
        t, suh, svh = layers[state["i"] % copies]
        state["i"] += 1
        parts = [
            gemv.exl3_gemv(x[i : i + gemv.GEMV_ROWS], t, suh, svh, codebook)
            for i in range(0, m, gemv.GEMV_ROWS)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def whole_weight():
        """The prefill path above GEMV_MAX_ROWS rows: the whole weight, one GEMM."""
        t, suh, svh = layers[state["i"] % copies]
        state["i"] += 1
        layer = types.SimpleNamespace(
            trellis=t, suh=suh, svh=svh, codebook=codebook, padded_in=in_f, padded_out=out_f
        )
        return x @ gemv.exl3_weight([layer], dtype)

    # The graph bakes in the layer each captured call used: capture cycles through the copies.
    t_weight = _time_graph(whole_weight, iters, repeats) if m > gemv.GEMV_MAX_ROWS else None
    t_ours = _time_graph(ours, iters, repeats)

    w16 = [
        torch.randn(out_f, in_f, device=dev, dtype=dtype, generator=gen)
        for _ in range(max(2, min(8, (256 << 20) // (2 * in_f * out_f))))
    ]
    state16 = {"i": 0}

    def cublas():
        w = w16[state16["i"] % len(w16)]
        state16["i"] += 1
        return x @ w.t()

    t_ref = _time_graph(cublas, iters, repeats)
    act_bytes = m * (in_f + out_f) * x.element_size()
    ours_bytes = w_bytes + 2 * (in_f + out_f) + act_bytes
    ref_bytes = 2 * in_f * out_f + act_bytes
    return {
        "shape": f"{in_f}x{out_f}",
        "bits": k,
        "batch": m,
        "codebook": codebook,
        "us": t_ours * 1e6,
        "weight_us": None if t_weight is None else t_weight * 1e6,
        "GBps": ours_bytes / t_ours / 1e9,
        "roofline_us": ours_bytes / copy_bw * 1e6,
        "cublas_us": t_ref * 1e6,
        "cublas_GBps": ref_bytes / t_ref / 1e9,
        "speedup": t_ref / t_ours,
        "weights_per_ns": in_f * out_f / t_ours / 1e9,
    }


def bench_group(
    name: str,
    in_f: int,
    outs: list[int],
    k: int,
    m: int,
    codebook: str,
    dtype,
    iters: int,
    repeats: int,
    sweep: tuple[int, ...] = (),
) -> dict:
    """One projection group: one GEMV launch per matrix vs one multi-matrix launch."""
    import torch

    from engine import kernels
    from engine.kernels import gemv

    dev = torch.device("cuda")
    w_bytes = in_f * sum(outs) * k // 8
    copies = max(2, min(64, (512 << 20) // max(w_bytes, 1)))
    gen = torch.Generator(device=dev).manual_seed(0)
    groups = _random_mats(in_f, outs, k, copies, gen)
    x = torch.randn(m, in_f, device=dev, dtype=dtype, generator=gen)
    state = {"i": 0}

    def separate():
        mats = groups[state["i"] % copies]
        state["i"] += 1
        return [gemv.exl3_gemv(x, t, suh, svh, codebook) for t, suh, svh in mats]

    def multi(splits: int = 0):
        mats = groups[state["i"] % copies]
        state["i"] += 1
        ts, suhs, svhs = zip(*mats)
        return gemv.exl3_gemv_multi(x, list(ts), list(suhs), list(svhs), codebook, splits=splits)

    # Same answer either way (different split counts: fp32 sum order only). Both calls must read
    # the same copy of the matrices: each call advances to the next copy.
    reference = separate()
    state["i"] -= 1
    for a, b in zip(reference, multi()):
        err = float((a.double() - b.double()).norm() / b.double().norm())
        if err > 2e-3:
            raise RuntimeError(f"multi GEMV differs from separate launches ({name}, K={k}, m={m}): {err:.2e}")
    t_sep = _time_graph(separate, iters, repeats)
    t_multi = _time_graph(multi, iters, repeats)
    n_chunks = in_f // 128
    swept = {
        sp: _time_graph(lambda sp=sp: multi(sp), iters, repeats) * 1e6
        for sp in sweep
        if -(-n_chunks // 16) <= sp <= n_chunks
    }
    return {
        "group": name,
        "shape": f"{in_f}x{'+'.join(map(str, outs))}",
        "bits": k,
        "batch": m,
        "codebook": codebook,
        "separate_us": t_sep * 1e6,
        "multi_us": t_multi * 1e6,
        "multi_splits": (  # the tuner's split count for the multi launch (cluster GEMV only)
            gemv._cluster_splits(
                kernels.extension(), x, [t for t, _, _ in groups[0]], codebook, gemv._int8(codebook, None, m)
            )
            if gemv._use_cluster(kernels.extension(), x, None)
            else None
        ),
        "gain": t_sep / t_multi,
        "multi_us_by_splits": swept,
    }


def _random_mats(in_f: int, outs: list[int], k: int, copies: int, gen) -> list[list[tuple]]:
    import torch

    dev = gen.device
    i16 = torch.int16
    return [
        [
            (
                torch.randint(
                    -(2**15), 2**15, (in_f // 16, o // 16, 16 * k), dtype=i16, device=dev, generator=gen
                ),
                (torch.rand(in_f, device=dev, generator=gen) + 0.5).half(),
                (torch.rand(o, device=dev, generator=gen) + 0.5).half(),
            )
            for o in outs
        ]
        for _ in range(copies)
    ]


def bench_ab(
    in_f: int, outs: list[int], k: int, m: int, codebook: str, dtype, iters: int, repeats: int
) -> dict:
    """The workspace split-K GEMV vs the cluster split-K GEMV on the same weights in one process:
    one matrix as a single launch, two or three (one input) as one multi launch each. Also the
    cluster GEMV's split count and the two kernels' difference."""
    import torch

    from engine import kernels
    from engine.kernels import gemv

    dev = torch.device("cuda")
    w_bytes = in_f * sum(outs) * k // 8
    copies = max(2, min(128, (512 << 20) // max(w_bytes, 1)))
    gen = torch.Generator(device=dev).manual_seed(0)
    groups = _random_mats(in_f, outs, k, copies, gen)
    x = torch.randn(m, in_f, device=dev, dtype=dtype, generator=gen)
    state = {"i": 0}

    def call(cluster: bool):
        mats = groups[state["i"] % copies]
        state["i"] += 1
        if len(mats) == 1:
            t, suh, svh = mats[0]
            return [gemv.exl3_gemv(x, t, suh, svh, codebook, cluster=cluster)]
        ts, suhs, svhs = zip(*mats)
        return gemv.exl3_gemv_multi(x, list(ts), list(suhs), list(svhs), codebook, cluster=cluster)

    old = call(False)
    state["i"] -= 1
    new = call(True)
    err = max(float((a.double() - b.double()).norm() / a.double().norm()) for a, b in zip(old, new))
    ts, suhs, svhs = zip(*groups[0])
    ys = [torch.empty(m, o, device=dev, dtype=dtype) for o in outs]
    int8 = gemv._int8(codebook, None, m)
    splits = gemv._cluster_launch(kernels.extension(), x, ts, suhs, svhs, ys, codebook, 0, int8)
    t_ws = _time_graph(lambda: call(False), iters, repeats)
    t_cl = _time_graph(lambda: call(True), iters, repeats)
    with kernels.chained_launches(dev):  # chained: each GEMV's prologue overlaps the previous one
        t_clp = _time_graph(lambda: call(True), iters, repeats)
    return {
        "shape": f"{in_f}x{'+'.join(map(str, outs))}",
        "bits": k,
        "batch": m,
        "codebook": codebook,
        "workspace_us": t_ws * 1e6,
        "cluster_us": t_cl * 1e6,
        "cluster_pdl_us": t_clp * 1e6,
        "gain": t_ws / t_cl,
        "cluster_splits": int(splits),
        "cluster_vs_workspace_rel": err,
    }


def run_gemv_ab(args: argparse.Namespace, dtype) -> list[dict]:
    from engine.kernels import gemv

    print(
        f"{'shape':>20} {'K':>2} {'m':>2} {'wksp us':>8} {'clus us':>8} {'gain':>6} {'S':>3} {'diff rel':>9} "
        f"{'clus+PDL':>9}"
    )
    cases = [(s, [o]) for s, o in (_parse_shape(t) for t in args.shapes.split(","))]
    cases += list(LLAMA8B_GROUPS.values())
    rows = []
    for in_f, outs in cases:
        for m in (int(b) for b in args.batch.split(",") if int(b) <= gemv.GEMV_ROWS):
            for k in (int(b) for b in args.bits.split(",")):
                r = bench_ab(in_f, outs, k, m, args.codebook, dtype, args.iters, args.repeats)
                rows.append(r)
                print(
                    f"{r['shape']:>20} {k:>2} {m:>2} {r['workspace_us']:8.2f} {r['cluster_us']:8.2f} "
                    f"{r['gain']:6.2f} {r['cluster_splits']:>3} {r['cluster_vs_workspace_rel']:9.1e} "
                    f"{r['cluster_pdl_us']:9.2f}",
                    flush=True,
                )
    return rows


def bench_weight(in_f: int, out_f: int, k: int, codebook: str, dtype, iters: int, repeats: int) -> dict:
    """The whole-weight kernel (``kernels.gemv.exl3_weight``) on random layers."""
    import types

    import torch

    from engine.kernels import gemv

    dev = torch.device("cuda")
    copies = max(2, min(64, (512 << 20) // max(in_f * out_f * k // 8, 1)))
    gen = torch.Generator(device=dev).manual_seed(0)
    layers = [
        types.SimpleNamespace(
            trellis=t, suh=suh, svh=svh, codebook=codebook, padded_in=in_f, padded_out=out_f
        )
        for ((t, suh, svh),) in _random_mats(in_f, [out_f], k, copies, gen)
    ]
    state = {"i": 0}

    def call():
        layer = layers[state["i"] % copies]
        state["i"] += 1
        return gemv.exl3_weight([layer], dtype)

    t = _time_graph(call, iters, repeats)
    n = in_f * out_f
    return {
        "shape": f"{in_f}x{out_f}",
        "bits": k,
        "codebook": codebook,
        "dtype": str(dtype).replace("torch.", ""),
        "us": t * 1e6,
        "gweights_per_s": n / t / 1e9,
        "GBps": n * (dtype.itemsize + k / 8) / t / 1e9,
    }


def run_weight(args: argparse.Namespace, dtype) -> list[dict]:
    print(f"{'shape':>12} {'K':>2} {'us':>9} {'Gw/s':>7} {'GB/s':>7}")
    rows = []
    for in_f, out_f in (_parse_shape(t) for t in args.shapes.split(",")):
        for k in (int(b) for b in args.bits.split(",")):
            r = bench_weight(in_f, out_f, k, args.codebook, dtype, args.iters, args.repeats)
            rows.append(r)
            print(
                f"{r['shape']:>12} {k:>2} {r['us']:9.1f} {r['gweights_per_s']:7.0f} {r['GBps']:7.0f}",
                flush=True,
            )
    return rows


def copy_bandwidth() -> float:
    """Measured device-to-device copy bandwidth (bytes read + written per second)."""
    import torch

    from engine.bench.timing import copy_bandwidth as measure

    return measure(torch.device("cuda"))  # shared with ``bench`` so both rooflines agree


def launch_floor() -> float:
    """Seconds per call of the smallest kernel (an RMSNorm of one 128-number row) replayed in a
    graph."""
    import torch

    from engine.kernels import fused

    x = torch.randn(1, 128, device="cuda", dtype=torch.float16)
    w = torch.ones(128, device="cuda", dtype=torch.float16)
    return _time_graph(lambda: fused.rms_norm(x, w, 1e-6, 0.0), 200, 7)


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench-kernels: needs a CUDA GPU", file=sys.stderr)
        return 1
    from engine import kernels
    from engine.kernels import gemv

    args.options.configure_kernels()
    if kernels.extension() is None:
        print(f"bench-kernels: CUDA extension unavailable: {kernels.status()['reason']}", file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    if args.weight_ab:
        print(
            f"device: {torch.cuda.get_device_name()}, codebook {args.codebook}, {args.dtype}, "
            "whole-weight kernel"
        )
        w_rows = run_weight(args, dtype)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "weight": w_rows}, f, indent=1)
        return 0
    if args.gemv_ab:
        print(
            f"device: {torch.cuda.get_device_name()}, codebook {args.codebook}, "
            "workspace vs cluster split-K GEMV"
        )
        ab_rows = run_gemv_ab(args, dtype)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "gemv_ab": ab_rows}, f, indent=1)
        return 0
    bw = copy_bandwidth()
    floor = launch_floor()
    print(
        f"device: {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:.0f} GB/s, "
        f"smallest kernel in a graph {floor * 1e6:.2f} us, codebook {args.codebook}"
    )
    rows = []
    header = (
        f"{'shape':>11} {'K':>2} {'m':>3} {'W+GEMM us':>9} {'us':>8} {'GB/s':>7} {'roof us':>8} "
        f"{'cuBLAS us':>9} {'GB/s':>7} {'x cuBLAS':>8}"
    )
    print(header)
    print("  (us: the GEMV in 8-row launches; W+GEMM us: the prefill path above 8 rows)")
    for shape in args.shapes.split(",") if args.multi != "only" else []:
        in_f, out_f = _parse_shape(shape)
        for m in (int(b) for b in args.batch.split(",")):
            for k in (int(b) for b in args.bits.split(",")):
                r = bench_one(in_f, out_f, k, m, args.codebook, dtype, args.iters, args.repeats, bw)
                rows.append(r)
                weight = "-" if r["weight_us"] is None else f"{r['weight_us']:.2f}"
                print(
                    f"{r['shape']:>11} {k:>2} {m:>3} {weight:>9} {r['us']:8.2f} {r['GBps']:7.0f} "
                    f"{r['roofline_us']:8.2f} "
                    f"{r['cublas_us']:9.2f} {r['cublas_GBps']:7.0f} {r['speedup']:8.2f}",
                    flush=True,
                )
    group_rows = []
    sweep = tuple(int(v) for v in args.multi_sweep.split(",") if v.strip())
    if args.multi != "off":
        print(
            f"\n{'group':>8} {'shape':>18} {'K':>2} {'m':>3} {'separate us':>11} {'multi us':>9} {'gain':>6}"
        )
        groups = {**LLAMA8B_GROUPS, **(LLAMA8B_SINGLES if sweep else {})}
        for name, (in_f, outs) in groups.items():
            for m in (int(b) for b in args.batch.split(",") if int(b) <= gemv.GEMV_ROWS):
                for k in (int(b) for b in args.bits.split(",")):
                    r = bench_group(
                        name, in_f, outs, k, m, args.codebook, dtype, args.iters, args.repeats, sweep
                    )
                    group_rows.append(r)
                    by_splits = "  ".join(f"s{sp}: {us:.2f}" for sp, us in r["multi_us_by_splits"].items())
                    print(
                        f"{name:>8} {r['shape']:>18} {k:>2} {m:>3} {r['separate_us']:11.2f} "
                        f"{r['multi_us']:9.2f} {r['gain']:6.2f}  tuned s{r['multi_splits'] or '-'}  "
                        f"{by_splits}",
                        flush=True,
                    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "copy_GBps": bw / 1e9,
                    "rows": rows,
                    "groups": group_rows,
                },
                f,
                indent=1,
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_alone(register, "bench-kernels", argv)


if __name__ == "__main__":
    raise SystemExit(main())
