"""The cache of a model's per-sequence state: key/value storage in pages for attention layers,
recurrent-state slots for the layers that declare a fixed-size state (``engine.cache.state``).

Key/value storage is ``[num_pages * page_size, kv_heads, head_dim]`` per attention layer (dense,
or packed codes and scales for a quantized cache): a cache *slot* is a row, and page ``p`` owns
slots ``p * page_size .. (p + 1) * page_size - 1``. A sequence's block table (its list of pages)
turns positions into slots. A latent attention layer keeps one compressed row per slot in place
of keys and values (``engine.cache.latent``). A recurrent layer keeps one row per *state slot*
instead (``engine.cache.recurrent``); a sequence holds the same state slot in every such layer.

Prefix reuse (``engine.cache.pages``) hands a new sequence the pages of a prompt prefix another
sequence computed. A recurrent layer's state after that prefix was overwritten as the other
sequence went on, so a cache with recurrent layers also keeps snapshots of that state at page
boundaries (``engine.cache.snapshots``), and a sequence resumes where a snapshot is. A cache
without recurrent layers has no snapshot pool.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from engine import kernels
from engine.cache.latent import LatentCacheLayer
from engine.cache.pages import PageAllocator
from engine.cache.quantized import SUPPORTED_BITS, DenseStore, QuantizedStore, bytes_per_token
from engine.cache.recurrent import RecurrentStateLayer, StateSlots
from engine.cache.snapshots import SnapshotPool
from engine.cache.state import KVPages, LatentPages, RecurrentState, SequenceState, SharedPages
from engine.cache_footprint import (
    DEFAULT_MAX_SEQUENCES,
    KV,
    LATENT,
    NOTHING,
    STATE,
    CacheFootprint,
    latent_bits,
    snapshot_capacity,
)


class KVCacheLayer:
    """One layer's keys and values; each side dense or quantized (``engine.cache.quantized``)."""

    def __init__(self, keys, values, dtype: torch.dtype) -> None:
        self.keys, self.values, self.dtype = keys, values, dtype

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # Two dense sides on the GPU: one kernel writes both (else one index_copy_ per side).
        if kernels.attention.kv_cache_write(self.keys, self.values, slots, k, v) is not None:
            return
        self.keys.write(slots, k)
        self.values.write(slots, v)

    def write_rotated(
        self,
        slots: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor | None:
        """Rotate ``q`` and ``k`` (rotate-half RoPE with ``tables``) and :meth:`write` the rotated
        keys and ``v`` in one launch; returns ``q`` rotated, or None where that launch does not
        apply (CPU, a quantized side): the caller then rotates and writes apart."""
        return kernels.fused.rope_kv_write(q, k, v, *tables, self.keys, self.values, slots)

    def project_rotated(
        self,
        group,
        x: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        head_dim: int,
    ) -> torch.Tensor | None:
        """A decode step's q/k/v projection ``group`` of ``x``, RoPE and :meth:`write` of the keys
        and values in one GEMV launch (``kernels.gemv.exl3_qkv_rope_write``); returns q rotated, or None
        where that does not apply (then: ``group(x)`` and :meth:`write_rotated`)."""
        linears = list(group.linears)
        if len(linears) != 3 or any(len(s) != 1 for s in group.splits):  # separate q, k, v only
            return None
        return kernels.gemv.exl3_qkv_rope_write(x, linears, tables, self.keys, self.values, slots, head_dim)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.read(slots, self.dtype), self.values.read(slots, self.dtype)

    def read_runs(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Keys and values at ``slots`` as views of the store, one per run of consecutive slots
        (a sequence's pages are mostly consecutive): no copy. Only for dense sides on the CPU, in
        the cache's dtype; None elsewhere (then :meth:`read`). Readers must not write to them."""
        dense = isinstance(self.keys, DenseStore) and isinstance(self.values, DenseStore)
        if slots.is_cuda or not dense or slots.numel() == 0 or self.keys.data.dtype != self.dtype:
            return None
        breaks = (torch.diff(slots) != 1).nonzero().flatten().tolist()
        starts, ends = [0] + [b + 1 for b in breaks], [b + 1 for b in breaks] + [slots.numel()]
        runs = []
        for start, end in zip(starts, ends):
            run = slice(int(slots[start]), int(slots[start]) + end - start)
            runs.append((self.keys.data[run], self.values.data[run]))
        return runs

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def make_store(num_slots: int, heads: int, head_dim: int, bits: int, dtype: torch.dtype, device):
    """A dense store for ``bits >= 16``, else a quantized one."""
    if bits >= 16:
        return DenseStore(num_slots, heads, head_dim, dtype, device)
    return QuantizedStore(num_slots, heads, head_dim, bits, device)


def parse_cache_bits(text: str | None) -> tuple[int, int]:
    """``"4"`` -> (4, 4); ``"4,6"`` -> keys 4, values 6; ``None``/``"16"`` -> unquantized."""
    if not text:
        return 16, 16
    try:
        parts = [int(p) for p in str(text).split(",")]
    except ValueError:
        parts = []  # not whole numbers: refused below with the same message
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or any(b not in (*SUPPORTED_BITS, 16) for b in parts):
        raise ValueError(f"--cache-bits takes K or K,V with each in 2..8 or 16, got '{text}'")
    return parts[0], parts[1]


def kv_bytes_per_token(spec, bits: tuple[int, int] = (16, 16), dense_bytes: int = 2) -> int:
    """Cache bytes one position of a sequence takes in every attention layer of the model
    ``spec`` (an ``engine.layers.ModelSpec``), keys at ``bits[0]`` and values at ``bits[1]``
    (a latent attention layer's row at the wider of the two)."""
    from engine.layers import sequence_states

    states = sequence_states(spec)
    pages = [s for s in states if isinstance(s, KVPages)]
    kv = sum(bytes_per_token(s.kv_heads, s.head_dim, b, dense_bytes) for s in pages for b in bits)
    rows = [s for s in states if isinstance(s, LatentPages)]
    return kv + sum(bytes_per_token(1, s.width, latent_bits(bits), dense_bytes) for s in rows)


def footprint_of(states: Sequence[SequenceState | None]) -> CacheFootprint:
    """The memory footprint of layers that keep ``states`` per sequence (one entry per layer)."""
    kv = tuple((s.kv_heads, s.head_dim) for s in states if isinstance(s, KVPages))
    recurrent = tuple(
        (sum(math.prod(shape) for shape in s.shapes.values()), s.dtype.itemsize if s.dtype else None)
        for s in states
        if isinstance(s, RecurrentState)
    )
    latent = tuple(s.width for s in states if isinstance(s, LatentPages))
    return CacheFootprint(kv, recurrent, latent, tuple(map(_kept, states)))


def _kept(state: SequenceState | None) -> str:
    """What a layer keeping ``state`` holds of its own (a reader of shared pages: nothing)."""
    if isinstance(state, KVPages):
        return KV
    if isinstance(state, LatentPages):
        return LATENT
    if isinstance(state, RecurrentState):
        return STATE
    return NOTHING


def cache_footprint(spec) -> CacheFootprint:
    """The memory footprint of the model ``spec`` (an ``engine.layers.ModelSpec``), from what its
    layers' kinds declare: what the app's estimate (``engine.inspect``) must agree with."""
    from engine.layers import sequence_states

    return footprint_of(sequence_states(spec))


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int = 64,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        bits: tuple[int, int] = (16, 16),
    ) -> None:
        """A cache of ``num_layers`` attention layers alike (kernel tests and benchmarks make
        these; a model's cache comes from :meth:`for_model`)."""
        states = [KVPages(kv_heads, head_dim)] * num_layers
        self._allocate(states, num_pages, page_size, dtype, device, bits, max_sequences=0)

    @classmethod
    def for_layers(
        cls,
        states: Sequence[SequenceState | None],
        num_pages: int,
        page_size: int = 64,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        bits: tuple[int, int] = (16, 16),
        max_sequences: int = DEFAULT_MAX_SEQUENCES,
        snapshots: int | None = None,
        devices: Sequence[torch.device] | None = None,
    ) -> PagedKVCache:
        """A cache for layers that keep ``states`` per sequence (one entry per layer, as their
        mixer kinds declare them): ``num_pages`` pages for the KV layers, ``max_sequences``
        state slots for the recurrent ones, and a pool of ``snapshots`` state snapshots for
        prefix reuse (None: ``engine.cache_footprint.snapshot_capacity`` of this budget; a cache
        without recurrent layers has none). ``devices``: each layer's storage device, where the
        layers are split across devices (``engine.parallel.placement``); None: all on ``device``."""
        cache = cls.__new__(cls)
        cache._allocate(states, num_pages, page_size, dtype, device, bits, max_sequences, snapshots, devices)
        return cache

    @classmethod
    def for_model(
        cls,
        spec,
        max_tokens: int,
        page_size: int = 64,
        dtype=None,
        device="cpu",
        bits: tuple[int, int] = (16, 16),
        max_sequences: int = DEFAULT_MAX_SEQUENCES,
        snapshots: int | None = None,
        states: Sequence[SequenceState | None] | None = None,
        devices: Sequence[torch.device] | None = None,
    ) -> PagedKVCache:
        """A cache holding ``max_tokens`` positions in total (and recurrent state for
        ``max_sequences`` sequences and ``snapshots`` snapshots of it, where the model has
        recurrent layers: see :meth:`for_layers`), shaped for the model ``spec`` (an
        ``engine.layers.ModelSpec``), or for the per-layer ``states`` given instead (a
        tensor-parallel rank's share of the heads); ``devices`` as for :meth:`for_layers`."""
        from engine.layers import sequence_states  # the layer kinds import the cache's modules

        num_pages = max(1, -(-max_tokens // page_size))
        dtype = dtype or torch.float32
        states = sequence_states(spec) if states is None else states
        return cls.for_layers(
            states, num_pages, page_size, dtype, device, bits, max_sequences, snapshots, devices
        )

    def _allocate(
        self,
        states: Sequence[SequenceState | None],
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        bits: tuple[int, int],
        max_sequences: int,
        snapshots: int | None = None,
        devices: Sequence[torch.device] | None = None,
    ) -> None:
        self.page_size, self.num_pages, self.bits = page_size, num_pages, bits
        self.device = torch.device(device)
        devices = devices or [self.device] * len(states)
        recurrent = any(isinstance(state, RecurrentState) for state in states)
        self.pages = PageAllocator(num_pages, page_size)
        self.state_slots = StateSlots(max_sequences if recurrent else 0)
        slots = num_pages * page_size
        self._layers: list[KVCacheLayer | LatentCacheLayer | RecurrentStateLayer | None] = []
        for state, dev in zip(states, devices):
            if isinstance(state, KVPages):
                keys = make_store(slots, state.kv_heads, state.head_dim, bits[0], dtype, dev)
                values = make_store(slots, state.kv_heads, state.head_dim, bits[1], dtype, dev)
                self._layers.append(KVCacheLayer(keys, values, dtype))
            elif isinstance(state, LatentPages):
                self._layers.append(LatentCacheLayer(state.width, slots, bits, dtype, dev))
            elif isinstance(state, RecurrentState):
                self._layers.append(RecurrentStateLayer(state, self.state_slots.count, dtype, dev))
            elif isinstance(state, SharedPages):  # the earlier layer's own storage, not a copy
                self._layers.append(self._layers[state.source])
            else:
                self._layers.append(None)
        # Snapshots of the recurrent layers' state for prefix reuse, dropped with their pages.
        self.snapshots: SnapshotPool | None = None
        if recurrent:
            layers = [layer for layer in self._layers if isinstance(layer, RecurrentStateLayer)]
            if snapshots is None:
                paged = (KVCacheLayer, LatentCacheLayer)
                kv_bytes = sum(layer.nbytes for layer in self._layers if isinstance(layer, paged))
                state_bytes = sum(layer.nbytes for layer in layers) // (self.state_slots.count + 1)
                snapshots = snapshot_capacity(num_pages, max_sequences, kv_bytes, state_bytes)
            self.snapshots = SnapshotPool(layers, snapshots)
            self.pages.on_forget = self.snapshots.discard

    @property
    def capacity(self) -> int:
        return self.num_pages * self.page_size

    def layer(self, index: int) -> KVCacheLayer | LatentCacheLayer | RecurrentStateLayer | None:
        """Layer ``index``'s storage: KV pages, latent rows, recurrent state, or None (it keeps
        nothing)."""
        return self._layers[index]

    def slots(self, block_table: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Cache slots of positions ``start .. end - 1`` of a sequence with this block table."""
        positions = torch.arange(start, end)
        pages = torch.as_tensor(block_table, dtype=torch.long)[positions // self.page_size]
        return (pages * self.page_size + positions % self.page_size).to(self.device)

    @property
    def nbytes(self) -> int:
        snapshots = self.snapshots.nbytes if self.snapshots is not None else 0
        unique = {id(layer): layer for layer in self._layers if layer is not None}  # shared ones once
        return snapshots + sum(layer.nbytes for layer in unique.values())
