"""The work directory, ``<out>/.exl3_work/``: what a conversion keeps so it can be resumed.

It holds ``job.json`` (the source and the options that change the result: a resume must match
them), ``allocation.json`` (the bits chosen, engine.convert.bit_plan), the model-written
calibration rows where there are any (engine.convert.self_calibration) and each finished block's
tensors, until the output is written and the directory removed. A block file is written under
another name and renamed, so it is whole or absent: a full disk or a kill mid-write never leaves
one that breaks ``--resume``.
"""

from __future__ import annotations

import contextlib
import errno
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.convert.errors import ConvertError
from engine.convert.options import ConvertOptions

if TYPE_CHECKING:
    from engine.loading.safetensors_store import WeightStore

WORK_DIR = ".exl3_work"
JOB_FILE = "job.json"
ALLOCATION_FILE = "allocation.json"


def block_file(work: Path, index: int) -> Path:
    """Where a finished block's tensors wait in the work directory until the output is written."""
    return work / f"block_{index:04d}.safetensors"


def finished_blocks(work: Path) -> int:
    """How many finished blocks the work directory holds (0 where there is none)."""
    return len(list(work.glob("block_*.safetensors"))) if work.is_dir() else 0


def open_work_dir(src: Path, dst: Path, options: ConvertOptions, resume: bool) -> Path:
    """The work directory of converting ``src`` into ``dst``, made and stamped with this job.
    Earlier work there is refused unless ``resume``, and then only when it is this same job."""
    work = dst / WORK_DIR
    job_file = work / JOB_FILE
    job = {"source": str(src.resolve()), "options": options.job_key()}
    # An earlier run that saved nothing worth keeping (it stopped before the bit allocation, e.g.
    # on a bad source file) does not stand in the way of a fresh one.
    saved_work = (work / ALLOCATION_FILE).exists() or finished_blocks(work) > 0
    if saved_work and not resume:
        raise ConvertError(f"{work} holds an earlier run's work: pass --resume to continue it, or remove it")
    if resume and job_file.exists():
        previous = json.loads(job_file.read_text())
        if previous != job:
            raise ConvertError(f"cannot resume: {job_file} was made with different options or source")
    work.mkdir(parents=True, exist_ok=True)
    job_file.write_text(json.dumps(job, indent=1))
    return work


def save_block(work: Path, index: int, tensors: dict[str, torch.Tensor]) -> None:
    """Write block ``index``'s stored tensors to its file, whole or not at all."""
    from safetensors.torch import save_file

    saved = block_file(work, index)
    with disk_errors(saved, work):
        partial = saved.with_suffix(".partial")
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(partial))
        partial.replace(saved)


def load_block(work: Path, index: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Block ``index``'s stored tensors as an earlier run saved them, on ``device``."""
    from safetensors.torch import load_file

    return load_file(str(block_file(work, index)), device=str(device))


def finished_store(work: Path, n_blocks: int) -> WeightStore:
    """The finished blocks' tensors as one weight store (read lazily, a tensor at a time)."""
    from engine.loading.safetensors_store import WeightStore

    return WeightStore(work, [block_file(work, i) for i in range(n_blocks)])


@contextlib.contextmanager
def disk_errors(path: Path, work: Path) -> Iterator[None]:
    """An OSError while writing ``path`` (a full disk, a lost mount) becomes a ConvertError that
    says what is kept and how to go on: the finished blocks in ``work`` stay, and a rerun with
    --resume starts after them."""
    try:
        yield
    except OSError as exc:
        blocks = finished_blocks(work)
        cause = "no space left on the device" if exc.errno == errno.ENOSPC else exc.strerror or str(exc)
        raise ConvertError(
            f"cannot write {path}: {cause}. The {blocks} finished block(s) in {work} are kept; "
            "free some space (or fix the cause) and rerun the same command with --resume"
        ) from exc


__all__ = [
    "ALLOCATION_FILE",
    "JOB_FILE",
    "WORK_DIR",
    "block_file",
    "disk_errors",
    "finished_blocks",
    "finished_store",
    "load_block",
    "open_work_dir",
    "save_block",
]
