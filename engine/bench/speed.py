"""``bench``: prefill and decode speed of our engine, side by side with a peer in the same run.

Two sources of a model:

- ``-m DIR``: a real checkpoint;
- ``--synthetic SHAPE --bpw 2,4``: random-weight models of a published shape (``engine.shapes``,
  or a JSON config file), built directly in EXL3 form on the device, one row per bit rate
  (whole bits 1..8; ``--fp16`` adds a dense row). See ``engine.loading.synthetic_store``.

Per row: decode tokens/s at batch ``--batch`` from a near-empty context (1 prompt token) and at
``--context`` tokens, prefill tokens/s of a ``--prompt``-token prompt, peak device memory, and
the decode roofline (``engine.bench.roofline``) against a copy bandwidth measured in the same
run. Everything runs through the Generator, as a user's request would: decode speed is (N - 1)
tokens over the time from the first to the last new token (the Generator's own timings), prefill
speed the prompt over the time to the first token. The decode-at-context runs reuse the cached
prompt pages after the warm-up, so they time decoding, not the prompt.

The peer (``engine.bench.peer``) is Hugging Face ``transformers`` at the compute dtype
on the same shape or checkpoint; ``--no-peer`` skips it, ``--no-peer-compile`` skips its
``torch.compile``. Every figure is the median of ``--repeats`` runs after a warm-up.

``--no-cuda-graphs`` times our eager decode steps. Run it without the rest of the CLI as
``python3 -m engine.bench.speed ...``.

The peer needs ``transformers``, an optional dependency: it is looked for before any work starts,
and where it is missing the run goes on without the peer and says so (a peer that fails later
costs its row, never the figures already measured). Progress goes to stderr as each run starts.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.bench import help_for
from engine.bench.roofline import DecodeBytes, module_decode_bytes
from engine.bench.timing import copy_bandwidth, median_of
from engine.commands.common import add_cache_args, add_model_args, cache_bits, run_alone
from engine.exl3.codebooks import CODEBOOKS
from engine.generation.sampling import SamplingSettings
from engine.parallel.command_line import add_parallel_args


def register(sub) -> None:
    p = sub.add_parser("bench", help=help_for("bench"))
    add_model_args(p, required=False)
    add_cache_args(p)
    add_parallel_args(p)
    p.add_argument(
        "--synthetic",
        metavar="SHAPE",
        default=None,
        help="random-weight model of this shape (a name from engine.shapes, or a config.json path)",
    )
    p.add_argument("--bpw", default="4", help="synthetic: comma-separated whole bits per weight 1..8")
    p.add_argument("--fp16", action="store_true", help="synthetic: add a row with dense weights")
    p.add_argument(
        "--head-bits",
        type=int,
        default=6,
        help="synthetic: bits of the head, tied or not (16: fp16; a tied head is then the embedding)",
    )
    p.add_argument("--codebook", default="mul1", choices=CODEBOOKS, help="synthetic codebook")
    p.add_argument("--prompt-tokens", "--prompt", dest="prompt_tokens", type=int, default=4096)
    p.add_argument("--context", type=int, default=4096, help="context of the second decode figure")
    p.add_argument("--decode-tokens", type=int, default=128, help="new tokens per decode run")
    p.add_argument("--batch", type=int, default=1, help="decode batch size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads for both sides (default: torch's choice)"
    )
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="our decode steps from CUDA graphs (default: the Generator's default)",
    )
    p.add_argument(
        "--sampled",
        action="store_true",
        help="also time decode (empty context) with the app's 'balanced' sampling instead of greedy",
    )
    p.add_argument(
        "--step-tune",
        action="store_true",
        help="also time decode with the GEMV split counts tuned on whole decode steps "
        "(engine.kernels.tuning.tune_step), after the figures with the per-launch choice",
    )
    p.add_argument("--no-peer", action="store_true", help="skip the transformers comparison")
    p.add_argument(
        "--peer-compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="torch.compile the peer's decode step (static cache); --no-peer-compile to skip",
    )
    p.add_argument("--json", "--json-out", dest="json_out", default=None, help="write results as JSON here")
    # Speculative decoding (engine.bench.speculative): with -m DIR, decode speed with and without it.
    p.add_argument(
        "--draft", default=None, help="compare decoding with this drafter (ngram, model:DIR) to plain"
    )
    p.add_argument(
        "--draft-tokens", type=int, default=None, help="with --draft: most tokens per draft (1..8)"
    )
    p.add_argument(
        "--verify-cost",
        action="store_true",
        help="instead of the usual figures: the cost of a verify step of 1 + k tokens per sequence "
        "against a decode step, k = 0..8, near-empty and at --context (engine.bench.verify_cost)",
    )
    p.add_argument(
        "--allreduce-cost",
        action="store_true",
        help="with --tp N: also time the all-reduce of one hidden-size row across the ranks inside "
        "a CUDA graph (a graph of one per layer against one without; engine.parallel.allreduce_cost)",
    )
    p.set_defaults(func=run)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _measured(label: str, fn: Callable[[], float], repeats: int) -> float:
    """``median_of(fn, repeats)``, saying on stderr which run is starting (a long prompt on a
    slow machine takes minutes: the user should see it move)."""
    total = max(1, repeats) + 1  # median_of runs one warm-up first
    count = itertools.count(1)

    def run() -> float:
        i = next(count)
        _log(f"  {label}: run {i}/{total}" + (" (warm-up)" if i == 1 else ""))
        return fn()

    return median_of(run, repeats)


def peer_missing() -> str | None:
    """Why the transformers peer cannot run here (None: it can)."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install transformers), so there is no peer row"
    return None


# -- our engine ----------------------------------------------------------------------------------


def bench_ours(model, args, bandwidth: float) -> dict[str, Any]:
    """Decode (near-empty and at ``--context``) and prefill figures of ``model``, plus roofline."""
    from engine.generation.generator import Generator
    from engine.generation.job import Job

    n, b = args.decode_tokens, args.batch
    bits = cache_bits(args)
    tokens = max(b * (args.context + n + 64), args.prompt_tokens + 64)
    gen = Generator(
        model, None, cache_tokens=tokens, max_batch_size=b, cache_bits=bits, options=_options(args)
    )
    rng = torch.Generator().manual_seed(0)
    vocab = model.spec.vocab_size

    def decode(prompt: list[int], sampling: SamplingSettings | None = None) -> float:
        sampling = sampling or SamplingSettings.greedy()
        results = gen.generate([Job(prompt, n, sampling=sampling, stop_token_ids=()) for _ in range(b)])
        return b * (n - 1) / max(max(r.timings.decode_s for r in results), 1e-9)

    def prefill() -> float:
        prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=rng).tolist()
        (result,) = gen.generate([Job(prompt, 1, stop_token_ids=())])
        return args.prompt_tokens / max(result.timings.prefill_s, 1e-9)

    ctx_prompt = torch.randint(0, vocab, (args.context,), generator=rng).tolist()
    row: dict[str, Any] = {
        "decode_tokens_per_s": _measured(
            f"decode {n} tokens from an empty context", lambda: decode(ctx_prompt[:1]), args.repeats
        ),
        "decode_ctx_tokens_per_s": _measured(
            f"decode {n} tokens at {args.context} tokens of context", lambda: decode(ctx_prompt), args.repeats
        ),
        "prefill_tokens_per_s": _measured(f"prefill {args.prompt_tokens} tokens", prefill, args.repeats),
    }
    if getattr(args, "sampled", False):
        # The app's default preset: what a chat user's tokens cost (penalties, truncation, a draw).
        from engine.bench.sampler import PRESETS

        balanced = SamplingSettings(**PRESETS["app balanced"], seed=0)
        row["decode_sampled_tokens_per_s"] = _measured(
            "decode with 'balanced' sampling", lambda: decode(ctx_prompt[:1], balanced), args.repeats
        )
    kvb = gen.cache.nbytes / gen.cache.capacity
    if getattr(args, "step_tune", False) and gen._use_graphs:
        row.update(step_tuned_figures(model, args, tokens, bits, ctx_prompt))
    decode_bytes = module_decode_bytes(model.module, model.module.embedding.weight, kvb)
    row.update(roofline_fields(decode_bytes, bandwidth, row, args))
    return row


def verify_cost_row(model, args) -> dict[str, Any]:
    """``--verify-cost``: verify steps of k = 0..8 drafted tokens, near-empty and at --context."""
    from engine.bench.verify_cost import verify_step_costs

    rows = verify_step_costs(
        model,
        [1, args.context],
        args.batch,
        repeats=args.repeats,
        cache_bits=cache_bits(args),
        graphs=_graphs_on(args, model.device),
    )
    return {"verify_cost": rows}


def step_tuned_figures(model, args, tokens: int, bits, ctx_prompt: list[int]) -> dict[str, Any]:
    """Decode figures again with a Generator that tunes the split counts on whole steps (its first
    graph capture tunes; engine.kernels.tuning.tune_step), and what the tuning changed."""
    from dataclasses import replace

    from engine.generation.generator import Generator
    from engine.generation.job import Job
    from engine.kernels import tuning as kernel_tuning

    n, b = args.decode_tokens, args.batch
    options = replace(_options(args), step_tuning=True)
    gen = Generator(model, None, cache_tokens=tokens, max_batch_size=b, cache_bits=bits, options=options)

    def decode(prompt: list[int]) -> float:
        jobs = [Job(prompt, n, sampling=SamplingSettings.greedy(), stop_token_ids=()) for _ in range(b)]
        results = gen.generate(jobs)
        return b * (n - 1) / max(max(r.timings.decode_s for r in results), 1e-9)

    out: dict[str, Any] = {
        "step_tuned_decode_tokens_per_s": median_of(lambda: decode(ctx_prompt[:1]), args.repeats),
        "step_tuned_decode_ctx_tokens_per_s": median_of(lambda: decode(ctx_prompt), args.repeats),
    }
    tuning = kernel_tuning.last_step_tuning()
    if tuning is not None:
        _log(f"  step tuning: {tuning.summary()}")
        out["step_tuning"] = {
            "before_ms": round(tuning.before_ms, 4),
            "after_ms": round(tuning.after_ms, 4),
            "changes": {kernel_tuning.describe(k): list(v) for k, v in tuning.changes.items()},
            "timings": tuning.timings,
            "seconds": round(tuning.seconds, 1),
        }
    return out


def roofline_fields(db: DecodeBytes, bandwidth: float, figures: dict, args) -> dict[str, Any]:
    """Bytes per step and roofline tok/s at the mean context of each decode run, and our % of it.

    The measured tokens of a run sit at positions ``start + 1 .. start + N - 1``, so the mean
    context a step reads is about ``start + N / 2`` (start = 1 or ``--context``).
    """
    out: dict[str, Any] = {
        "weight_bytes": db.weight_bytes,
        "embed_row_bytes": db.embed_row_bytes,
        "kv_bytes_per_token": db.kv_bytes_per_token,
    }
    for key, start in (("decode", 1), ("decode_ctx", args.context)):
        ctx = start + args.decode_tokens / 2
        roof = db.roofline_tokens_per_s(bandwidth, ctx, args.batch)
        out[f"{key}_bytes_per_step"] = db.per_step(ctx, args.batch)
        out[f"{key}_roofline_tokens_per_s"] = roof
        out[f"{key}_roofline_pct"] = 100 * figures[f"{key}_tokens_per_s"] / roof
    return out


# -- rows ------------------------------------------------------------------------------------------


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":  # free the previous row's model before the next one is measured
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _options(args):
    """The run's EngineOptions with ``--cuda-graphs`` / ``--no-cuda-graphs`` on top."""
    from dataclasses import replace

    if args.cuda_graphs is None:
        return args.options
    return replace(args.options, cuda_graphs=args.cuda_graphs)


def _graphs_on(args, device: torch.device) -> bool:
    # Experts in host memory run on the CPU: such decode steps are never replayed from a graph.
    experts_on_device = getattr(args, "experts_on", "device") == "device"
    return _options(args).cuda_graphs and device.type == "cuda" and experts_on_device


def _exl3_mode(model) -> str | None:
    """ "streaming" (packed, decoded by the kernels) or "dense" (reconstructed at load: no CUDA
    extension, or the CPU): a dense EXL3 row measures dense weights, whatever its bits."""
    from engine.exl3 import EXL3Linear

    modes = {m.mode for m in model.module.modules() if isinstance(m, EXL3Linear)}
    return ",".join(sorted(modes)) or None


def synthetic_shape(text: str) -> tuple[str, dict[str, Any]]:
    """``--synthetic``: a config.json path, or a shape name from ``engine.shapes``."""
    path = Path(text)
    if path.suffix == ".json" or path.is_file():
        try:
            return path.stem, json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"error: cannot read shape config {path}: {exc}") from None
    from engine.shapes import shape_config

    try:
        return text, shape_config(text)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def parse_bpw(text: str) -> list[int]:
    from engine.loading.synthetic_store import check_bits

    try:
        return check_bits(float(t) for t in text.split(",") if t.strip())
    except ValueError as exc:
        raise SystemExit(f"error: --bpw: {exc}") from None


def synthetic_rows(args, device: torch.device, dtype: torch.dtype, bandwidth: float, results: dict) -> None:
    """One row per ``--bpw`` value (and ``--fp16``), each model built, measured and freed in turn
    (with ``--tp N``: over N ranks, each building the same seeded model and keeping its shard)."""
    from contextlib import ExitStack

    name, hf_config = synthetic_shape(args.synthetic)
    variants: list[int | None] = list(parse_bpw(args.bpw))
    if args.fp16:
        variants.append(None)
    for bits in variants:
        label = f"{bits} bpw" if bits is not None else str(dtype).replace("torch.", "")
        _log(f"building {name} at {label} ...")
        _reset_peak(device)
        with ExitStack() as stack:  # closes a tensor-parallel run's other ranks
            t = time.perf_counter()
            model = _synthetic_model(args, name, hf_config, bits, device, dtype, stack)
            build_s = time.perf_counter() - t
            mode = _exl3_mode(model)
            _log(f"  built in {build_s:.1f} s; measuring")
            if mode == "dense" and device.type == "cuda":
                _log("  warning: no CUDA extension, so this EXL3 row runs reconstructed dense weights")
            row = {"label": label, "bits": bits, "exl3_mode": mode, "build_s": build_s}
            if args.tp > 1:
                row["tp"] = args.tp
            row.update(
                verify_cost_row(model, args) if args.verify_cost else bench_ours(model, args, bandwidth)
            )
            _add_allreduce_cost(row, model, args)
            row["peak_memory_bytes"] = _peak(device)
            results["rows"].append(row)
            del model
        _write(args, results)


def _synthetic_model(args, name: str, hf_config: dict, bits: int | None, device, dtype, stack):
    """The random-weight model of one row: built here, or over ``--tp`` ranks (seed 0 on each;
    the run is closed by ``stack``)."""
    from engine.loading.synthetic_store import synthetic_model

    if args.tp <= 1:
        return synthetic_model(
            hf_config,
            bits,
            device,
            dtype,
            args.head_bits,
            args.codebook,
            name=name,
            experts_on=args.experts_on,
        )
    from engine.parallel.launch import start_tensor_parallel

    spec = {"hf_config": hf_config, "bits": bits, "head_bits": args.head_bits}
    spec |= {"codebook": args.codebook, "name": name, "seed": 0}
    kind = device.type if device.type in ("cpu", "cuda") else "cuda"
    model, run, report = start_tensor_parallel(
        None, args.tp, kind, dtype, options=args.options, exit_on_failure=True, synthetic=spec
    )
    stack.enter_context(run)
    for line in report.lines():
        _log(f"tp {args.tp}: {line}")
    return model


def _add_allreduce_cost(row: dict, model, args) -> None:
    """``--allreduce-cost``: the figure of ``engine.parallel.allreduce_cost`` over the run's ranks."""
    if getattr(args, "allreduce_cost", False):
        from engine.parallel.allreduce_cost import all_reduce_cost

        _log("  timing all-reduces across the ranks")
        row["allreduce_cost"] = all_reduce_cost(model)


def peer_row(args, device: torch.device, dtype: torch.dtype, bandwidth: float, results: dict) -> None:
    from engine.bench import peer

    _log("building the transformers peer ...")
    _reset_peak(device)
    if args.synthetic:
        ref = peer.build_from_config(synthetic_shape(args.synthetic)[1], device, dtype)
    else:
        ref = peer.build_from_dir(args.model, device, dtype)
    _log("  measuring the transformers peer")
    row = peer.bench_transformers(ref, device, args, compile=args.peer_compile)
    row.update(roofline_fields(peer.peer_decode_bytes(ref, dtype), bandwidth, row, args))
    row["peak_memory_bytes"] = _peak(device)
    results["transformers"] = row
    for r in results["rows"]:
        r["vs_transformers"] = {k: r[k] / row[k] for k in _FIGURES if row.get(k)}
    del ref


_FIGURES = ("decode_tokens_per_s", "decode_ctx_tokens_per_s", "prefill_tokens_per_s")


def _write(args, results: dict) -> None:
    """Written after every row, so a run cut short still leaves what it measured."""
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)


def run(args: argparse.Namespace) -> int:
    from engine.model import default_dtype, resolve_device

    if bool(args.model) == bool(args.synthetic):
        raise SystemExit("error: give either -m/--model DIR or --synthetic SHAPE")
    if args.synthetic and (args.split_layers or args.gpu_layers is not None):
        raise SystemExit("error: --split-layers and --gpu-layers need -m/--model DIR")
    if args.synthetic and args.tp > 1 and args.experts_on != "device":
        raise SystemExit("error: --experts-on cpu cannot be combined with --tp yet")
    if getattr(args, "draft", None):
        from engine.bench.speculative import run_draft_bench
        from engine.commands.generate import draft_options

        if not args.model:
            raise SystemExit("error: --draft needs -m/--model DIR")
        draft_options(args)  # checks --draft and --draft-tokens before the model loads
        if args.threads:
            torch.set_num_threads(args.threads)
        return run_draft_bench(args)
    if args.decode_tokens < 2:
        raise SystemExit("error: --decode-tokens must be at least 2")
    if getattr(args, "allreduce_cost", False) and getattr(args, "tp", 1) < 2:
        raise SystemExit("error: --allreduce-cost needs --tp N with N >= 2")
    if args.verify_cost:
        args.no_peer = True  # a table of our own steps: no peer figure to set beside it
    missing = None if args.no_peer else peer_missing()
    if missing:
        _log(f"note: {missing}; measuring our engine only (--no-peer skips the peer without this note)")
        args.no_peer = True
    if args.threads:
        torch.set_num_threads(args.threads)
    args.options.configure_kernels()
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype(device)
    bandwidth = copy_bandwidth(device)
    results: dict[str, Any] = {
        "model": args.model or f"synthetic {args.synthetic}",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "prompt_tokens": args.prompt_tokens,
        "context": args.context,
        "decode_tokens": args.decode_tokens,
        "batch": args.batch,
        "cache_bits": list(cache_bits(args)),
        "experts_on": args.experts_on,  # cpu: routed experts in host memory, run on the CPU
        "cuda_graphs": _graphs_on(args, device),
        "chained_launches": False,  # set below where the decode step's kernels launch chained
        "int8_gemv": False,  # set below where MUL1 GEMVs at 1-2 rows run on the integer tensor cores
        "rows": [],
    }
    if missing:
        results["peer_note"] = missing
    _log(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    with torch.inference_mode():
        if args.synthetic:
            synthetic_rows(args, device, dtype, bandwidth, results)
        else:
            from contextlib import ExitStack

            from engine.model import load_model
            from engine.parallel.command_line import parallel_model

            _log(f"loading {args.model} ...")
            with ExitStack() as stack:  # closes a tensor-parallel run's other ranks
                parallel = parallel_model(args, args.options, stack, dtype)
                if parallel is None:
                    model = load_model(args.model, device=device, dtype=dtype, options=args.options)
                else:
                    model, args.options = parallel
                    results["tp"], results["split_layers"] = args.tp, args.split_layers
                    results["gpu_layers"] = args.gpu_layers
                _log("measuring our engine")
                figures = (
                    verify_cost_row(model, args) if args.verify_cost else bench_ours(model, args, bandwidth)
                )
                row = {"label": "model", **figures}
                _add_allreduce_cost(row, model, args)
                row["peak_memory_bytes"] = _peak(device)
                results["rows"].append(row)
                del model
    if device.type == "cuda":
        from engine import kernels

        results["extension"] = kernels.status()
        results["chained_launches"] = kernels.chained_launches_supported(device)
        results["int8_gemv"] = kernels.gemv.int8_gemv_available(device)
    if not args.no_peer:
        try:
            peer_row(args, device, dtype, bandwidth, results)
        except Exception as exc:  # the peer's trouble must not lose the figures measured above
            _log(f"the transformers peer failed ({type(exc).__name__}: {exc}); our figures stand")
            results["peer_note"] = f"the transformers peer failed: {type(exc).__name__}: {exc}"
    print(format_table(results))
    _write(args, results)
    return 0


def format_table(r: dict) -> str:
    if any("verify_cost" in row for row in r["rows"]):
        from engine.bench.verify_cost import format_verify_costs

        head = (
            f"{r['model']} on {r['device']} ({r['dtype']}), CUDA graphs {'on' if r['cuda_graphs'] else 'off'}"
        )
        tables = [format_verify_costs(row["label"], r["batch"], row["verify_cost"]) for row in r["rows"]]
        return "\n".join([head, *tables])
    b = r["batch"]
    lines = [
        f"{r['model']} on {r['device']} ({r['dtype']}, {r['threads']} threads), "
        f"copy bandwidth {r['copy_bandwidth_GBps']:.0f} GB/s, batch {b}, {r['decode_tokens']} new tokens, "
        f"CUDA graphs {'on' if r['cuda_graphs'] else 'off'}, "
        f"chained launches {'on' if r['chained_launches'] else 'off'}, "
        f"int8 GEMV {'on' if r.get('int8_gemv') else 'off'}"
        + (f", tp {r['tp']}" if r.get("tp", 1) > 1 else "")
        + (f", layers split {r['split_layers']}" if r.get("split_layers") else "")
        + (f", first {r['gpu_layers']} layers on the GPU" if r.get("gpu_layers") is not None else "")
        + (", experts on the CPU" if r.get("experts_on") == "cpu" else ""),
        f"{'':<14}{'GB/step':>8}{'decode':>9}{'roof':>8}{'%':>5}"
        f"{'@' + str(r['context']):>9}{'roof':>8}{'%':>5}{'prefill':>10}{'peak GB':>9}",
        f"{'':<14}{'':>8}{'tok/s':>9}{'tok/s':>8}{'':>5}{'tok/s':>9}{'tok/s':>8}{'':>5}"
        f"{'tok/s@' + str(r['prompt_tokens']):>10}",
    ]
    rows = list(r["rows"])
    if "transformers" in r:
        peer = r["transformers"]
        tag = "hf" + ("+compile" if peer.get("compiled") else "")
        rows.append({"label": tag, **peer})
    for row in rows:
        peak = row.get("peak_memory_bytes")
        lines.append(
            f"{row['label']:<14}{row['decode_bytes_per_step'] / 1e9:8.3f}"
            f"{row['decode_tokens_per_s']:9.1f}{row['decode_roofline_tokens_per_s']:8.0f}"
            f"{row['decode_roofline_pct']:5.0f}"
            f"{row['decode_ctx_tokens_per_s']:9.1f}{row['decode_ctx_roofline_tokens_per_s']:8.0f}"
            f"{row['decode_ctx_roofline_pct']:5.0f}"
            f"{row['prefill_tokens_per_s']:10.0f}"
            f"{(f'{peak / 1e9:9.2f}' if peak else f'{chr(45):>9}')}"
        )
    for row in r["rows"]:
        vs = row.get("vs_transformers")
        if vs:
            lines.append(
                f"{row['label']} / transformers: decode {vs.get('decode_tokens_per_s', 0):.2f}x, "
                f"at context {vs.get('decode_ctx_tokens_per_s', 0):.2f}x, "
                f"prefill {vs.get('prefill_tokens_per_s', 0):.2f}x"
            )
    for row in r["rows"]:
        if "allreduce_cost" in row:
            from engine.parallel.allreduce_cost import describe

            lines.append(f"{row['label']}: {describe(row['allreduce_cost'], r.get('tp') or row.get('tp'))}")
    for row in r["rows"]:
        if "decode_sampled_tokens_per_s" in row:
            sampled = row["decode_sampled_tokens_per_s"]
            lines.append(f"{row['label']} decode with the app's 'balanced' sampling: {sampled:.1f} tok/s")
    for row in r["rows"]:
        if "step_tuned_decode_tokens_per_s" in row:
            lines.append(
                f"{row['label']} with split counts tuned on whole steps: decode "
                f"{row['step_tuned_decode_tokens_per_s']:.1f} tok/s, at context "
                f"{row['step_tuned_decode_ctx_tokens_per_s']:.1f} tok/s"
            )
    if r.get("transformers", {}).get("note"):
        lines.append(f"note: {r['transformers']['note']}")
    if r.get("peer_note"):
        lines.append(f"note: {r['peer_note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_alone(register, "bench", argv)


if __name__ == "__main__":
    raise SystemExit(main())
