"""``bench``: prefill and decode speed of our engine, side by side with a peer in the same run.

The peer is Hugging Face ``transformers`` running the same checkpoint at the same dtype on the
same device (``--no-peer`` skips it). Both sides get a warm-up run first; each figure is the
median of ``--repeats`` runs. Decode speed is measured as (N - 1) tokens over the time between
the first and the last new token, so prompt processing is excluded on both sides.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.commands.common import add_cache_args, add_model_args, cache_bits


def register(sub) -> None:
    p = sub.add_parser("bench", help="prefill/decode speed vs transformers in the same run")
    add_model_args(p)
    add_cache_args(p)
    p.add_argument("--prompt-tokens", type=int, default=512, help="prefill length")
    p.add_argument("--decode-tokens", type=int, default=64, help="new tokens per decode run")
    p.add_argument("--batch", type=int, default=1, help="decode batch size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads for both sides (default: torch's choice)"
    )
    p.add_argument("--no-peer", action="store_true", help="skip the transformers comparison")
    p.add_argument("--json-out", default=None, help="write the results as JSON to this file")
    p.set_defaults(func=run)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_ours(model, prompt: list[int], args) -> dict:
    from engine.cache.paged import PagedKVCache
    from engine.generation.generator import Generator
    from engine.generation.job import Job
    from engine.generation.step import StepItem, run_step

    n = len(prompt)
    bits = cache_bits(args)
    cache = PagedKVCache.for_model(
        model.spec, n + args.decode_tokens + 64, dtype=model.dtype, device=model.device, bits=bits
    )
    pages = cache.pages.allocate(cache.num_pages)

    def prefill():
        run_step(model.module, cache, [StepItem(prompt, 0, pages, "last")])

    prefill_s = _median_time(prefill, args.repeats, model.device)
    cache.pages.release(pages)

    total = args.batch * (16 + args.decode_tokens) + 64
    gen = Generator(model, None, cache_tokens=total, max_batch_size=args.batch, cache_bits=bits)

    def decode() -> float:
        jobs = [Job(prompt[:16], args.decode_tokens, stop_token_ids=()) for _ in range(args.batch)]
        results = gen.generate(jobs)
        return max(r.timings.decode_s for r in results)

    decode()  # warm-up
    decode_s = statistics.median(decode() for _ in range(args.repeats))
    return {
        "prefill_tokens_per_s": n / prefill_s,
        "decode_tokens_per_s": args.batch * (args.decode_tokens - 1) / decode_s,
    }


def bench_transformers(
    model_dir: str, device: torch.device, dtype: torch.dtype, prompt: list[int], args
) -> dict:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    ids = torch.tensor([prompt], device=device)

    @torch.inference_mode()
    def prefill():
        ref(ids, use_cache=False)

    prefill_s = _median_time(prefill, args.repeats, device)
    short = ids[:, :16].repeat(args.batch, 1)

    @torch.inference_mode()
    def gen(n: int):
        ref.generate(short, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    t1 = _median_time(lambda: gen(1), args.repeats, device)
    tn = _median_time(lambda: gen(args.decode_tokens), args.repeats, device)
    return {
        "prefill_tokens_per_s": len(prompt) / prefill_s,
        "decode_tokens_per_s": args.batch * (args.decode_tokens - 1) / (tn - t1),
    }


def run(args: argparse.Namespace) -> int:
    from engine.model import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.spec.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
    results = {
        "model": str(model.directory),
        "device": str(model.device),
        "dtype": str(model.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "batch": args.batch,
        "cache_bits": list(cache_bits(args)),
        "ours": bench_ours(model, prompt, args),
    }
    if not args.no_peer:
        results["transformers"] = bench_transformers(args.model, model.device, model.dtype, prompt, args)
    print(format_table(results))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def format_table(r: dict) -> str:
    lines = [
        f"model {r['model']} on {r['device']} ({r['dtype']}, {r['threads']} threads)",
        f"{'metric':<34}{'ours':>12}{'transformers':>14}{'ratio':>8}",
    ]
    rows = [
        (f"prefill tok/s ({r['prompt_tokens']} tokens)", "prefill_tokens_per_s"),
        (f"decode tok/s (batch {r['batch']})", "decode_tokens_per_s"),
    ]
    for label, key in rows:
        ours = r["ours"][key]
        peer = r.get("transformers", {}).get(key)
        peer_s = f"{peer:14.1f}" if peer else f"{'-':>14}"
        ratio = f"{ours / peer:8.2f}" if peer else f"{'-':>8}"
        lines.append(f"{label:<34}{ours:12.1f}{peer_s}{ratio}")
    return "\n".join(lines)
