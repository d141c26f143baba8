"""``convert-bench``: how long the EXL3 converter takes on a model of a published shape (issue 3).

Writes a random-weight Hugging Face directory of ``--shape`` (``engine.shapes``; bf16
safetensors, no tokenizer: calibration uses random-token rows only), runs the real converter
(:func:`engine.convert.pipeline.convert_model`) on it with its progress log, and reports wall time
in total and per stage:

- ``sensitivity``: the bit-allocation pre-pass (:mod:`engine.convert.sensitivity`), all of it
  (its own block forwards and LDL factorisations are not counted in the stages below);
- ``hessian_forward``: the unquantized block forwards that record the input Hessians (and with
  ``--sequential`` the partial forwards that record them again after each input group);
- ``ldl``: the block-LDL factorisations; ``viterbi``: the trellis encoder (plus its tiles/s);
- ``packing``: state packing; ``refit``: the scale refit (:mod:`engine.convert.refit`);
  ``quantized_forward``: the quantized block forwards (and, with ``--tune-target model``, the
  unquantized model's own); ``tune``: the scale tuning (:mod:`engine.convert.finetune`);
- ``quantize_other``: the rest of ``quantize_weights`` (rotations, LDLQ feedback, scale search).

``--layers N`` converts only the first N decoder layers (plus the head) and extrapolates the
full model's time from the mean block time plus each layer's share of the sensitivity pre-pass
(which runs over every layer); the JSON says which figures are extrapolated.

Unless ``--no-kernel-bench``, it also times the Viterbi alone: tiles/s of the CUDA kernel on
``--kernel-tiles`` random Gaussian tiles at K = 1, 2, 4, 6, against the torch path on the same GPU
(a smaller sample, it is slow).

Run as ``python -m engine convert-bench --shape llama3.2-1b --bpw 4.0 --device cuda`` (or
``python3 -m engine.bench.conversion ...`` where only the inference dependencies are installed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.bench import help_for
from engine.commands.common import run_alone

STAGES = (
    "sensitivity",
    "hessian_forward",
    "ldl",
    "viterbi",
    "packing",
    "refit",
    "quantize_other",
    "quantized_forward",
    "tune",
)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_random_model(directory: Path, config: dict[str, Any], seed: int = 0) -> int:
    """A random-weight HF directory (config.json + model.safetensors, bf16); returns its bytes.

    Linear and embedding weights are N(0, 0.02^2) (a typical init scale), norms are ones.
    """
    from safetensors.torch import save_file

    from engine.shapes import linear_shapes

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    hidden, vocab = config["hidden_size"], config["vocab_size"]
    tensors = {
        "model.embed_tokens.weight": randn(vocab, hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = randn(vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for name, (in_f, out_f) in linear_shapes(config).items():
            group = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            tensors[f"{p}.{group}.{name}.weight"] = randn(out_f, in_f)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{p}.{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())


class StageTimer:
    """Wraps functions in the converter's modules to add their synchronised wall time to a stage,
    and on CUDA the peak device memory allocated while each runs (``stage_peaks``, bytes: the
    peak counter is reset as a wrapped call starts and read as it ends; a call inside another
    counts towards both). ``outside_stages`` is the peak while no wrapped call ran (the head's
    Hessian, the per-block error, the output writing)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.viterbi_tiles = 0
        self.stage_peaks: dict[str, int] = defaultdict(int)
        self.overall_peak = 0  # the whole run's peak (the counter is reset for every stage)
        self._open: list[list[int]] = []  # running peaks of the wrapped calls in progress
        self._undo: list[Callable[[], None]] = []
        self._exclusive = False  # inside an exclusive stage: other wrapped calls are not timed

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _fold_peak(self) -> None:
        """Credit the peak since the last reset to every call in progress (or to the time outside
        them) and to the whole run."""
        peak = torch.cuda.max_memory_allocated(self.device)
        for running in self._open:
            running[0] = max(running[0], peak)
        if not self._open:
            self.stage_peaks["outside_stages"] = max(self.stage_peaks["outside_stages"], peak)
        self.overall_peak = max(self.overall_peak, peak)

    def _enter_peak(self) -> None:
        if self.device.type == "cuda":
            self._fold_peak()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._open.append([0])

    def _exit_peak(self, stage: str) -> None:
        if self.device.type == "cuda":
            self._fold_peak()
            peak = self._open.pop()[0]
            self.stage_peaks[stage] = max(self.stage_peaks[stage], peak)
            # Already credited to every call still open: what follows starts its own count.
            torch.cuda.reset_peak_memory_stats(self.device)

    def finish_peaks(self) -> None:
        """Fold in the peak since the last wrapped call (call once the run is over)."""
        if self.device.type == "cuda":
            self._fold_peak()

    def peaks_gb(self) -> dict[str, float]:
        """The per-stage peaks in GB (empty off CUDA)."""
        return {k: round(v / 1e9, 2) for k, v in sorted(self.stage_peaks.items())}

    def wrap(
        self,
        module: Any,
        name: str,
        stage: Callable[[tuple], str],
        exclusive: bool = False,
        peak: str | None = None,
    ) -> None:
        """Time ``module.name`` into ``stage(args)``; an ``exclusive`` stage owns all of its time.
        Its device peak goes under ``peak`` (default: the stage's name)."""
        original = getattr(module, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._exclusive:
                return original(*args, **kwargs)
            self._sync()
            t = time.perf_counter()
            self._exclusive = exclusive
            self._enter_peak()
            try:
                return original(*args, **kwargs)
            finally:
                self._exclusive = False
                self._sync()
                named = stage(args)
                self.seconds[named] += time.perf_counter() - t
                self._exit_peak(peak or named)

        setattr(module, name, timed)
        self._undo.append(lambda: setattr(module, name, original))

    def install(self) -> None:
        """Wrap each timed function where the converter looks it up (the module that calls it)."""
        from engine.convert import bit_plan, block_quantizer, head, pipeline, quantize

        def forward_stage(args: tuple) -> str:
            # convert_model runs each block unquantized with the Hessian hooks on, then quantized
            # (no resume in a benchmark); tuning towards the model adds an unhooked unquantized run.
            block = args[0]
            hooked = any(m._forward_pre_hooks for m in block.modules())
            return "hessian_forward" if hooked else "quantized_forward"

        def viterbi_stage(args: tuple) -> str:
            self.viterbi_tiles += int(args[0].shape[0])
            return "viterbi"

        self.wrap(bit_plan, "measure_sensitivity", lambda a: "sensitivity", exclusive=True)
        self.wrap(block_quantizer, "run_block", forward_stage)  # the Hessian forward
        self.wrap(pipeline, "run_block", forward_stage)  # the quantized (and the exact model's) forward
        self.wrap(block_quantizer, "capture_hessians", lambda a: "hessian_forward")  # --sequential's
        # a block's linears, and the head
        self.wrap(block_quantizer, "quantize_weights", lambda a: "quantize_total", peak="quantize_block")
        self.wrap(head, "quantize_weight", lambda a: "quantize_total", peak="quantize_head")
        self.wrap(quantize, "encode_tiles", viterbi_stage)
        self.wrap(quantize, "block_ldl", lambda a: "ldl")
        self.wrap(quantize, "pack_states", lambda a: "packing")
        self.wrap(quantize, "_refit", lambda a: "refit")
        self.wrap(block_quantizer, "tune_block", lambda a: "tune")

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def stages(self) -> dict[str, float]:
        s = dict(self.seconds)
        total_q = s.pop("quantize_total", 0.0)
        parts = sum(s.get(k, 0.0) for k in ("viterbi", "ldl", "packing", "refit"))
        s["quantize_other"] = max(0.0, total_q - parts)
        return {k: round(s.get(k, 0.0), 2) for k in STAGES}


def kernel_throughput(
    device: torch.device, codebook: str, tiles: int, torch_tiles: int
) -> list[dict[str, Any]]:
    """Viterbi tiles/s, CUDA kernel vs torch path, at K = 1, 2, 4, 6 on random Gaussian tiles."""
    from engine.convert.quantize import GAUSSIAN_SCALE
    from engine.convert.viterbi import encode_tiles
    from engine.exl3.codebooks import codebook_table
    from engine.kernels.viterbi import viterbi_encode

    table = codebook_table(codebook, device)
    std = float(table.float().std())
    rows = []
    for k in (1, 2, 4, 6):
        gen = torch.Generator().manual_seed(k)
        x = (torch.randn(tiles, 256, generator=gen) * GAUSSIAN_SCALE[k] * std).to(device)
        row: dict[str, Any] = {"K": k, "codebook": codebook, "tiles": tiles}

        def timed(fn: Callable[[], Any]) -> float:
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            return time.perf_counter() - t

        if viterbi_encode(x[:8], k, codebook) is not None:  # also the warm-up (extension load)
            dt = timed(lambda x=x, k=k: viterbi_encode(x, k, codebook))
            row["kernel_tiles_per_s"] = round(tiles / dt, 1)
        encode_tiles(x[:2], k, table, use_kernel=False)
        n = min(torch_tiles, tiles)
        dt = timed(lambda x=x[:n], k=k: encode_tiles(x, k, table, use_kernel=False))
        row.update(torch_tiles=n, torch_tiles_per_s=round(n / dt, 1))
        if "kernel_tiles_per_s" in row:
            row["speedup"] = round(row["kernel_tiles_per_s"] / row["torch_tiles_per_s"], 1)
        _log(f" -- viterbi K={k}: {row}")
        rows.append(row)
    return rows


def peak_host_bytes() -> int | None:
    """This process's peak resident memory so far (its high-water mark since it started); None
    where the platform does not say (Windows has no ``resource`` module)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def run(args: argparse.Namespace) -> int:
    from engine.commands.convert import quantizer_options
    from engine.convert.options import ConvertOptions
    from engine.convert.pipeline import convert_model
    from engine.shapes import shape_config

    args.options.configure_kernels()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    config = shape_config(args.shape)
    full_layers = config["num_hidden_layers"]
    layers = min(args.layers or full_layers, full_layers)
    config["num_hidden_layers"] = layers
    results: dict[str, Any] = {
        "shape": args.shape,
        "bpw": args.bpw,
        "codebook": args.codebook,
        "device": str(device),
        "tf32": args.tf32,
    }
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)

    if args.kernel_bench and device.type == "cuda":
        results["viterbi_kernel"] = kernel_throughput(
            device, args.codebook, args.kernel_tiles, args.torch_tiles
        )

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="convert_bench_"))
    src, dst = work / "src", work / "out"
    shutil.rmtree(dst, ignore_errors=True)
    t = time.perf_counter()
    nbytes = write_random_model(src, config, seed=args.seed)
    results["write_model_s"] = round(time.perf_counter() - t, 1)
    size = f"{layers}/{full_layers} layers, {nbytes / 2**30:.2f} GiB"
    _log(f" -- wrote random {args.shape} ({size}) in {results['write_model_s']} s")

    options = ConvertOptions(
        bits=args.bpw,
        head_bits=args.head_bits,
        codebook=args.codebook,
        cal_rows=args.cal_rows,
        cal_cols=args.cal_cols,
        random_rows_fraction=1.0,  # no tokenizer here
        device=str(device),
        allocation=args.allocation,
        tf32=args.tf32,
        states=args.states,
        **quantizer_options(args),
    )
    timer = StageTimer(device)
    timer.install()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        t = time.perf_counter()
        report = convert_model(src, dst, options, log=lambda m: print(m, flush=True))
        wall = time.perf_counter() - t
    finally:
        timer.uninstall()
        timer.finish_peaks()
    # Memory does not grow with the layer count (one block is held at a time): the peaks of a
    # few layers are the whole model's.
    host = peak_host_bytes()
    results["peak_host_gb"] = None if host is None else round(host / 1e9, 2)
    if device.type == "cuda":
        results["peak_device_gb"] = round(timer.overall_peak / 1e9, 2)
        # Where it is: the peak while each wrapped stage ran (quantize_block / quantize_head are
        # quantize_weights and the head's quantize_weight, Viterbi, LDL and refit included).
        results["stage_peak_device_gb"] = timer.peaks_gb()
    stages = timer.stages()
    block_s = [b["seconds"] for b in report.blocks if "seconds" in b]
    mean_block = sum(block_s) / max(len(block_s), 1)
    results["measured"] = {
        "layers": layers,
        "wall_min": round(wall / 60, 2),
        "stages_min": {k: round(v / 60, 2) for k, v in stages.items()},
        "block_s": [round(b, 1) for b in block_s],
        "viterbi_tiles": timer.viterbi_tiles,
        "viterbi_tiles_per_s": round(timer.viterbi_tiles / stages["viterbi"], 1)
        if stages["viterbi"]
        else None,
        "bits": report.bits,
    }
    if layers < full_layers:
        # Everything outside the blocks (load, calibration, head, writing) is taken as is; the
        # blocks and the sensitivity pre-pass (one pass per layer) scale with their count.
        per_layer = mean_block + stages["sensitivity"] / layers
        est = wall + (full_layers - layers) * per_layer
        results["extrapolated_full_model"] = {
            "layers": full_layers,
            "wall_min": round(est / 60, 2),
            "note": f"EXTRAPOLATED from {layers} of {full_layers} layers (mean block {mean_block:.1f} s "
            f"+ sensitivity {stages['sensitivity'] / layers:.1f} s per layer)",
        }
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)

    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


def register(sub) -> None:
    from engine.commands.convert import add_quantizer_args, add_states_arg, add_tf32_arg
    from engine.convert.options import ALLOCATIONS
    from engine.exl3.codebooks import CODEBOOKS

    p = sub.add_parser("convert-bench", help=help_for("convert-bench"), description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3.2-1b", help="model shape (engine.shapes)")
    p.add_argument("--bpw", type=float, default=4.0, help="target bits per weight")
    p.add_argument("--head-bits", type=int, default=6)
    p.add_argument("--codebook", choices=CODEBOOKS, default="mul1")
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=0, help="convert only the first N layers and extrapolate")
    p.add_argument("--cal-rows", type=int, default=250, help="calibration rows (converter default 250)")
    p.add_argument("--cal-cols", type=int, default=2048, help="tokens per row (converter default 2048)")
    p.add_argument("--allocation", choices=ALLOCATIONS, default="sensitivity", help="bit allocation")
    p.add_argument("--seed", type=int, default=0)
    add_tf32_arg(p)
    add_quantizer_args(p)
    add_states_arg(p)
    p.add_argument("--workdir", help="where to write the model and output (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--no-kernel-bench", dest="kernel_bench", action="store_false")
    p.add_argument("--kernel-tiles", type=int, default=16384, help="tiles for the kernel throughput run")
    p.add_argument("--torch-tiles", type=int, default=256, help="tiles for the torch path's throughput run")
    p.add_argument("--json", help="write the results here")
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    return run_alone(register, "convert-bench", argv)


if __name__ == "__main__":
    raise SystemExit(main())
