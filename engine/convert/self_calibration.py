"""Calibration rows the model writes itself.

The Hessians LDLQ minimises against are only as good as the activations they are estimated from,
and shipped text can only be as varied as what the project writes itself (its licence must be
clean). The model being converted can write more text of the kind it reads: each generated row
is a run of short segments, each a snippet of the calibration text (so the topics, languages and
code of that text steer it) continued by the model's own sampled tokens. This is
"self-calibration" (Williams et al., 2025), which found model-written calibration data about as
good as real text. Measured on SmolLM2 at 4.0 bpw over 3 seeds (docs/PERFORMANCE.md, converter
quality), 90% model-written rows continuing snippets of the earlier 100 KB text gave mean KL
0.0917, against 0.0931 for the 1.7 MB of text now shipped, but perplexity from +4.7% to +10.1%
(the text: +4.6% to +5.6%), so it stays opt-in (``--generated-rows``).

The rows are drawn once per conversion with the continuous-batching generator on the converter's
device, seeded by the conversion's seed, and kept in the work directory so a resumed conversion
calibrates on the very same rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.cache.paged import kv_bytes_per_token
from engine.units import format_duration

SEGMENT_TOKENS = 256  # one generated segment: snippet + continuation
SNIPPET_TOKENS = 16  # tokens of shipped text that start each segment
TEMPERATURE = 1.0
TOP_P = 0.95
ROWS_FILE = "calibration_generated.safetensors"


def _batch_size(loaded, segment: int) -> int:
    """Jobs at once: many (eager steps are launch-bound), within a quarter of free device memory."""
    if loaded.device.type != "cuda":
        return 16
    per_token = kv_bytes_per_token(loaded.spec, dense_bytes=loaded.dtype.itemsize)
    free, _ = torch.cuda.mem_get_info(loaded.device)
    return int(max(8, min(256, free // 4 // (per_token * segment))))


def generate_rows(
    loaded,
    text_ids: torch.Tensor,
    rows: int,
    cols: int,
    seed: int,
    segment: int = SEGMENT_TOKENS,
    log: Callable[[str], None] = print,
    progress: Callable[[float, str], None] | None = None,
) -> torch.Tensor:
    """``(rows, cols)`` token ids: each row ``cols // segment`` (at least one) segments, each a
    ``SNIPPET_TOKENS``-token snippet of ``text_ids`` (a 1-D tensor of calibration-text tokens)
    continued by the model's samples (temperature 1, top-p 0.95, no stop token) to ``segment``
    tokens; the last segment of a row is cut or extended to fill it exactly. ``progress(fraction,
    message)`` follows the finished segments, with an ETA."""
    from engine.generation.generator import Generator
    from engine.generation.job import Job
    from engine.generation.sampling import SamplingSettings
    from engine.options import EngineOptions

    segment = max(SNIPPET_TOKENS + 1, min(segment, cols))
    per_row = -(-cols // segment)
    n_jobs = rows * per_row
    gen = torch.Generator().manual_seed(seed)
    snippet = min(SNIPPET_TOKENS, max(1, text_ids.numel() - 1))
    starts = torch.randint(0, max(1, text_ids.numel() - snippet), (n_jobs,), generator=gen)
    job_seeds = torch.randint(0, 2**31 - 1, (n_jobs,), generator=gen)
    jobs = [
        Job(
            input_ids=text_ids[s : s + snippet].tolist(),
            max_new_tokens=segment - snippet,
            sampling=SamplingSettings(temperature=TEMPERATURE, top_p=TOP_P, seed=int(js)),
            stop_token_ids=(),
        )
        for s, js in zip(starts.tolist(), job_seeds.tolist(), strict=True)
    ]
    batch = min(_batch_size(loaded, segment), n_jobs)
    options = EngineOptions(cuda_graphs=False)
    generator = Generator(loaded, cache_tokens=batch * segment, max_batch_size=batch, options=options)
    what = f"{n_jobs} segments of {segment} tokens, {batch} at once"
    log(f" -- calibration: the model writes {rows} rows ({what})")
    written = _run_jobs(generator, jobs, progress or (lambda fraction, message: None))
    del generator
    if loaded.device.type == "cuda":
        torch.cuda.empty_cache()
    segments = [list(job.input_ids) + written[job] for job in jobs]
    out = torch.empty(rows, cols, dtype=torch.long)
    for r in range(rows):
        row = [t for seg in segments[r * per_row : (r + 1) * per_row] for t in seg]
        row = row * -(-cols // len(row))  # a context shorter than the row: repeat its segments
        out[r] = torch.tensor(row[:cols], dtype=torch.long)
    return out


def _run_jobs(generator, jobs: list, progress: Callable[[float, str], None]) -> dict:
    """Every job's new tokens, reporting the finished ones as they come."""
    for job in jobs:
        generator.enqueue(job)
    written = {job: [] for job in jobs}
    done, t0 = 0, time.perf_counter()
    progress(0.0, f"calibration text 0/{len(jobs)} segments")
    while generator.num_remaining_jobs:
        finished = 0
        for result in generator.iterate():
            written[result.job] += result.token_ids
            finished += result.done
        if finished:
            done += finished
            eta = format_duration((time.perf_counter() - t0) * (len(jobs) - done) / done)
            progress(done / len(jobs), f"calibration text {done}/{len(jobs)} segments, ETA {eta}")
    return written


def load_or_generate_rows(
    work: Path,
    load_model: Callable[[], object],
    text_ids: torch.Tensor,
    rows: int,
    cols: int,
    seed: int,
    log: Callable[[str], None] = print,
    progress: Callable[[float, str], None] | None = None,
) -> torch.Tensor:
    """:func:`generate_rows`, saved in ``work`` the first time and read back on a resume.
    ``load_model()`` gives the whole model to write with; it is called (and the model dropped
    again) only when the rows are written, since the converter itself holds one block at a time."""
    from safetensors.torch import load_file, save_file

    path = work / ROWS_FILE
    if path.is_file():
        saved = load_file(str(path))["ids"]
        if tuple(saved.shape) == (rows, cols):
            log(f" -- calibration: {rows} model-written rows from {path.name}")
            return saved
    t0 = time.perf_counter()
    loaded = load_model()
    ids = generate_rows(loaded, text_ids, rows, cols, seed, log=log, progress=progress)
    del loaded
    log(f" -- calibration: {rows} rows written in {time.perf_counter() - t0:.1f} s")
    partial = path.with_name(path.name + ".partial")
    save_file({"ids": ids.contiguous()}, str(partial))
    partial.replace(path)
    return ids
