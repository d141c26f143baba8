"""Convert an HF model directory to EXL3, block by block (issue 3; docs/EXL3_FORMAT.md sections 1-3, 9).

:func:`convert_model` is the whole job, one step per module:

1. The calibration token rows (shipped text, random-token rows, optionally model-written rows:
   :mod:`~engine.convert.calibration_rows`) are embedded once.
2. Bits per linear (:mod:`~engine.convert.bit_plan`): measured by a sensitivity pre-pass and
   spent by a greedy knapsack (the default), or uniform with a kind priority.
3. For each decoder block, the block's linears record their input Hessians ``E[x^T x]`` while the
   *unquantized* block runs, every linear is quantized and swapped for an EXL3 linear
   (:mod:`~engine.convert.block_quantizer`), and the *quantized* block produces the next block's
   input (errors propagate as they will at inference). The relative Frobenius error of the
   quantized block's output against the unquantized one is reported per block.
4. The head is quantized at ``head_bits`` (:mod:`~engine.convert.head`) and the output directory
   is written in the reference layout (:mod:`~engine.convert.output`).

Mixture of experts: every expert's gate/up/down is an ordinary linear here, keyed one per expert
(also where the source fused them), and quantized with the Hessian of the calibration tokens the
unquantized router sent it; an expert that got fewer tokens than its input width has that
Hessian filled towards the identity (:class:`~engine.convert.hessians.HessianHook`). Routers (and
Qwen2-MoE's shared-expert gate) are copied in fp16, unquantized, as ExLlamaV3 keeps them.

Memory: the source model is never loaded whole. Its blocks are read from the checkpoint onto
the device one at a time, in float32 (:mod:`~engine.convert.source_model`), so the weights need
the largest block's memory (the embedding lookup runs on the host). The calibration hidden states
(``cal_rows x cal_cols x hidden`` floats, two copies while a block runs) stay on the device where
they fit, and in host memory where they do not (:mod:`~engine.convert.host_states`). The output is
written a shard at a time (placeholders for the finished blocks' tensors until then).

Resume: each finished block's tensors go to ``<out>/.exl3_work/``
(:mod:`~engine.convert.checkpoints`); a rerun with ``resume`` loads them (after checking the job
options match) and only re-runs the quantized block forward. The chosen bits are saved there too,
so a resumed run does not redo the pre-pass and cannot disagree with the blocks already written.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.convert.bit_plan import plan_bits
from engine.convert.block_quantizer import install_quantized, quantize_block
from engine.convert.block_runner import (
    block_device,
    calibration_matmuls,
    relative_frobenius,
    rows_per_chunk,
    run_block,
)
from engine.convert.calibration_rows import calibration_rows
from engine.convert.checkpoints import (
    block_file,
    disk_errors,
    finished_store,
    load_block,
    open_work_dir,
    save_block,
)
from engine.convert.errors import ConvertError
from engine.convert.head import quantize_head
from engine.convert.host_states import HostPins, state_device
from engine.convert.options import ConvertOptions
from engine.convert.output import output_modules, quantization_config, write_output
from engine.convert.source_model import SourceModel
from engine.units import format_duration


@dataclass
class ConvertReport:
    bits: float = 0.0
    blocks: list[dict] = field(default_factory=list)
    head: dict = field(default_factory=dict)
    seconds: float = 0.0
    sensitivity: dict = field(default_factory=dict)  # key -> the pre-pass's Sensitivity, as a dict


def convert_model(
    src: str | Path,
    dst: str | Path,
    options: ConvertOptions,
    resume: bool = False,
    log: Callable[[str], None] = print,
    progress: Callable[[float, str], None] | None = None,
) -> ConvertReport:
    """Convert ``src`` (HF directory) to an EXL3 directory ``dst``: the steps of the module
    docstring. ``resume`` continues the job whose work directory ``dst`` holds.
    ``progress(fraction, message)``, if given, follows the blocks (with an ETA) to 1.0 at the end."""
    from engine.architectures import architecture_for
    from engine.config import ModelConfig
    from engine.loading.read_dequantized import dequantized_on_load
    from engine.model import resolve_device

    t_start = time.perf_counter()
    progress = progress or (lambda fraction, message: None)
    src, dst = Path(src), Path(dst)
    device = resolve_device(options.device)
    config = ModelConfig.from_dir(src)
    # MXFP4 (gpt-oss's experts) is read dequantized, exactly: a source like an unquantized one.
    if config.quantization and not dequantized_on_load(config.quantization):
        raise ConvertError(f"{src} is already quantized ({config.quantization.get('quant_method')})")
    architecture_for(config.architecture)  # an unknown architecture is named before any work
    work = open_work_dir(src, dst, options, resume)
    with calibration_matmuls(device, options.tf32), HostPins(device, log) as pins:
        log(f" -- reading {config.architecture} from {src}: its blocks go to {device} one at a time")
        source = SourceModel(src, device)
        spec, blocks = source.spec, source.blocks
        ids = calibration_rows(src, work, options, spec.vocab_size, device, log, progress)
        chunk_rows = rows_per_chunk(
            options.cal_cols, int(config.get("intermediate_size") or 4 * spec.hidden_size)
        )
        # Tuning towards the unquantized model keeps its hidden state too: a third copy of the states.
        tune_to_model = options.tune_steps > 0 and options.tune_target == "model"
        copies = 3 if tune_to_model else 2
        home = state_device(options.states, device, ids.shape, source.state_width, copies, source.slots, log)
        hidden = source.embed_rows(ids, home)
        pins.pin(hidden)  # host states: page-locked for PCIe-speed copies (HostPins)
        achieved, sensitivities = plan_bits(
            blocks, source.slots, hidden, chunk_rows, options, work, log, device
        )
        report = ConvertReport(bits=round(achieved, 2))
        report.sensitivity = {key: asdict(sens) for key, sens in sensitivities.items()}
        n_blocks, block_times = len(blocks), []
        progress(0.0, f"block 0/{n_blocks}")  # the head and the output count as one more block
        # The unquantized model's hidden state, for tuning towards it (tune_target "model").
        exact = hidden.clone() if tune_to_model else None
        if exact is not None:
            pins.pin(exact)
        # The unquantized block's output: one buffer for every block (host states are then not
        # allocated and page-faulted in again for each block), made when the first block needs it.
        reference: torch.Tensor | None = None
        for i, (block, slots) in enumerate(zip(blocks, source.slots)):
            t0 = time.perf_counter()
            if exact is not None:
                with torch.inference_mode():
                    exact = run_block(block, exact, chunk_rows, in_place=True)
            if resume and block_file(work, i).exists():
                install_quantized(slots, load_block(work, i, device))
                with torch.inference_mode():
                    hidden = run_block(block, hidden, chunk_rows, in_place=True)
                log(f" -- block {i}: resumed from {block_file(work, i).name}")
                report.blocks.append({"block": i, "resumed": True})
                progress((i + 1) / (n_blocks + 1), f"block {i + 1}/{n_blocks} (resumed)")
                continue
            if reference is None:
                reference = torch.empty_like(hidden)
                pins.pin(reference)
            tensors, lines = quantize_block(
                block, slots, hidden, reference, exact, sensitivities, options, i, chunk_rows, device, log
            )
            with torch.inference_mode():
                hidden = run_block(block, hidden, chunk_rows, in_place=True)
            rfn = relative_frobenius(hidden, reference, chunk_rows, block_device(block))
            save_block(work, i, tensors)
            dt = time.perf_counter() - t0
            block_times.append(dt)
            remaining = (n_blocks - i - 1) * (sum(block_times) / len(block_times))
            for line in lines:
                log(line)
            log(f" -- block {i + 1}/{n_blocks}: rfn={rfn:.6f}  [{dt:.1f} s]  ETA {remaining:.0f} s")
            report.blocks.append({"block": i, "rfn": rfn, "seconds": dt, "bits": [s.bits for s in slots]})
            progress((i + 1) / (n_blocks + 1), f"block {i + 1}/{n_blocks}, ETA {format_duration(remaining)}")

        # The head needs only the quantized model's state: let the other copies go first (on the
        # device they would otherwise sit beside the head's quantization, its largest step).
        for spare in (reference, exact):
            if spare is not None:
                pins.unpin(spare)
        reference = exact = spare = None
        head, report.head = quantize_head(source, source.stream(hidden), options, chunk_rows, device, log)

        # The finished blocks' tensors stay in their work files until their shard is written.
        blocks.release()
        finished = finished_store(work, n_blocks)
        placeholders = {key: finished.meta(key) for key in finished.keys()}
        modules = output_modules(source, placeholders, head, options.head_bits)
        with disk_errors(dst, work):
            qc = quantization_config(options, report.bits)
            write_output(src, dst, modules, qc, options.codebook, options.shard_size_mb, finished.get)
        del finished  # closes the work files (Windows cannot remove a file that is open)
        shutil.rmtree(work)
    report.seconds = time.perf_counter() - t_start
    log(f" -- wrote {dst} ({report.bits:.2f} bits/weight, {report.seconds:.1f} s)")
    progress(1.0, f"done in {format_duration(report.seconds)}")
    return report


__all__ = ["ConvertReport", "convert_model"]
