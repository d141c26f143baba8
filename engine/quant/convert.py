"""Convert an HF model directory to EXL3, block by block (issue 3; docs/EXL3_FORMAT.md sections 1-3, 9).

Pipeline: calibration token rows (shipped text + random-token rows) are embedded once. Bits per
linear: with ``allocation="sensitivity"`` (the default) a pre-pass over a subset of those rows
measures what quantizing each linear alone costs its block (:mod:`engine.quant.sensitivity`) and a
greedy knapsack spends the bit budget where it lowers that cost most
(:mod:`engine.quant.allocation`); ``allocation="uniform"`` gives every linear ``floor(bits)`` and
hands fractional extra bits out by a fixed kind priority (:func:`allocate_bits`). Then for
each decoder block, the block's linears record their input Hessians ``E[x^T x]`` while the
*unquantized* block runs, every linear is quantized (:func:`engine.quant.quantize.quantize_weight`)
and swapped for an :class:`EXL3Linear`, and the *quantized* block produces the next block's input
(errors propagate as they will at inference); with ``sequential`` each input group's Hessian
is captured again once the linears before it in the block are quantized. The per-block relative
Frobenius error of the quantized block output against the unquantized block output is reported.
Finally the head is quantized at ``head_bits`` and the output directory is written in the
reference layout, so that ExLlamaV3 and our loader read it alike.

Mixture of experts: every expert's gate/up/down is an ordinary linear here, keyed one per expert
(also where the source fused them), and quantized with the Hessian of the calibration tokens the
unquantized router sent it; an expert that got fewer tokens than its input width has that
Hessian filled towards the identity (:class:`_HessianHook`). Routers (and Qwen2-MoE's
shared-expert gate) are copied in fp16, unquantized, as ExLlamaV3 keeps them.

Memory: the source model is never loaded whole. Its blocks are read from the checkpoint onto
the device one at a time, in float32 (:mod:`engine.quant.source_model`), so the weights need the
largest block's memory (the embedding lookup runs on the host). The calibration hidden states
(``cal_rows x cal_cols x hidden`` floats, two copies while a block runs) stay on the device where
they fit, and in host memory where they do not (``states``, :func:`state_device`). The output is
written a shard at a time (placeholders for the finished blocks' tensors until then).

Resume: each finished block's tensors go to ``<out>/.exl3_work/``; a rerun with ``resume`` loads
them (after checking the job options match) and only re-runs the quantized block forward. The
chosen bits are saved there too (``allocation.json``), so a resumed run does not redo the
pre-pass and cannot disagree with the blocks already written.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

import engine
from engine.errors import EngineError
from engine.quant.allocation import achieved_bits
from engine.quant.codebooks import CODEBOOKS, FLAG_VALUES, INST3, MCG, MUL1
from engine.quant.exl3_linear import EXL3Linear
from engine.quant.finetune import ScaledCore, TuneOptions, make_trainable, tune_block_scales
from engine.quant.quantize import (
    QuantizedTensors,
    WeightJob,
    quantize_weight,
    quantize_weights,
    stored_tensor_count,
)

WORK_DIR = ".exl3_work"
CALIBRATION_DIR = Path(__file__).parent / "calibration"
# Files never copied from the source directory (section 1).
_SKIP_SUFFIXES = (".safetensors", ".bin", ".ckpt", ".pth", ".pt")
_SKIP_NAMES = ("config.json", "model.safetensors.index.json", "quantization_config.json")
# Which projections get the extra bit first when the target is fractional: attention values and
# outputs and the MLP down projection are the most sensitive in published ablations; the wide
# gate/up projections are cheapest to keep at the lower K.
_BIT_PRIORITY = ("v", "o", "down", "k", "q", "gate", "up")
ALLOCATIONS = ("sensitivity", "uniform")
ALLOCATION_FILE = "allocation.json"
TUNE_TARGETS = ("block", "model")


def block_file(work: Path, index: int) -> Path:
    """Where a finished block's tensors wait in the work directory until the output is written."""
    return work / f"block_{index:04d}.safetensors"


def finished_blocks(work: Path) -> int:
    """How many finished blocks the work directory holds (0 where there is none)."""
    return len(list(work.glob("block_*.safetensors"))) if work.is_dir() else 0


class ConvertError(EngineError):
    """The conversion cannot proceed (unsupported model, mismatched resume, bad options)."""


@dataclass
class ConvertOptions:
    bits: float
    head_bits: int = 6
    codebook: str = MUL1
    cal_rows: int = 250
    cal_cols: int = 2048
    random_rows_fraction: float = 0.1
    out_scales: bool = True
    seed: int = 0
    shard_size_mb: int = 8192
    device: str = "auto"
    # "sensitivity": measured per-linear bits (module docstring); "uniform": the kind priority.
    allocation: str = "sensitivity"
    sensitivity_rows: int = 32  # calibration rows the sensitivity pre-pass runs over
    tf32: bool = True  # calibration matmuls on TF32 tensor cores (CUDA; see calibration_matmuls)
    damping: float = 0.01  # Hessian damping relative to its mean diagonal (engine.quant.ldl)
    refit: bool = True  # refit suh/svh to the chosen trellis (engine.quant.refit)
    tune_steps: int = 0  # Adam steps tuning each block's scales to its output (engine.quant.finetune)
    # What the tuning aims at: "block", the unquantized block on the quantized model's inputs;
    # "model", the unquantized model's own hidden state there (also undoes earlier blocks' error,
    # at one more block forward and one more hidden-state buffer).
    tune_target: str = "block"
    tune_lr: float = 1e-3  # Adam's learning rate on the scale multipliers' offsets
    # Capture each input group's Hessian after the groups before it in the block are quantized
    # (o_proj sees the quantized q/k/v, down the quantized gate/up): see input_groups.
    sequential: bool = False
    # Calibration text: a file, or a folder whose files are read in name order ("" = the text
    # shipped in engine/quant/calibration).
    cal_text: str = ""
    # Share of the text rows the model writes itself, continuing snippets of the calibration
    # text (engine.quant.self_calibration); the rest are the text itself.
    generated_rows: float = 0.0
    # Where the calibration hidden states live: "device", "host" (CPU memory; each chunk of rows
    # goes to the device to run), or "auto": the device where they fit (see state_device).
    states: str = "auto"

    def job_key(self) -> dict:
        """The options that change the result (a resume must match them). Device, shard size,
        TF32 and where the states live do not: blocks converted either way can be assembled into
        one model."""
        d = asdict(self)
        for key in ("device", "shard_size_mb", "tf32", "states"):
            d.pop(key)
        # Options added later are left out where they are off, so a job started before they
        # existed still resumes.
        for key, off in (("cal_text", ""), ("generated_rows", 0.0)):
            if d[key] == off:
                d.pop(key)
        return d


@dataclass
class LinearSlot:
    """One quantizable linear: where it sits in the module tree and its checkpoint key."""

    key: str
    kind: str  # q, k, v, o, gate, up, down
    parent: nn.Module | None  # None while its block is not built (engine.quant.source_model)
    attr: str  # attribute name on parent, or index into parent (a ModuleList) as str
    in_features: int
    out_features: int
    bits: int = 0
    # A mixture-of-experts expert's linear: its inputs are only the tokens the router sends it,
    # so its Hessian may rest on few rows (see _HessianHook).
    routed: bool = False

    def get(self) -> nn.Module:
        return self.parent[int(self.attr)] if self.attr.isdigit() else getattr(self.parent, self.attr)

    def set(self, module: nn.Module) -> None:
        if self.attr.isdigit():
            self.parent[int(self.attr)] = module
        else:
            setattr(self.parent, self.attr, module)


@dataclass
class ConvertReport:
    bits: float = 0.0
    blocks: list[dict] = field(default_factory=list)
    head: dict = field(default_factory=dict)
    seconds: float = 0.0
    sensitivity: dict = field(default_factory=dict)  # key -> the pre-pass's Sensitivity, as a dict


# -- calibration --------------------------------------------------------------------------


def calibration_text(source: str | Path = "") -> str:
    """The calibration text: the shipped files, or ``source`` (a UTF-8 file, or a folder whose
    regular, non-hidden files are read in name order)."""
    if not source:
        files = sorted(CALIBRATION_DIR.glob("*.txt"))
    else:
        path = Path(source)
        if path.is_dir():
            files = sorted(f for f in path.iterdir() if f.is_file() and not f.name.startswith("."))
        elif path.is_file():
            files = [path]
        else:
            raise ConvertError(f"calibration text {path} does not exist")
    parts = []
    for f in files:
        try:
            parts.append(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            reason = f"{e.reason} at byte {e.start}"
            raise ConvertError(f"calibration text {f} is not UTF-8 text ({reason})") from e
    text = "\n\n".join(parts)
    if not text.strip():
        raise ConvertError(f"calibration text {source or CALIBRATION_DIR} is empty")
    return text


def n_random_rows(rows: int, random_fraction: float) -> int:
    """How many of ``rows`` calibration rows are random tokens (at least one of several)."""
    return min(rows, max(1 if rows > 1 else 0, round(rows * random_fraction)))


def replaced_text_rows(text_rows: int, n_generated: int) -> list[int]:
    """Which of ``text_rows`` text rows (in text order) make way for ``n_generated`` written by the
    model: all but ``text_rows - n_generated`` evenly spaced ones."""
    n_keep = text_rows - n_generated
    keep = {i * text_rows // n_keep for i in range(n_keep)} if n_keep > 0 else set()
    return [r for r in range(text_rows) if r not in keep]


def calibration_ids(
    model_dir: Path,
    rows: int,
    cols: int,
    vocab: int,
    random_fraction: float,
    seed: int,
    text_source: str | Path = "",
) -> torch.Tensor:
    """``(rows, cols)`` token ids: the calibration text (:func:`calibration_text`) tokenized and cut
    into rows, plus random-token rows.

    ``random_fraction >= 1`` makes every row random, and then no tokenizer is needed (timing
    runs on random-weight models, ``engine.commands.convert_bench``).
    """
    gen = torch.Generator().manual_seed(seed)
    n_random = n_random_rows(rows, random_fraction)
    ids: list[int] = []
    if n_random < rows:
        from tokenizers import Tokenizer

        tok_path = model_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise ConvertError(f"{model_dir} has no tokenizer.json (needed for calibration)")
        tokenizer = Tokenizer.from_file(str(tok_path))
        ids = [i for i in tokenizer.encode(calibration_text(text_source)).ids if i < vocab]
    out = torch.empty(rows, cols, dtype=torch.long)
    stream = torch.tensor(ids * (cols // max(len(ids), 1) + 2), dtype=torch.long)
    # Rows start at different offsets so they are not identical copies; a text longer than the
    # rows need is sampled evenly over its whole length rather than only its beginning.
    stride = max(997, len(ids) // max(rows - n_random, 1))
    for r in range(rows - n_random):
        start = (r * stride) % max(len(ids), 1)
        out[r] = stream[start : start + cols]
    if n_random:
        out[rows - n_random :] = torch.randint(0, vocab, (n_random, cols), generator=gen)
    return out


# -- running a block over calibration rows --------------------------------------------------


def block_device(block: nn.Module) -> torch.device:
    """The device a block's weights are on (where it runs)."""
    return next(t for t in (*block.parameters(), *block.buffers())).device


def run_rows(block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """One DecoderBlock over ``hidden`` ``(n, cols, dim)``, each row its own causal sequence, in one
    forward (autograd sees through it where its inputs or weights need gradients). It runs where
    the block is; the output goes where ``hidden`` is (the host, when the states are kept there)."""
    return forward_rows(block, hidden).to(hidden.device)


def forward_rows(block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """:func:`run_rows` with the output left on the block's device: what runs there next (the
    tuning loss, a norm, a copy into a page-locked host buffer) then reads it without a round trip
    through host memory, and computes the same numbers whether the states live on the host or
    on the device."""
    from engine.cache.paged import PagedKVCache
    from engine.modules.batch import BatchLayout, SequenceSlice

    n, cols, dim = hidden.shape
    device = block_device(block)
    hidden = hidden.to(device, non_blocking=True)  # page-locked host states copy asynchronously
    # The state the block's mixer declares, for n sequences: one page per row (row i owns slots
    # i*cols .. (i+1)*cols - 1), and row i's recurrent state in slot i.
    cache = PagedKVCache.for_layers([block.state], n, cols, hidden.dtype, device, max_sequences=n).layer(0)
    seqs = [
        SequenceSlice(i * cols, cols, 0, torch.arange(i * cols, (i + 1) * cols, device=device), state_slot=i)
        for i in range(n)
    ]
    positions = torch.arange(cols, device=device).repeat(n)
    batch = BatchLayout(seqs, positions, torch.arange(n * cols, device=device))
    return block(hidden.reshape(n * cols, dim), batch, cache).view(n, cols, dim)


STATE_PLACES = ("auto", "device", "host")
STATE_SHARE = 0.6  # "auto" keeps the states on the device while they take at most this share of it


def state_device(
    place: str,
    device: torch.device,
    shape: torch.Size | tuple[int, int],
    hidden_size: int,
    copies: int,
    per_block: list[list[LinearSlot]],
    log: Callable[[str], None],
) -> torch.device:
    """Where the calibration hidden states go: ``copies`` float32 buffers of ``shape`` rows x cols
    x ``hidden_size`` (the input and the unquantized output of the block being converted, and the
    unquantized model's state when tuning towards it). ``place`` "auto" puts them on a CUDA
    device while they and the largest block's float32 weights take at most :data:`STATE_SHARE` of
    its free memory (the rest is for the Hessians, the quantizer and the forward's activations),
    otherwise on the host."""
    need = copies * shape[0] * shape[1] * hidden_size * 4 / 1e9  # GB
    if device.type != "cuda":
        return device  # a CPU conversion: the host is the device
    if place == "device":
        log(f" -- calibration states: {need:.1f} GB on {device} (--states device)")
        return device
    if place == "host":
        log(f" -- calibration states: {need:.1f} GB in host memory (--states host)")
        return torch.device("cpu")
    block = max(sum(s.in_features * s.out_features for s in slots) for slots in per_block) * 4 / 1e9
    free = torch.cuda.mem_get_info(device)[0] / 1e9
    if need + block <= STATE_SHARE * free:
        log(f" -- calibration states: {need:.1f} GB on {device} ({free:.1f} GB free)")
        return device
    log(
        f" -- calibration states: {need:.1f} GB in host memory: with the largest block ({block:.1f} "
        f"GB) they would take more than {STATE_SHARE:.0%} of the {free:.1f} GB free on {device}"
    )
    return torch.device("cpu")


def _run_block(
    block: nn.Module,
    hidden: torch.Tensor,
    chunk_rows: int,
    in_place: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run one DecoderBlock over ``hidden`` ``(rows, cols, dim)`` in chunks of ``chunk_rows``;
    ``in_place`` writes each chunk's output over its input (every row is its own sequence, so a
    chunk is read whole before it is written), which saves a copy of the states; ``out`` (a buffer
    like ``hidden``) receives the output instead of a new one, so host states are not allocated
    (and page-faulted in) again for every block.

    Host states on a CUDA device: each chunk's output is copied straight from the device into its
    rows of ``out`` without waiting (from page-locked memory that runs while the next chunk is
    queued); one synchronisation at the end makes ``out`` readable."""
    if out is None:
        out = hidden if in_place else torch.empty_like(hidden)
    device = block_device(block)
    asynchronous = out.device.type == "cpu" and device.type == "cuda"
    for r0 in range(0, hidden.shape[0], chunk_rows):
        rows = forward_rows(block, hidden[r0 : r0 + chunk_rows])
        out[r0 : r0 + chunk_rows].copy_(rows, non_blocking=asynchronous)
    if asynchronous:
        torch.cuda.synchronize(device)
    return out


def relative_frobenius(
    output: torch.Tensor, reference: torch.Tensor, chunk_rows: int, device: torch.device
) -> float:
    """``||output - reference|| / ||reference||`` over states ``(rows, cols, dim)``, a chunk of
    ``chunk_rows`` rows at a time on ``device`` with float64 sums: no state-sized temporary (8.4 GB
    for an 8B model's calibration), and the same number whether the states live on the host or on
    the device (a float32 norm over 2e9 host values is off in the third digit)."""
    num = torch.zeros((), dtype=torch.float64, device=device)
    den = torch.zeros((), dtype=torch.float64, device=device)
    for r0 in range(0, reference.shape[0], chunk_rows):
        ref = reference[r0 : r0 + chunk_rows].to(device).double()
        num += (output[r0 : r0 + chunk_rows].to(device).double() - ref).pow(2).sum()
        den += ref.pow(2).sum()
    return float(num.sqrt() / den.sqrt()) if float(den) > 0 else 0.0


class HostPins:
    """Page-locks (pins) host tensors in place for fast copies to and from a CUDA ``device``.

    Pageable host memory is copied through a driver staging buffer at a fraction of PCIe speed;
    registering the tensor's own pages (``cudaHostRegister``) pins exactly its bytes, where
    ``pin_memory=True`` would round an 8.4 GB buffer up to a 16 GB power-of-two block. A tensor
    stays referenced here until :meth:`unpin` or :meth:`release` (unregistering freed memory is
    an error). For any other device (a CPU conversion) nothing is touched: CUDA is never
    initialised. Where registration fails the tensor stays pageable (slower, same results) and
    a note is logged."""

    def __init__(self, device: torch.device, log: Callable[[str], None]) -> None:
        self.device = device
        self.log = log
        self._pinned: dict[int, torch.Tensor] = {}  # data pointer -> tensor

    def __enter__(self) -> HostPins:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def pin(self, t: torch.Tensor) -> bool:
        """Page-lock ``t``'s memory (a contiguous host tensor); False where it was not."""
        if self.device.type != "cuda" or t.device.type != "cpu" or t.numel() == 0:
            return False
        ptr = t.data_ptr()
        if ptr in self._pinned:
            return True
        cudart = torch.cuda.cudart()
        register = getattr(cudart, "cudaHostRegister", None)
        if register is None or not t.is_contiguous():
            self.log(" -- note: host states stay in pageable memory (cannot page-lock them here)")
            return False
        err = int(register(ptr, t.numel() * t.element_size(), 0))
        if err != 0:
            clear = getattr(cudart, "cudaGetLastError", None)
            if clear is not None:
                clear()  # the failure is handled here; later kernel checks must not report it
            gb = t.numel() * t.element_size() / 1e9
            self.log(
                f" -- note: could not page-lock {gb:.1f} GB of host states (CUDA error {err}); "
                "they stay pageable: slower copies, same results"
            )
            return False
        self._pinned[ptr] = t
        return True

    def unpin(self, t: torch.Tensor) -> None:
        """Unregister ``t`` (if pinned here) and let go of it."""
        if self._pinned.pop(t.data_ptr() if t.numel() else -1, None) is not None:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())

    def release(self) -> None:
        """Unregister every pinned tensor (before they can be freed)."""
        for t in list(self._pinned.values()):
            self.unpin(t)


class _HessianHook:
    """Accumulates ``sum x^T x`` and the row count of a linear's inputs (a forward pre-hook).

    ``min_rows`` (set for mixture-of-experts experts, which see only the calibration tokens the
    router sends them) is how many rows a Hessian needs to be trusted alone: with fewer, the
    rows missing are filled with the identity at the seen rows' scale (their mean diagonal),
    ``H = (sum x^T x + (min_rows - n) * s * I) / min_rows``. The estimate is thereby shrunk
    towards plain rounding in proportion to what is missing, so a rarely chosen expert is not
    fitted to a rank-deficient few tokens, and one that no calibration token reached is quantized
    with ``H = I`` (no error feedback: each weight rounded on its own, in the Hadamard basis)
    rather than with a zero Hessian. ``min_rows`` is the input width: fewer rows cannot give a
    full-rank estimate.
    """

    def __init__(self, in_features: int, device: torch.device, min_rows: int = 0) -> None:
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.count = 0
        self.min_rows = min_rows

    def __call__(self, module: nn.Module, args: tuple) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        self.sum.addmm_(x.T, x)
        self.count += x.shape[0]

    def hessian(self) -> torch.Tensor:
        h = self.sum / max(self.count, 1)
        if self.count >= self.min_rows:
            return h
        scale = float(h.diagonal().mean()) if self.count else 0.0
        filled = self.count / self.min_rows
        h *= filled
        h.diagonal().add_((1.0 - filled) * (scale if scale > 0 else 1.0))
        return h


def input_groups(slots: list[LinearSlot]) -> list[list[LinearSlot]]:
    """``slots`` grouped by the input they read, in forward order: the projections of one
    ``ModuleList`` (q/k/v, gate/up) read the same input; any other linear reads its own."""
    groups: list[list[LinearSlot]] = []
    seen: dict[int, list[LinearSlot]] = {}
    for s in slots:
        shared = id(s.parent) if s.attr.isdigit() else id(s)
        if shared not in seen:
            seen[shared] = []
            groups.append(seen[shared])
        seen[shared].append(s)
    return groups


def hessian_hooks(
    slots: list[LinearSlot], device: torch.device, stop: bool = False
) -> tuple[dict[str, _HessianHook], list]:
    """One :class:`_HessianHook` per distinct linear input of a block (:func:`input_groups`: one
    ``x^T x`` for q/k/v instead of three), keyed by each slot's key, and the hook handles (remove
    them after the forward). With ``stop``, the last group's hook ends the forward once it has
    its input (:class:`_Captured`): nothing after it is needed."""
    hooks: dict[str, _HessianHook] = {}
    handles = []
    groups = input_groups(slots)
    for j, group in enumerate(groups):
        last = stop and j == len(groups) - 1
        min_rows = group[0].in_features if group[0].routed else 0
        hook = (_StoppingHessianHook if last else _HessianHook)(group[0].in_features, device, min_rows)
        handles.append(group[0].get().register_forward_pre_hook(hook))
        for s in group:
            hooks[s.key] = hook
    return hooks, handles


class _Captured(Exception):
    """Raised by a :class:`_StoppingHessianHook` to cut a capture forward short."""


class _StoppingHessianHook(_HessianHook):
    def __call__(self, module: nn.Module, args: tuple) -> None:
        super().__call__(module, args)
        raise _Captured


def capture_hessians(
    block: nn.Module, hidden: torch.Tensor, slots: list[LinearSlot], chunk_rows: int
) -> dict[str, _HessianHook]:
    """The input Hessians of ``slots`` with the block as it is now (some linears quantized),
    running each chunk of rows only as far as the last of their inputs."""
    hooks, handles = hessian_hooks(slots, block_device(block), stop=True)
    try:
        with torch.inference_mode():
            for r0 in range(0, hidden.shape[0], chunk_rows):
                try:
                    forward_rows(block, hidden[r0 : r0 + chunk_rows])
                except _Captured:
                    pass
    finally:
        for h in handles:
            h.remove()
    return hooks


@contextlib.contextmanager
def calibration_matmuls(device: torch.device, tf32: bool) -> Iterator[None]:
    """Inside, float32 matrix products on ``device`` (the calibration forwards and the Hessians)
    may use TF32 tensor cores when ``tf32`` is set: ~8x the fp32 rate on an H200, products of
    10-bit mantissas accumulated in fp32. On by default (``convert --no-tf32`` for fp32): a
    Llama-3.2-1B shape converts in ~3.0 instead of ~4.6 min on an H200, as fast as ExLlamaV3 1.6.5
    there (3.04 min), and SmolLM2-135M at 4.0 bpw scored the same over 3 seeds (mean KL 0.0946
    against 0.0947 in fp32; docs/PERFORMANCE.md). No effect on CPU."""
    if device.type != "cuda" or not tf32:
        yield
        return
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


# -- model structure -----------------------------------------------------------------------


def unfuse_projections(group: nn.Module) -> None:
    """Make a fused projection (one linear whose output is split, e.g. Phi-3's ``qkv_proj``) one
    dense linear per output, in place, keyed by its ``output_keys``: the reference layout stores
    a fused checkpoint's projections quantized separately under the split names (``q_proj``,
    ``k_proj``, ...), and quantizing them apart gives each its own scales and bits. The outputs
    stay the same. A group without output keys stays fused."""
    from engine.modules.linear import DenseLinear, ProjectionGroup

    if len(group.linears) != 1 or len(group.splits[0]) == 1 or group.output_keys is None:
        return
    fused, sizes = group.linears[0], group.splits[0]
    weights = fused.weight.detach().split(sizes, dim=0)
    biases = fused.bias.detach().split(sizes) if fused.bias is not None else [None] * len(sizes)
    parts = zip(weights, biases, sizes, group.output_keys, strict=True)
    split = ProjectionGroup([(DenseLinear(w.clone(), b, key=k), [n]) for w, b, n, k in parts])
    group.linears, group.splits = split.linears, split.splits


def block_linears(block: nn.Module) -> list[LinearSlot]:
    """The quantizable linears of one decoder block, as its modules list them
    (``quantizable_linears``), under the checkpoint keys they were read from. Fused projections
    are split first (:func:`unfuse_projections`) and keyed by the split names. A
    mixture-of-experts block gives each expert's gate/up/down (keyed one linear per expert,
    whether the source fused them or not) and its shared expert's; its router is not quantized."""
    from engine.modules.linear import ProjectionGroup

    for module in block.modules():
        if isinstance(module, ProjectionGroup):
            unfuse_projections(module)
    slots = []
    for site in block.quantizable_linears():
        linear = site.get()
        slots.append(
            LinearSlot(
                linear.key,
                site.role,
                site.parent,
                site.attr,
                linear.in_features,
                linear.out_features,
                routed=site.routed,
            )
        )
    return slots


def checkpoint_order(block: nn.Module) -> list[str]:
    """The keys of the block's modules read from the checkpoint (linears and norms), in module
    order: the order the output lists them in (EXL3_FORMAT.md section 2)."""
    return [module.key for module in block.modules() if getattr(module, "key", "")]


def _bit_priority(kind: str) -> int:
    """Rank of a linear's kind in :data:`_BIT_PRIORITY`; kinds it does not list come last."""
    return _BIT_PRIORITY.index(kind) if kind in _BIT_PRIORITY else len(_BIT_PRIORITY)


def allocate_bits(slots: list[LinearSlot], target: float) -> float:
    """Integer K per tensor so the weight-averaged bits are as close to ``target`` as possible
    without exceeding it; extra bits go by :data:`_BIT_PRIORITY`, layer by layer. Returns the
    achieved average."""
    if not 1.0 <= target <= 8.0:
        raise ConvertError(f"target bits per weight must be within 1.0..8.0, got {target}")
    base = int(math.floor(target))
    sizes = [s.in_features * s.out_features for s in slots]
    total = sum(sizes)
    for s in slots:
        s.bits = base
    budget = target * total - base * total
    if base < 8:
        order = sorted(range(len(slots)), key=lambda i: _bit_priority(slots[i].kind))
        for i in order:
            if sizes[i] <= budget + 1e-6:
                slots[i].bits += 1
                budget -= sizes[i]
    return achieved_bits(sizes, [s.bits for s in slots])


def _allocate(
    blocks,
    per_block: list[list[LinearSlot]],
    hidden: torch.Tensor,
    chunk_rows: int,
    options: ConvertOptions,
    work: Path,
    log: Callable[[str], None],
    device: torch.device | None = None,
) -> tuple[float, dict]:
    """Set ``bits`` on every slot by ``options.allocation`` and log the result; returns the
    achieved bits per weight and the sensitivities by key (empty for ``uniform`` or when the bits
    come from an earlier run)."""
    from engine.quant.allocation import bits_histogram, greedy_bits, k_range
    from engine.quant.sensitivity import calibration_subset, measure_sensitivity

    all_slots = [s for slots in per_block for s in slots]
    saved = work / ALLOCATION_FILE
    sensitivities: dict = {}
    if saved.is_file():  # a resumed job (job.json matched): reuse the bits it wrote blocks with
        bits = json.loads(saved.read_text())["bits"]
        for s in all_slots:
            s.bits = int(bits[s.key])
        how = "from " + saved.name
    elif options.allocation == "uniform":
        allocate_bits(all_slots, options.bits)
        how = "uniform"
    else:
        lo, hi = k_range(options.bits)
        k_ref = min(max(int(math.floor(options.bits)), lo), hi)
        rows = calibration_subset(hidden.shape[0], options.sensitivity_rows).to(hidden.device)
        log(f" -- sensitivity pre-pass: {len(rows)} rows, K_ref={k_ref}, K in {lo}..{hi}")
        # The subset is the pre-pass's own copy (it may overwrite it); with host states, it and
        # the pre-pass's buffers are page-locked while it runs (HostPins).
        with HostPins(device or hidden.device, log) as pins:
            subset = hidden.index_select(0, rows)
            pins.pin(subset)
            sensitivities = measure_sensitivity(
                blocks,
                per_block,
                subset,
                k_ref,
                chunk_rows,
                range(lo, hi + 1),
                seed=options.seed,
                out_scales=options.out_scales,
                damping=options.damping,
                log=log,
                pin=pins.pin,
                own_hidden=True,
            )
            del subset
        sens = [sensitivities[s.key] for s in all_slots]
        chosen = greedy_bits([x.weights for x in sens], [x.at for x in sens], options.bits)
        for s, k in zip(all_slots, chosen):
            s.bits = k
        how = "sensitivity"
    saved.write_text(json.dumps({"allocation": how, "bits": {s.key: s.bits for s in all_slots}}, indent=1))
    achieved = achieved_bits([s.in_features * s.out_features for s in all_slots], [s.bits for s in all_slots])
    log(
        f" -- bit allocation ({how}): {achieved:.2f} bits/weight, {len(all_slots)} linears "
        f"(target {options.bits}); {bits_histogram([s.bits for s in all_slots])}"
    )
    by_kind: dict[str, list[int]] = {}
    for s in all_slots:
        by_kind.setdefault(s.kind, []).append(s.bits)
    log("    mean K by kind: " + "  ".join(f"{k} {sum(v) / len(v):.2f}" for k, v in by_kind.items()))
    return achieved, sensitivities


# -- output ----------------------------------------------------------------------------------


def _module_entry(tensors: dict[str, torch.Tensor], bits: int | None, codebook: str | None) -> dict:
    entry: dict = {
        "stored_tensors": {
            name: {"shape": list(t.shape), "n_bytes": t.numel() * t.element_size(), "dtype": str(t.dtype)}
            for name, t in tensors.items()
        }
    }
    if bits is not None:
        entry["quant_format"] = "exl3"
        entry["bits_per_weight"] = bits
        if codebook == MUL1:
            entry["mul1_multiplier"] = FLAG_VALUES[MUL1] + (1 << 32)
        elif codebook == MCG:
            entry["mcg_multiplier"] = FLAG_VALUES[MCG] + (1 << 32)
    return entry


def write_output(
    src: Path,
    dst: Path,
    modules: list[tuple[str, dict[str, torch.Tensor], int | None]],
    quant_config: dict,
    codebook: str,
    shard_size_mb: int,
    load: Callable[[str], torch.Tensor] | None = None,
) -> None:
    """Write safetensors shard(s), config.json, quantization_config.json and copied files.
    Tensors on the ``meta`` device are placeholders: ``load(key)`` reads each when its shard is
    written, so at most one shard's worth of them is in memory."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    limit = shard_size_mb * 1024 * 1024
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for _, tensors, _ in modules:  # a module's tensors never straddle shards (section 1)
        n = sum(t.numel() * t.element_size() for t in tensors.values())
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1].update(tensors)
        size += n

    def save(shard: dict[str, torch.Tensor], name: str) -> None:
        real = {k: (load(k) if v.is_meta else v).contiguous().cpu() for k, v in shard.items()}
        save_file(real, str(dst / name))

    if len(shards) == 1:
        save(shards[0], "model.safetensors")
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save(shard, name)
            for k, t in shard.items():
                weight_map[k] = name
                total += t.numel() * t.element_size()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    original = config.get("quantization_config")
    qc = dict(quant_config)
    if original and original.get("quant_method") != "exl3":
        qc["original_quantization_config"] = original
    if "tied_word_embeddings" in config:
        config["tied_word_embeddings"] = True  # section 1, reproduced as the reference does
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config, indent=4))
    storage = {key: _module_entry(t, bits, codebook if bits else None) for key, t, bits in modules}
    (dst / "quantization_config.json").write_text(json.dumps({**qc, "tensor_storage": storage}, indent=4))
    for path in src.iterdir():
        if path.is_file() and path.name not in _SKIP_NAMES and not path.name.endswith(_SKIP_SUFFIXES):
            shutil.copyfile(path, dst / path.name)


# -- the conversion ----------------------------------------------------------------------------


def _fp16_copy(t: torch.Tensor) -> torch.Tensor:
    """Unquantized tensors keep bf16/fp16; fp32 becomes fp16 (section 3.4)."""
    return t.to(torch.float16) if t.dtype == torch.float32 else t


def linear_tensors(tensors: dict[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    """The stored tensors of the linear ``key`` among ``tensors`` (full names, as stored)."""
    return {k: v for k, v in tensors.items() if k.startswith(key + ".")}


def _refit_note(qt: QuantizedTensors) -> str:
    """The scale refit's loss before -> after for a linear's log line ('' when it did not run)."""
    return "" if qt.refit is None else f"  refit {qt.refit.before:.6f}->{qt.refit.after:.6f}"


# Linears of one block are encoded in lockstep (engine.quant.quantize.ldlq_many) up to this many
# weights at once: small strips leave a GPU mostly idle, large ones fill it alone, and every linear
# in flight holds a few float32 copies of itself.
LOCKSTEP_WEIGHTS = 64 << 20


def _quantize_stage(
    slots: list[LinearSlot],
    hooks: dict[str, _HessianHook],
    block_tensors: dict[str, torch.Tensor],
    sensitivities: dict,
    options: ConvertOptions,
    index: int,
    device: torch.device,
    log: Callable[[str], None],
) -> list[str]:
    """Quantize ``slots`` (lockstep groups of them at a time) with their captured Hessians, swap
    each for its :class:`EXL3Linear`, add its tensors to ``block_tensors`` and return the log
    lines. A linear's seed counts the block's tensors stored before it, so it is the same however
    the block's linears are staged."""
    lines = []
    for group in lockstep_groups(slots):
        jobs = []
        stored = len(block_tensors)
        for s in group:
            dense = s.get()
            jobs.append(
                WeightJob(
                    dense.weight.detach(),
                    hooks[s.key].hessian(),
                    s.bits,
                    seed=options.seed * 100003 + stored + index * 1009,
                    warn=lambda msg, key=s.key: log(f"    warning: {key}: {msg}"),
                )
            )
            stored += stored_tensor_count(options.codebook, getattr(dense, "bias", None) is not None)
        results = quantize_weights(
            jobs,
            options.codebook,
            out_scales=options.out_scales,
            damping=options.damping,
            refit=options.refit,
            device=device,
        )
        for s, qt in zip(group, results):
            bias = getattr(s.get(), "bias", None)
            tensors = qt.tensors(s.key, bias.detach() if bias is not None else None)
            block_tensors.update(tensors)
            s.set(EXL3Linear.from_tensors(tensors, s.in_features, s.out_features, None, name=s.key))
            line = f"    {s.key:48s} K={s.bits}  proxy_err={qt.proxy_error:.6f}  scale={qt.scale:.4f}"
            if s.key in sensitivities:  # the pre-pass's figures at this K, for comparison
                sens = sensitivities[s.key]
                line += f"  predicted={sens.proxies[s.bits]:.6f}  e={sens.at(s.bits):.2e}"
            lines.append(line + _refit_note(qt))
    return lines


def _tune_block(
    block: nn.Module,
    slots: list[LinearSlot],
    tensors: dict[str, torch.Tensor],
    hidden: torch.Tensor,
    reference: torch.Tensor,
    options: ConvertOptions,
    index: int,
) -> str:
    """Tune the quantized block's scales to its unquantized output (:mod:`engine.quant.finetune`),
    update ``tensors`` and the block's linears, and return the log line."""
    layers = []
    for s in slots:
        sub = linear_tensors(tensors, s.key)
        layers.append(
            ScaledCore(EXL3Linear.from_tensors(sub, s.in_features, s.out_features, None, "streaming"))
        )
        s.set(layers[-1])
    make_trainable(block)
    tune = TuneOptions(steps=options.tune_steps, lr=options.tune_lr, seed=options.seed * 7919 + index)
    result = tune_block_scales(tuning_runner(block), layers, hidden, reference, tune)
    for s, layer in zip(slots, layers):
        suh, svh = layer.scales(tensors[f"{s.key}.suh"], tensors[f"{s.key}.svh"])
        tensors[f"{s.key}.suh"], tensors[f"{s.key}.svh"] = suh, svh
        sub = linear_tensors(tensors, s.key)
        s.set(EXL3Linear.from_tensors(sub, s.in_features, s.out_features, None, name=s.key))
    verdict = "kept" if result.kept else "not kept"
    return (
        f"    scale tuning: held-out error {result.before:.3e} -> {result.after:.3e} ({verdict}, "
        f"{options.tune_steps} steps, {result.seconds:.1f} s)"
    )


def tuning_runner(block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The block as :func:`~engine.quant.finetune.tune_block_scales` runs it: rows in, output left
    on the block's device (:func:`forward_rows`), so the loss and its backward run there whether
    the states live on the host or the device: the same rounding either way (and GPU speed)."""
    return lambda rows: forward_rows(block, rows)


def lockstep_groups(slots: list[LinearSlot]) -> list[list[LinearSlot]]:
    """Consecutive runs of ``slots`` of at most :data:`LOCKSTEP_WEIGHTS` weights (a larger linear
    alone)."""
    groups: list[list[LinearSlot]] = []
    size = 0
    for s in slots:
        n = s.in_features * s.out_features
        if groups and size + n <= LOCKSTEP_WEIGHTS:
            groups[-1].append(s)
            size += n
        else:
            groups.append([s])
            size = n
    return groups


def convert_model(
    src: str | Path,
    dst: str | Path,
    options: ConvertOptions,
    resume: bool = False,
    log: Callable[[str], None] = print,
    progress: Callable[[float, str], None] | None = None,
) -> ConvertReport:
    """Convert ``src`` (HF directory) to an EXL3 directory ``dst``. See the module docstring.
    ``progress(fraction, message)``, if given, follows the blocks (with an ETA) to 1.0 at the end."""
    from engine.model import resolve_device

    device = resolve_device(options.device)
    with calibration_matmuls(device, options.tf32), HostPins(device, log) as pins:
        return _convert_model(
            src, dst, options, resume, log, progress or (lambda fraction, message: None), pins
        )


def _convert_model(
    src: str | Path,
    dst: str | Path,
    options: ConvertOptions,
    resume: bool,
    log: Callable[[str], None],
    progress: Callable[[float, str], None],
    pins: HostPins,
) -> ConvertReport:
    from safetensors.torch import load_file, save_file

    from engine.architectures import architecture_for
    from engine.config import ModelConfig
    from engine.loading.safetensors_store import WeightStore
    from engine.model import load_model, resolve_device
    from engine.quant.source_model import SourceModel

    t_start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if options.codebook not in CODEBOOKS:
        raise ConvertError(f"unknown codebook {options.codebook!r}; choose one of {', '.join(CODEBOOKS)}")
    if not (1 <= options.head_bits <= 8 or options.head_bits == 16):
        raise ConvertError(f"head bits must be 1..8 or 16, got {options.head_bits}")
    if options.tune_target not in TUNE_TARGETS:
        raise ConvertError(
            f"unknown tuning target {options.tune_target!r}; choose one of {', '.join(TUNE_TARGETS)}"
        )
    if options.allocation not in ALLOCATIONS:
        raise ConvertError(
            f"unknown allocation {options.allocation!r}; choose one of {', '.join(ALLOCATIONS)}"
        )
    if not 1.0 <= options.bits <= 8.0:
        raise ConvertError(f"target bits per weight must be within 1.0..8.0, got {options.bits}")
    if options.states not in STATE_PLACES:
        raise ConvertError(
            f"unknown place for the states {options.states!r}; choose one of {', '.join(STATE_PLACES)}"
        )
    if not 0.0 <= options.generated_rows <= 1.0:
        raise ConvertError(f"the share of generated rows must be within 0..1, got {options.generated_rows}")
    device = resolve_device(options.device)
    config = ModelConfig.from_dir(src)
    if config.quantization:
        raise ConvertError(f"{src} is already quantized ({config.quantization.get('quant_method')})")
    architecture_for(config.architecture)  # an unknown architecture is named before any work
    work = dst / WORK_DIR
    job_file = work / "job.json"
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

    log(f" -- reading {config.architecture} from {src}: its blocks go to {device} one at a time")
    source = SourceModel(src, device)
    spec, store, names = source.spec, source.store, source.names
    blocks, per_block = source.blocks, source.slots
    all_slots = [s for slots in per_block for s in slots]

    ids = calibration_ids(
        src,
        options.cal_rows,
        options.cal_cols,
        spec.vocab_size,
        options.random_rows_fraction,
        options.seed,
        options.cal_text,
    )
    # The model writes ``generated_rows`` of the text rows; the snippets it continues come from
    # the text rows, and the text rows kept stay spread over the whole text.
    text_rows = ids.shape[0] - n_random_rows(ids.shape[0], options.random_rows_fraction)
    n_generated = min(text_rows, round(text_rows * options.generated_rows))
    if n_generated:
        from engine.quant.self_calibration import load_or_generate_rows

        text_ids = ids[:text_rows].flatten()
        ids[replaced_text_rows(text_rows, n_generated)] = load_or_generate_rows(
            work,
            lambda: load_model(src, device=str(device), dtype=torch.float32),
            text_ids,
            n_generated,
            options.cal_cols,
            options.seed,
            log=log,
            progress=progress,
        )
    log(f" -- calibration: {ids.shape[0]} rows x {ids.shape[1]} tokens ({n_generated} model-written)")

    # Rows per forward chunk: bound the attention score matrix and activations (~256 MB).
    width = int(config.get("intermediate_size") or 4 * spec.hidden_size)
    chunk_rows = max(1, int(2**26 // (options.cal_cols * max(width, options.cal_cols))))
    # Tuning towards the unquantized model keeps its hidden state too: a third copy of the states.
    tune_to_model = options.tune_steps > 0 and options.tune_target == "model"
    copies = 3 if tune_to_model else 2
    home = state_device(options.states, device, ids.shape, spec.hidden_size, copies, per_block, log)
    hidden = source.embed_rows(ids, home)
    pins.pin(hidden)  # host states: page-locked for PCIe-speed copies (HostPins)
    achieved, sensitivities = _allocate(blocks, per_block, hidden, chunk_rows, options, work, log, device)
    report = ConvertReport(bits=round(achieved, 2))
    report.sensitivity = {key: asdict(sens) for key, sens in sensitivities.items()}
    block_times: list[float] = []
    outputs: list[tuple[str, dict[str, torch.Tensor], int | None]] = []
    n_blocks = len(blocks)
    # The head and the output count as one more block's worth of the bar.
    progress(0.0, f"block 0/{n_blocks}")
    # The unquantized model's hidden state, for tuning towards it (tune_target "model").
    exact = hidden.clone() if tune_to_model else None
    if exact is not None:
        pins.pin(exact)
    # The unquantized block's output: one buffer for every block (host states are then not
    # allocated and page-faulted in again for each block), made when the first block needs it.
    reference: torch.Tensor | None = None
    for i, (block, slots) in enumerate(zip(blocks, per_block)):
        t0 = time.perf_counter()
        saved = block_file(work, i)
        if exact is not None:
            with torch.inference_mode():
                exact = _run_block(block, exact, chunk_rows, in_place=True)
        if resume and saved.exists():
            tensors = load_file(str(saved), device=str(device))
            for s in slots:
                sub = linear_tensors(tensors, s.key)
                s.set(EXL3Linear.from_tensors(sub, s.in_features, s.out_features, None, name=s.key))
            with torch.inference_mode():
                hidden = _run_block(block, hidden, chunk_rows, in_place=True)
            log(f" -- block {i}: resumed from {saved.name}")
            report.blocks.append({"block": i, "resumed": True})
            progress((i + 1) / (n_blocks + 1), f"block {i + 1}/{n_blocks} (resumed)")
            continue
        # Without ``sequential`` one forward of the unquantized block gives every Hessian; with it,
        # each input group after the first is captured again once the groups before it are
        # quantized, so its Hessian is that of the inputs it will see at inference.
        stages = input_groups(slots) if options.sequential else [slots]
        hooks, handles = hessian_hooks(stages[0], device)
        if reference is None:
            reference = torch.empty_like(hidden)
            pins.pin(reference)
        with torch.inference_mode():
            _run_block(block, hidden, chunk_rows, out=reference)
        for h in handles:
            h.remove()
        block_tensors: dict[str, torch.Tensor] = {}
        lines = []
        for j, stage in enumerate(stages):
            if j > 0:
                hooks = capture_hessians(block, hidden, stage, chunk_rows)
            lines += _quantize_stage(stage, hooks, block_tensors, sensitivities, options, i, device, log)
        if options.tune_steps > 0:
            target = reference if exact is None else exact
            lines.append(_tune_block(block, slots, block_tensors, hidden, target, options, i))
        with torch.inference_mode():
            hidden = _run_block(block, hidden, chunk_rows, in_place=True)
        rfn = relative_frobenius(hidden, reference, chunk_rows, block_device(block))
        with _disk_errors(saved, work):
            # Written under another name and renamed: a block file is whole or absent, so a full
            # disk or a kill mid-write never leaves one that breaks --resume.
            partial = saved.with_suffix(".partial")
            save_file({k: v.contiguous().cpu() for k, v in block_tensors.items()}, str(partial))
            partial.replace(saved)
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

    # Head: Hessian of the final-normed hidden state.
    head_key = names.lm_head
    dim = spec.hidden_size
    head_weight = store.get(f"{head_key}.weight") if store.has(f"{head_key}.weight") else None
    tied = head_weight is None
    if tied:  # the converter quantizes a copy of the embedding (section 3.4)
        head_weight = store.get(names.prefix + names.embed + ".weight")
    head_tensors: dict[str, torch.Tensor]
    if options.head_bits == 16:
        head = _fp16_copy(head_weight)
        # A bf16/fp16 tied head is the embedding's own tensor: safetensors refuses to save two
        # names over one memory, so the head gets its own copy.
        head_tensors = {f"{head_key}.weight": head.clone() if tied and head is head_weight else head}
    else:
        with torch.inference_mode():
            if device.type == "cpu":  # a CPU conversion: in one product, as it always was
                x = source.shell.final_norm(hidden.reshape(-1, dim)).float()
                head_h = x.T @ x / x.shape[0]
                del x
            else:
                # On a GPU, wherever the states live: the same sum a chunk of rows at a time, so
                # the normed states (8.4 GB for an 8B model) never exist whole on the device.
                hook = _HessianHook(dim, device)
                for r0 in range(0, hidden.shape[0], chunk_rows):
                    x = source.shell.final_norm(hidden[r0 : r0 + chunk_rows].to(device).reshape(-1, dim))
                    hook(source.shell, (x,))
                head_h = hook.hessian()
                del x, hook
        qt = quantize_weight(
            head_weight.float(),
            head_h,
            options.head_bits,
            options.codebook,
            seed=options.seed + 7,
            out_scales=options.out_scales,
            damping=options.damping,
            refit=options.refit,
            device=device,
            warn=lambda msg: log(f"    warning: {head_key}: {msg}"),
        )
        head_tensors = qt.tensors(head_key)
        report.head = {"bits": options.head_bits, "proxy_err": qt.proxy_error}
        log(f"    {head_key:48s} K={options.head_bits}  proxy_err={qt.proxy_error:.6f}" + _refit_note(qt))

    # Assemble the output in module order: embed, per layer (norms and linears), final norm, head.
    # The finished blocks' tensors stay in their work files until their shard is written.
    blocks.release()
    finished = WeightStore(work, [block_file(work, i) for i in range(n_blocks)])
    done = {key: finished.meta(key) for key in finished.keys()}
    quantized_keys = {s.key for s in all_slots}
    copied: set[str] = set()

    def plain(key: str) -> None:
        if store.has(key) and key not in copied:
            copied.add(key)
            outputs.append((key.rsplit(".", 1)[0], {key: _fp16_copy(store.get(key))}, None))

    def unquantized(name: str) -> None:
        """A module that stays unquantized (a norm, a router: its weight and bias), or a tensor a
        module keeps as stored (then in one entry with its module's other such tensors)."""
        stored = [name] if store.has(name) else [f"{name}.weight", f"{name}.bias"]
        keys = [k for k in stored if store.has(k) and k not in copied]
        if not keys:
            return
        copied.update(keys)
        module = name if keys[0] != name else name.rsplit(".", 1)[0]
        tensors = {k: _fp16_copy(store.get(k)) for k in keys}
        if outputs and outputs[-1][0] == module and outputs[-1][2] is None:
            outputs[-1][1].update(tensors)
        else:
            outputs.append((module, tensors, None))

    slot_of = {s.key: s for s in all_slots}
    plain(names.prefix + names.embed + ".weight")
    for keys in source.layouts:
        for key in keys:
            if key in slot_of:
                outputs.append((key, linear_tensors(done, key), slot_of[key].bits))
            else:
                unquantized(key)
    plain(names.prefix + names.final_norm + ".weight")
    outputs.append((head_key, head_tensors, None if options.head_bits == 16 else options.head_bits))
    # Anything else the source holds that belongs to no quantized linear (e.g. extra norms). What
    # the blocks were built from is not (fused source projections are stored split, quantized).
    claimed = {f"{k}.{suffix}" for k in quantized_keys | {head_key} for suffix in ("weight", "bias")}
    claimed |= source.block_keys
    for key in sorted(store.keys()):
        if key not in claimed and key not in copied and not key.endswith("rotary_emb.inv_freq"):
            plain(key)

    quant_config = {
        "quant_method": "exl3",
        "version": engine.__version__,
        "bits": report.bits,
        "head_bits": options.head_bits,
        "calibration": {"rows": options.cal_rows, "cols": options.cal_cols},
        "out_scales": "always" if options.out_scales else "never",
        "codebook": options.codebook,
        "converter": "trellis-chat",
    }
    with _disk_errors(dst, work):
        write_output(src, dst, outputs, quant_config, options.codebook, options.shard_size_mb, finished.get)
    del finished  # closes the work files (Windows cannot remove a file that is open)
    shutil.rmtree(work)
    report.seconds = time.perf_counter() - t_start
    log(f" -- wrote {dst} ({report.bits:.2f} bits/weight, {report.seconds:.1f} s)")
    progress(1.0, f"done in {format_duration(report.seconds)}")
    return report


@contextlib.contextmanager
def _disk_errors(path: Path, work: Path) -> Iterator[None]:
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


def format_duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


__all__ = ["ConvertError", "ConvertOptions", "ConvertReport", "convert_model", "INST3"]
