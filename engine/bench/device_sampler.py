"""``python -m engine bench-device-sampler``: time of a sampled step's draw where the logits are.

Three ways to turn a batch of ``[rows, vocab]`` float32 logits on the GPU into one token per
row, side by side in one run, for the app's presets and two kinds of logits (random normal: a
flat, worst-case tail; peaked: a few strong candidates, as a language model's usually are):

* ``kernel``: :func:`engine.kernels.sampling.sample_tokens` (``ext/sampling.cu``), ids read back;
* ``host``: the rows copied to the host in one transfer and each drawn by the host
  :class:`~engine.generation.sampling.Sampler` (what the generator did before);
* ``reference``: the torch reference (:mod:`engine.generation.device_sampling`) on the device.

Per row, the kernel reads the logits a few times from L2 (max, weights, ~4 radix passes per
threshold, the draw) instead of sending 4 bytes per token over PCIe and sorting on one CPU core.
Without a GPU the command times the reference and the host sampler on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import torch

from engine.bench import help_for
from engine.bench.sampler import PRESETS, example_logits
from engine.bench.timing import median_time
from engine.commands.common import run_alone

WARMUP = 5


def register(sub) -> None:
    p = sub.add_parser("bench-device-sampler", help=help_for("bench-device-sampler"))
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary size (Llama 3: 128256)")
    p.add_argument("--batch", default="1,8", help="rows per call, comma-separated")
    p.add_argument("--context", type=int, default=1000, help="context tokens the penalties look at")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.set_defaults(func=run)


def _kernel(logits: torch.Tensor, rows, u: torch.Tensor) -> list[int]:
    from engine.kernels.sampling import sample_tokens

    ids = sample_tokens(logits, rows, u)
    return (ids if ids is not None else _reference_ids(logits, rows, u)).tolist()


def _reference_ids(logits: torch.Tensor, rows, u: torch.Tensor) -> torch.Tensor:
    from engine.generation.device_sampling import sample_reference

    return sample_reference(logits, rows, u)


def _reference(logits: torch.Tensor, rows, u: torch.Tensor) -> list[int]:
    from engine.generation.device_sampling import sample_reference

    return sample_reference(logits, rows, u).tolist()


def _host(logits: torch.Tensor, samplers, context, generated) -> list[int]:
    rows = logits.cpu()
    return [s.sample(rows[i], context, generated) for i, s in enumerate(samplers)]


def run(args: argparse.Namespace) -> int:
    from engine import kernels
    from engine.generation.device_sampling import pack_rows
    from engine.generation.sampling import Sampler, SamplingSettings

    args.options.configure_kernels()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and kernels.extension() is None:
        print(f"CUDA extension unavailable: {kernels.status()['reason']}", file=sys.stderr)
        return 1
    context = list(range(0, 3 * args.context, 3))
    generated = context[-200:]
    out = []
    print(f"device sampler, {args.vocab}-token vocabulary, {args.context} context tokens, on {device}")
    print(f"{'logits':<8} {'settings':<16} {'rows':>4} {'kernel ms':>9} {'host ms':>8} {'reference ms':>12}")
    for kind, row in example_logits(args.vocab).items():
        for name, kw in PRESETS.items():
            for batch in (int(b) for b in args.batch.split(",")):
                settings = [SamplingSettings(seed=r, **kw) for r in range(batch)]
                logits = row.expand(batch, -1).contiguous().to(device)
                samplers = [Sampler(s) for s in settings]
                ids = samplers[0].context_ids(context)
                rows = pack_rows(settings, [ids] * batch, [generated] * batch).to(device)
                u = torch.rand(batch, generator=torch.Generator().manual_seed(0)).to(device)
                kernel = None
                if device.type == "cuda":
                    kernel_call = partial(_kernel, logits, rows, u)
                    kernel = median_time(kernel_call, args.repeats, device, WARMUP) * 1e3
                host_call = partial(_host, logits, samplers, context, generated)
                host = median_time(host_call, args.repeats, device, WARMUP) * 1e3
                ref_call = partial(_reference, logits, rows, u)
                ref = median_time(ref_call, args.repeats, device, WARMUP) * 1e3
                out.append(
                    {
                        "logits": kind,
                        "settings": name,
                        "rows": batch,
                        "kernel_ms": kernel,
                        "host_ms": host,
                        "reference_ms": ref,
                    }
                )
                shown = f"{kernel:9.3f}" if kernel is not None else f"{'-':>9}"
                print(f"{kind:<8} {name:<16} {batch:>4} {shown} {host:8.3f} {ref:12.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vocab": args.vocab, "device": str(device), "rows": out}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_alone(register, "bench-device-sampler", argv)


if __name__ == "__main__":
    sys.exit(main())
