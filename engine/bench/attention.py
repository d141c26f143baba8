"""``bench-attention``: decode attention over the paged cache (dense and 2-8 bit) vs its peers, same run.

For each context, batch and cache width it reports the time of one layer's decode attention
(``kernels.attention.paged_decode_attention``: the CUDA kernel reading the paged cache
directly), the bytes that call must read (keys + values + scales of every visible position) and
the bandwidth that makes, beside its peers on the same shapes: torch SDPA on a contiguous fp16
cache (no paging, no quantization: what a plain dense decoder pays), with ``--compare-v2``
version 2 (``tensor_cores=False``) where version 3 (tensor cores: 2/4/8-bit and dense caches)
runs by default, with ``--reference`` the slow torch reference (gathers and dequantizes the
padded table, then SDPA). Also the fused quantize-and-write of one decode step's keys and
values against the torch path it replaces.

Timing: CUDA events around CUDA-graph replays of many calls, cycling through enough cache
copies that one pass reads several times the L2 (the graph bakes in which copy each call read).
Shapes default to Llama-3.1-8B (32 query heads, 8 kv heads, head_dim 128), page 64, fp16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from engine.bench import help_for
from engine.commands.common import run_alone

BIT_CONFIGS = ["16", "8", "4", "4,6", "2"]


def register(sub) -> None:
    p = sub.add_parser("bench-attention", help=help_for("bench-attention"))
    p.add_argument("--contexts", default="1024,4096,16384", help="comma-separated context lengths")
    p.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--bits", default=";".join(BIT_CONFIGS), help="';'-separated cache widths (K or K,V)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--iters", type=int, default=40, help="calls per timed graph replay")
    p.add_argument("--repeats", type=int, default=7, help="timed replays (median reported)")
    p.add_argument("--reference", action="store_true", help="also time the (slow) torch reference")
    p.add_argument("--no-reference", action="store_true", help=argparse.SUPPRESS)  # the default now
    p.add_argument(
        "--compare-v2",
        action="store_true",
        help="also time version 2 where version 3 runs (2/4/8-bit and dense caches)",
    )
    p.add_argument("--no-write", action="store_true", help="skip the fused quantize-and-write timings")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.set_defaults(func=run)


def _time(fn, iters: int, repeats: int, graph: bool = True) -> float:
    """Median seconds per call of ``fn``: ``iters`` calls captured in one CUDA graph (or eager)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        g.replay()
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph:
            g.replay()
        else:
            for _ in range(iters):
                fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times)


def _cycle(items):
    state = {"i": 0}

    def nxt():
        item = items[state["i"] % len(items)]
        state["i"] += 1
        return item

    return nxt


def bench_one(args, ctx: int, batch: int, bits: tuple[int, int], dtype) -> dict:
    import torch
    import torch.nn.functional as F

    from engine.cache.decode_attention import paged_decode_attention_reference
    from engine.cache.paged import PagedKVCache
    from engine.cache.quantized import bytes_per_token
    from engine.kernels.attention import paged_decode_attention

    dev = torch.device("cuda")
    h, kvh, d, page = args.heads, args.kv_heads, args.head_dim, args.page_size
    pages_per_seq = -(-ctx // page)
    per_token = sum(bytes_per_token(kvh, d, b) for b in bits)
    read_bytes = batch * ctx * per_token
    copies = max(1, min(64, (256 << 20) // max(read_bytes, 1)))  # a pass reads >> L2
    gen = torch.Generator(device=dev).manual_seed(ctx + batch)
    cache = PagedKVCache(copies, kvh, d, batch * pages_per_seq, page, dtype, dev, bits)
    slots = torch.arange(cache.capacity, device=dev)
    for i in range(copies):
        layer = cache.layer(i)
        for part in slots.split(1 << 16):
            shape = (len(part), kvh, d)
            k = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
            layer.write(part, k, torch.randn(shape, generator=gen, device=dev, dtype=dtype))
    order = torch.randperm(batch * pages_per_seq, generator=gen, device=dev)
    tables = order.view(batch, pages_per_seq).to(torch.int32)
    lengths = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, h, d, generator=gen, device=dev, dtype=dtype)
    scale = d**-0.5
    layers = _cycle([cache.layer(i) for i in range(copies)])

    if paged_decode_attention(q, cache.layer(0), tables, lengths, page, scale, None, None) is None:
        raise RuntimeError("the kernel does not take this case")

    def timed(tensor_cores: bool) -> float:
        return _time(
            lambda: paged_decode_attention(
                q, layers(), tables, lengths, page, scale, None, None, tensor_cores
            ),
            args.iters,
            args.repeats,
        )

    t_kernel = timed(True)
    t_v2 = timed(False) if args.compare_v2 else None
    t_ref = None
    if args.reference and not args.no_reference:
        t_ref = _time(
            lambda: paged_decode_attention_reference(q, layers(), tables, lengths, page, scale),
            max(2, args.iters // 10),
            3,
            graph=False,
        )
    # Peer: SDPA on contiguous fp16 keys/values [batch, kv_heads, ctx, d].
    dense_bytes = batch * ctx * 2 * kvh * d * 2
    dense_copies = max(1, min(16, (256 << 20) // dense_bytes))
    kv = [
        (
            torch.randn(batch, kvh, ctx, d, generator=gen, device=dev, dtype=dtype),
            torch.randn(batch, kvh, ctx, d, generator=gen, device=dev, dtype=dtype),
        )
        for _ in range(dense_copies)
    ]
    dense = _cycle(kv)
    qh = q[:, :, None, :]

    def sdpa():
        k, v = dense()
        return F.scaled_dot_product_attention(qh, k, v, scale=scale, enable_gqa=h != kvh)

    t_sdpa = _time(sdpa, args.iters, args.repeats)
    del kv, cache
    return {
        "context": ctx,
        "batch": batch,
        "bits": ",".join(str(b) for b in bits),
        "us": t_kernel * 1e6,
        "read_MB": read_bytes / 1e6,
        "GBps": read_bytes / t_kernel / 1e9,
        "reference_us": None if t_ref is None else t_ref * 1e6,
        "v2_us": None if t_v2 is None else t_v2 * 1e6,
        "sdpa_fp16_us": t_sdpa * 1e6,
        "x_sdpa": t_sdpa / t_kernel,
    }


def bench_write(args, batch: int, bits: int, dtype) -> dict:
    """One decode step's writes of one side: ``batch`` tokens into a 2-8 bit store."""
    import torch

    from engine.cache.quantized import QuantizedStore
    from engine.kernels.attention import quantized_cache_write

    dev = torch.device("cuda")
    store = QuantizedStore(1 << 16, args.kv_heads, args.head_dim, bits, dev)
    x = torch.randn(batch, args.kv_heads, args.head_dim, device=dev, dtype=dtype)
    slots = torch.randperm(1 << 16, device=dev)[:batch]

    def torch_path():
        planes, scales = store.quantize(x)
        store.codes.index_copy_(0, slots, planes)
        store.scales.index_copy_(0, slots, scales)

    t_kernel = _time(lambda: quantized_cache_write(store, slots, x), args.iters, args.repeats)
    t_torch = _time(torch_path, args.iters, args.repeats)
    return {"write_batch": batch, "bits": bits, "us": t_kernel * 1e6, "torch_us": t_torch * 1e6}


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench-attention: needs a CUDA GPU", file=sys.stderr)
        return 1
    from engine import kernels
    from engine.cache.paged import parse_cache_bits

    args.options.configure_kernels()
    if kernels.extension() is None:
        print(f"bench-attention: CUDA extension unavailable: {kernels.status()['reason']}", file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    print(
        f"device: {torch.cuda.get_device_name()}; heads {args.heads}/{args.kv_heads}, "
        f"head_dim {args.head_dim}, page {args.page_size}, {args.dtype}; times per layer call"
    )
    print(
        f"{'ctx':>6} {'B':>2} {'bits':>5} {'us':>8} {'MB':>7} {'GB/s':>6} {'ref us':>9} {'SDPA us':>8} "
        f"{'x SDPA':>6} {'x fp16':>6} {'v2 us':>8}"
    )
    rows, writes = [], []
    for ctx in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batch.split(",")):
            fp16_us = None
            for text in args.bits.split(";"):
                r = bench_one(args, ctx, batch, parse_cache_bits(text), dtype)
                if r["bits"] == "16,16":
                    fp16_us = r["us"]
                r["x_fp16_cache"] = None if fp16_us is None else fp16_us / r["us"]
                rows.append(r)
                ref = "-" if r["reference_us"] is None else f"{r['reference_us']:9.1f}"
                x16 = "-" if r["x_fp16_cache"] is None else f"{r['x_fp16_cache']:6.2f}"
                v2 = "-" if r["v2_us"] is None else f"{r['v2_us']:8.2f}"
                print(
                    f"{ctx:>6} {batch:>2} {r['bits']:>5} {r['us']:8.2f} {r['read_MB']:7.1f} {r['GBps']:6.0f} "
                    f"{ref:>9} {r['sdpa_fp16_us']:8.2f} {r['x_sdpa']:6.2f} {x16:>6} {v2:>8}",
                    flush=True,
                )
                torch.cuda.empty_cache()
    print("fused quantize-and-write (one side, one decode step):")
    for batch in [] if args.no_write else (int(b) for b in args.batch.split(",")):
        for bits in (8, 4, 2):
            w = bench_write(args, batch, bits, dtype)
            writes.append(w)
            print(f"  batch {batch:>2} bits {bits}: kernel {w['us']:.2f} us, torch {w['torch_us']:.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "writes": writes}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_alone(register, "bench-attention", argv)


if __name__ == "__main__":
    sys.exit(main())
