"""``python -m engine bench-sampler``: time per token of the host-side sampler (CPU).

Every sampled (non-greedy) token goes through :class:`engine.generation.sampling.Sampler` on the
host, next to a GPU decode step of a few milliseconds, so its cost per token matters. Measured
side by side in one run: the sampler, and the plain definition it must agree with (penalties,
:func:`~engine.generation.sampling.truncate` over the whole vocabulary, softmax, one
``torch.multinomial`` draw), on two kinds of logits: random normal (a flat, worst-case tail) and
peaked (a few strong candidates over a long tail, as a language model's usually are).
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import torch

from engine.bench import help_for
from engine.bench.timing import median_time
from engine.commands.common import run_alone

CPU = torch.device("cpu")
# Untimed calls first: the first calls of a process pay for thread start-up and fresh allocations.
WARMUP = 10

PRESETS = {  # the app's presets (app/chat/presets.py) and two single rules
    "temperature 0.8": {"temperature": 0.8},
    "top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "app balanced": {"temperature": 0.7, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.05},
    "app precise": {"temperature": 0.2, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.05},
}


def register(sub) -> None:
    p = sub.add_parser("bench-sampler", help=help_for("bench-sampler"))
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary size (Llama 3: 128256)")
    p.add_argument("--context", type=int, default=1000, help="context tokens the penalties look at")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.set_defaults(func=run)


def reference_sample(logits: torch.Tensor, settings, context, generated, generator: torch.Generator) -> int:
    """The sampler's definition, spelled out over the whole vocabulary."""
    from engine.generation.sampling import apply_penalties, truncate

    x = apply_penalties(logits.float().clone(), settings, context, generated) / settings.temperature
    probs = torch.softmax(truncate(x, settings), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def example_logits(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(vocab, generator=g) * 2
    peaked[:50] += torch.linspace(14, 6, 50)
    return {"random": torch.randn(vocab, generator=g) * 3, "peaked": peaked}


def run(args: argparse.Namespace) -> int:
    from engine.generation.sampling import Sampler, SamplingSettings

    if args.threads:
        torch.set_num_threads(args.threads)
    context = list(range(0, 3 * args.context, 3))
    generated = context[-200:]
    rows = []
    threads = torch.get_num_threads()
    print(f"sampler, {args.vocab}-token vocabulary, {args.context} context tokens, {threads} threads")
    print(f"{'logits':<8} {'settings':<16} {'definition ms':>13} {'sampler ms':>10} {'speed-up':>8}")
    for kind, logits in example_logits(args.vocab).items():
        for name, kw in PRESETS.items():
            settings = SamplingSettings(seed=0, **kw)
            sampler = Sampler(settings)
            gen = torch.Generator().manual_seed(0)
            definition = partial(reference_sample, logits, settings, context, generated, gen)
            ref = median_time(definition, args.repeats, CPU, WARMUP) * 1e3
            ours_call = partial(sampler.sample, logits, context, generated)
            ours = median_time(ours_call, args.repeats, CPU, WARMUP) * 1e3
            rows.append({"logits": kind, "settings": name, "definition_ms": ref, "sampler_ms": ours})
            print(f"{kind:<8} {name:<16} {ref:13.2f} {ours:10.2f} {ref / ours:7.1f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vocab": args.vocab, "threads": threads, "rows": rows}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_alone(register, "bench-sampler", argv)


if __name__ == "__main__":
    sys.exit(main())
