"""The model being converted, one decoder block at a time.

The converter needs the unquantized model's blocks in order (once for the sensitivity pre-pass,
once to quantize them), its embedding (the calibration rows' first hidden states) and its final
norm (the head's Hessian). Loaded whole in float32, as inference loads a model, that is 4 bytes
per weight on the device: 32 GB for an 8B model, more than a 24 GB GPU holds, and 280 GB for a
70B one. Here only the final norm and the block being worked on are on the device (the
calibration rows are embedded on the host, once). A block is built from the checkpoint when the
converter reaches it and dropped when it moves on, so the weights take the largest block's
memory (0.9 GB for the Llama-3.1-8B shape) however many layers the model has.

Every block's quantizable linears (:class:`~engine.convert.slots.LinearSlot`) are known up front,
without reading a weight: the blocks are first built on PyTorch's ``meta`` device from the
checkpoint's shapes. When a block is built for real, the same slot objects are pointed at its
modules, so the bits the allocation set on them stay where they are. The ``meta`` blocks also
give the order of each block's tensors in the output and the checkpoint keys they are built from.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from engine.convert import carried
from engine.convert.slots import block_linears, checkpoint_order


class _ShapeStore:
    """A weight store's keys and shapes, with ``meta`` tensors for its weights (nothing is read)."""

    def __init__(self, store) -> None:
        self._store = store
        self.read: set[str] = set()  # every key asked for

    def has(self, key: str) -> bool:
        return self._store.has(key)

    def get(
        self,
        key: str,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        shape: Iterable[int] | None = None,
    ) -> torch.Tensor:
        self.read.add(key)
        stored = self._store.shape(key)
        if shape is not None and list(shape) != stored:
            # Built for real, the block raises the store's own error (it names the file).
            return self._store.get(key, dtype, "meta", shape)
        return torch.empty(stored, dtype=dtype or torch.float32, device="meta")


def quantizable_keys(src: str | Path) -> list[str]:
    """The checkpoint keys of the linears the converter quantizes, block by block, as the blocks'
    modules list them (the blocks built on the ``meta`` device: no weight is read)."""
    from engine.architectures import architecture_for
    from engine.config import ModelConfig
    from engine.loading.builder import ModelBuilder
    from engine.loading.safetensors_store import WeightStore

    config = ModelConfig.from_dir(src)
    arch = architecture_for(config.architecture)
    spec, store = arch.spec(config), WeightStore(config.directory)
    names = arch.tensor_names(store.has)
    with torch.inference_mode():
        shapes = ModelBuilder(
            spec, names, _ShapeStore(store), torch.float32, "meta", spec.max_position_embeddings
        )
        rope = shapes.rotary()
        return [slot.key for i in range(spec.num_layers) for slot in block_linears(shapes.block(i, rope))]


class SourceModel:
    """The unquantized model at ``src`` for the converter: ``shell`` (a model without blocks: its
    ``final_norm``, and its embedding until :meth:`embed_rows`), ``blocks`` (built on access, one
    at a time), ``slots`` (each block's quantizable linears), ``layouts`` (each block's keyed
    modules in module order, fused projections split, then the stored tensors it keeps as they
    are) and ``block_keys`` (every key the blocks are built from).

    Where blocks read more than the residual stream (Gemma 4's per-layer inputs and shared keys
    and values), the state carries those inputs in extra columns (``carry``,
    :mod:`engine.convert.carried`): ``state_width`` wide, the stream first."""

    def __init__(self, src: str | Path, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        from engine.architectures import architecture_for
        from engine.config import ModelConfig
        from engine.loading.builder import ModelBuilder
        from engine.loading.safetensors_store import WeightStore
        from engine.modules.decoder import CausalLM

        config = ModelConfig.from_dir(src)
        arch = architecture_for(config.architecture)
        self.spec = arch.spec(config)
        self.store = WeightStore(config.directory)
        self.names = arch.tensor_names(self.store.has)  # a multimodal checkpoint nests its decoder
        context = self.spec.max_position_embeddings  # as load_model builds it: the same RoPE tables
        with torch.inference_mode():
            self._builder = ModelBuilder(self.spec, self.names, self.store, dtype, device, context)
            self.rope = self._builder.rotary()
            host = ModelBuilder(self.spec, self.names, self.store, dtype, "cpu", context)
            self._host = host
            self.shell = CausalLM(
                host.embedding(),  # on the host: embed_rows is its only use
                [],
                self._builder.final_norm(),
                nn.Identity(),  # the converter reads the head's weight from the store itself
                self.spec.embed_scale,
                self.spec.final_softcap,
                embed_norm=host.embed_norm(),  # the first hidden states are normalised (nanochat)
            ).eval()
            shape_store = _ShapeStore(self.store)
            shapes = ModelBuilder(self.spec, self.names, shape_store, dtype, "meta", context)
            meta_rope = shapes.rotary()
            self.slots, self.layouts = [], []
            for i in range(self.spec.num_layers):
                meta = shapes.block(i, meta_rope)
                self.slots.append(block_linears(meta))
                self.layouts.append(checkpoint_order(meta) + shapes.kept_tensors[i])
            self.block_keys = shape_store.read
        self.carry = carried.carry_layout(self.spec)
        self.layer_inputs = None  # the per-layer inputs on the host, for the calibration tokens
        self.blocks = BlockStream(self)

    @property
    def state_width(self) -> int:
        """Columns of the converter's state: the stream's, and any carried inputs'."""
        return self.carry.width if self.carry is not None else self.spec.hidden_size

    def stream(self, state: torch.Tensor) -> torch.Tensor:
        """The residual stream's columns of the converter's ``state`` (a view)."""
        return state[..., : self.spec.hidden_size]

    def embed_rows(self, ids: torch.Tensor, home: torch.device) -> torch.Tensor:
        """The first hidden states of the token rows ``ids`` ``(rows, cols)``, float32 on ``home``,
        filled a row at a time. The lookup runs on the host (the embedding table, up to ~6 GB in
        float32, never goes to the device) and the table is let go of afterwards."""
        h = self.spec.hidden_size
        hidden = torch.empty(*ids.shape, self.state_width, dtype=torch.float32, device=home)
        with torch.inference_mode():
            for r in range(ids.shape[0]):
                hidden[r, :, :h] = self.shell.embed(ids[r : r + 1].cpu())[0]
        self.shell.embedding = None
        if self.carry is not None:
            compact = self._per_layer_inputs(ids) if self.carry.per_layer_inputs else None
            carried.fill(hidden, compact, self.carry)
        return hidden

    def _per_layer_inputs(self, ids: torch.Tensor) -> torch.Tensor:
        """Build the per-layer inputs on the host from the rows of their table the calibration
        tokens ``ids`` use; returns ``ids`` as indices into those rows."""
        from engine.layers import per_layer_input as ple

        names = self.names.part(ple.NAMES)
        table = self.store.get(f"{self.names.prefix}{names.table}.weight")  # as stored: no float32 copy
        rows, compact = carried.compact_rows(table, ids)
        del table
        with torch.inference_mode():
            self.layer_inputs = ple.build_per_layer_inputs(self._host, names, table=rows)
        return compact

    def build_block(self, i: int) -> nn.Module:
        """Block ``i`` read from the checkpoint onto the device, with ``slots[i]`` pointed at it."""
        with torch.inference_mode():
            block = self._builder.block(i, self.rope)
        for slot, built in zip(self.slots[i], block_linears(block), strict=True):
            slot.parent, slot.attr = built.parent, built.attr
        if self.carry is None:
            return block
        inputs = None
        if self.layer_inputs is not None and self.spec.layers[i].per_layer_input:
            with torch.inference_mode():
                inputs = self.layer_inputs.only(i).to(self._builder.device)
        return carried.CarriedBlock(block, i, self.carry, inputs)


class BlockStream:
    """``source.blocks``: a sequence whose item ``i`` is block ``i``, built when first asked for
    and kept until another block is asked for (so a block keeps its quantized linears while the
    converter works on it). At most one block is held at a time."""

    def __init__(self, source: SourceModel) -> None:
        self._source = source
        self._index: int | None = None
        self._block: nn.Module | None = None

    def __len__(self) -> int:
        return len(self._source.slots)

    def __getitem__(self, i: int) -> nn.Module:
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i != self._index:
            self.release()  # freed before the next one is read
            self._block, self._index = self._source.build_block(i), i
        return self._block

    def __iter__(self) -> Iterator[nn.Module]:
        return (self[i] for i in range(len(self)))

    def release(self) -> None:
        """Drop the block held, and free its memory now: a caller may still hold the module or
        one of its weights (a loop variable keeps the last item until the next one is built), so
        the storage of its weights and buffers is emptied here rather than left to their last
        reference. The RoPE tables, shared by every block, stay. A released block cannot run."""
        if self._block is not None:
            shared = {id(r) for r in self._source.rope.values()}
            for module in self._block.modules():
                if id(module) in shared:
                    continue
                for t in [*module._parameters.values(), *module._buffers.values()]:
                    if t is not None:
                        _free(t)
            for slot in self._source.slots[self._index]:
                slot.parent = None
        self._block = self._index = None


def _free(t: torch.Tensor) -> None:
    """Empty ``t``'s storage, whoever else refers to it."""
    try:
        t.untyped_storage().resize_(0)
    except RuntimeError:
        pass  # a storage that cannot be resized (mapped from the checkpoint): the OS reclaims it
