"""Layer split: consecutive decoder layers on different devices, in one process.

``--split-layers 20,12`` puts the first 20 layers on the first device and the next 12 on the
second (``auto``: counts from each GPU's free memory, ``engine.parallel.auto_split``); the
embedding, final norm and LM head stay on the first. Each layer moved off the first
device is wrapped in a :class:`PlacedBlock` that carries the residual stream and the step's
layout over to its device (and back after the last layer), and its cache storage is allocated
there (``LoadedModel.layer_devices`` -> ``PagedKVCache.for_layers(devices=...)``). :func:`load_split`
reads each layer straight onto its device, so no device holds more than its part. The devices
may be GPUs of different sizes, a GPU and the CPU, or, in tests, the CPU twice: the code is the
same.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from engine.errors import UsageError
from engine.model import LoadedModel
from engine.modules.batch import BatchLayout
from engine.modules.linear import LinearSite
from engine.modules.rope import RotaryEmbedding
from engine.options import EngineOptions


def parse_split(text: str, num_layers: int) -> list[int]:
    """``"20,12"`` -> ``[20, 12]``: layers per device, which must add up to ``num_layers``."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--split-layers takes comma-separated layer counts or auto, got '{text}'") from None
    if any(c < 0 for c in counts) or sum(counts) != num_layers:
        raise UsageError(
            f"--split-layers {text} must be counts >= 0 that add up to the model's {num_layers} layers"
        )
    return counts


def default_devices(count: int) -> list[torch.device]:
    """One GPU per part where there are enough, else the CPU for every part."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= count:
        return [torch.device("cuda", i) for i in range(count)]
    return [torch.device("cpu")] * count


def layer_devices(counts: Sequence[int], devices: Sequence[torch.device]) -> list[torch.device]:
    """Each layer's device: ``counts[i]`` consecutive layers on ``devices[i]``."""
    if len(counts) != len(devices):
        raise UsageError(f"{len(counts)} layer counts for {len(devices)} devices")
    return [torch.device(d) for d, c in zip(devices, counts) for _ in range(c)]


class PlacedBlock(nn.Module):
    """A decoder block on ``device``: its inputs are moved there first, and its outputs to
    ``return_to`` after it where that is set (the last moved block)."""

    def __init__(
        self, block: nn.Module, device: torch.device, home: torch.device, last: bool = False
    ) -> None:
        super().__init__()
        self.block, self.device, self.home = block, device, home
        self.return_to = home if last else None

    @property
    def state(self):
        return self.block.state

    @property
    def dynamic_decode(self) -> str | None:
        # A CUDA graph records one device's stream: a step across devices runs eagerly.
        return "layer-split" if self.device != self.home else self.block.dynamic_decode

    def quantizable_linears(self) -> list[LinearSite]:
        return self.block.quantizable_linears()

    def forward(self, h, batch, cache, layer_input=None):
        h, m = self.residual_forward(h, None, batch, cache, layer_input)
        return h if m is None else h + m

    def residual_forward(self, h, pending, batch: BatchLayout, cache, layer_input=None):
        to = self.device
        h, pending = h.to(to), None if pending is None else pending.to(to)
        layer_input = None if layer_input is None else layer_input.to(to)
        h, pending = self.block.residual_forward(h, pending, batch_on(batch, to), cache, layer_input)
        if self.return_to is not None:
            h, pending = h.to(self.return_to), None if pending is None else pending.to(self.return_to)
        return h, pending


def batch_on(batch: BatchLayout, device: torch.device) -> BatchLayout:
    """``batch`` with its tensors on ``device``, made once per step and device (kept on the step's
    layout, so every block of the device shares it and its RoPE tables)."""
    if batch.positions.device == device:
        return batch
    moved: dict = batch.__dict__.setdefault("_placed", {})
    if device not in moved:
        d = batch.decode
        if d is not None:
            d = replace(
                d,
                block_tables=d.block_tables.to(device),
                lengths=d.lengths.to(device),
                state_slots=None if d.state_slots is None else d.state_slots.to(device),
            )
        moved[device] = BatchLayout(
            [replace(s, slots=s.slots.to(device)) for s in batch.sequences],
            batch.positions.to(device),
            batch.write_slots.to(device),
            None if batch.rope_positions is None else batch.rope_positions.to(device),
            decode=d,
        )
    return moved[device]


def model_layer_count(directory: str | Path) -> int:
    """How many decoder layers the model in ``directory`` has (from its config, no weights read)."""
    from engine.architectures import architecture_for
    from engine.config import ModelConfig

    config = ModelConfig.from_dir(directory)
    return architecture_for(config.architecture).spec(config).num_layers


def load_split(
    directory: str | Path,
    counts: Sequence[int],
    devices: Sequence[torch.device],
    dtype: str | torch.dtype | None = None,
    context: int | None = None,
    options: EngineOptions | None = None,
    progress: Callable[[float, str], None] | None = None,
) -> LoadedModel:
    """The model of ``directory`` with ``counts[i]`` consecutive layers on ``devices[i]``, each
    layer read straight onto its device (no device ever holds more than its part, so a model no
    single card can hold loads; EXL3 layers on a GPU stay packed, on the CPU they are decoded);
    the embedding, final norm and head on ``devices[0]``."""
    from engine.model import default_dtype, load_model

    home = torch.device(devices[0])
    model = load_model(
        directory,
        device=str(home),
        dtype=dtype or default_dtype(home),
        context=context,
        progress=progress,
        options=options,
        layer_devices=layer_devices(counts, devices),
    )
    return split_layers(model, counts, devices)


def split_layers(model: LoadedModel, counts: Sequence[int], devices: Sequence[torch.device]) -> LoadedModel:
    """``model`` with its layers placed ``counts[i]`` on ``devices[i]`` (in place for the module);
    the embedding, final norm and head stay where they are (``model.device``)."""
    per_layer = layer_devices(counts, devices)
    blocks = model.module.blocks
    if len(per_layer) != len(blocks):
        raise UsageError(f"the layer counts cover {len(per_layer)} layers; the model has {len(blocks)}")
    home = model.device
    if torch.device(devices[0]) != home:
        raise UsageError(
            f"the first part of a layer split is on the model's device ({home}), not {devices[0]}"
        )
    # Every layer after the first part is placed, even on the first part's device (then its moves
    # cost nothing): the path is the same whatever the devices are.
    rotaries: dict[tuple[int, torch.device], RotaryEmbedding] = {}
    last = len(blocks) - 1
    for i in range(counts[0], len(blocks)):
        device, block = per_layer[i], blocks[i]
        own_rotaries(block, device, rotaries)  # shared RoPE tables stay where the others use them
        block.to(device)
        blocks[i] = PlacedBlock(block, device, home, last=i == last)
    return replace(model, layer_devices=per_layer)


def own_rotaries(block: nn.Module, device: torch.device, copies: dict) -> None:
    """Give ``block`` its device's copy of every rotary module it shares with other blocks."""
    for module in block.modules():
        rope = getattr(module, "rope", None)
        if isinstance(rope, RotaryEmbedding) and not _is_on(rope, device):
            key = (id(rope), device)
            if key not in copies:
                copies[key] = copy.deepcopy(rope).to(device)
            module.rope = copies[key]


def _is_on(module: nn.Module, device: torch.device) -> bool:
    """Whether every tensor of ``module`` is on ``device`` (a layer read onto its device already
    has its own rotary tables there)."""
    return all(t.device == torch.device(device) for t in [*module.parameters(), *module.buffers()])
