"""What a model's cache takes in memory, by what its layers keep per sequence. Torch-free: the
app's library estimates models it has not loaded (``engine.config_footprint``), and the cache
sizes its snapshot pool by the same rule (``engine.cache.paged``).

- An attention layer keeps keys and values per position (:func:`kv_bytes_per_token`).
- A latent attention layer (multi-head latent attention) keeps one compressed row per position,
  at the wider of the key and value widths (:func:`latent_bits`).
- A recurrent layer keeps a fixed-size state per *state slot*: one slot per sequence the cache
  runs at once, plus the scratch slot the padding rows of a fixed-shape decode step use.
- A model with recurrent layers also keeps a pool of state snapshots for prefix reuse
  (``engine.cache.snapshots``), :func:`snapshot_capacity` of them.
- A layer may keep nothing of its own: one that reads an earlier layer's keys and values, or
  one with no mixer.

A layer split puts each layer's part of the cache on the device that runs the layer
(:meth:`CacheFootprint.layer_cache_bytes`).

The engine's own footprint of a model comes from what its layer kinds declare
(``engine.cache.paged.cache_footprint``: ``engine.layers.sequence_states``).
"""

from __future__ import annotations

from dataclasses import dataclass

# Sequences a cache keeps recurrent state for at once, unless told otherwise (the Generator's
# default batch, and so what the app runs).
DEFAULT_MAX_SEQUENCES = 16
DEFAULT_PAGE_SIZE = 64

# A recurrent layer's state, for one sequence: (numbers, bytes per number), None bytes meaning
# the cache's dtype (as ``RecurrentState.dtype`` None does).
StateSize = tuple[int, int | None]


def snapshot_capacity(num_pages: int, max_sequences: int, kv_bytes: int, state_bytes: int) -> int:
    """How many state snapshots a cache keeps, from its budget: ``num_pages`` pages whose keys and
    values take ``kv_bytes``, ``max_sequences`` state slots of ``state_bytes`` each.

    Two per sequence (its prompt's end, and a checkpoint of a long prompt or an earlier prompt's
    end), never more than there are pages (a snapshot hangs on a cached page:
    ``engine.cache.snapshots``), and never more bytes than the KV pages take, so the pool at most
    doubles what the context costs; but at least one, so that a chat's next turn finds the last
    prompt's state even where one state outweighs the whole KV cache.
    """
    if max_sequences <= 0 or state_bytes <= 0:
        return 0
    return max(1, min(num_pages, 2 * max_sequences, kv_bytes // state_bytes))


def _kv_group_size(head_dim: int) -> int:
    for group in (32, 16, 8):
        if head_dim % group == 0:
            return group
    raise ValueError(f"quantized cache needs a head size divisible by 8, got {head_dim}")


def kv_bytes_per_token(heads: int, head_dim: int, bits: int, dense_bytes: int = 2) -> int:
    """Cache bytes one token of one layer's keys (or values) takes at ``bits`` (16: dense).

    A torch-free copy of ``engine.cache.quantized.bytes_per_token`` (which imports torch, and the
    GUI thread must not): ``bits`` bit planes per number plus one fp16 scale per group of 32 (or
    16, or 8) numbers. tests/app/test_cache_estimate.py holds the two equal.
    """
    if bits >= 16:
        return heads * head_dim * dense_bytes
    return heads * (head_dim * bits // 8 + head_dim // _kv_group_size(head_dim) * 2)


def _kv_layer_bytes(heads: int, head_dim: int, bits: tuple[int, int], dense_bytes: int) -> int:
    """Keys and values of one position in one attention layer; a head size the quantized cache
    cannot pack is counted unquantized (loading says why it fails)."""
    try:
        return sum(kv_bytes_per_token(heads, head_dim, b, dense_bytes) for b in bits)
    except ValueError:
        return 2 * heads * head_dim * dense_bytes


def _latent_row_bytes(width: int, bits: tuple[int, int], dense_bytes: int) -> int:
    """One position's row in one latent attention layer (unquantized where it cannot pack)."""
    try:
        return kv_bytes_per_token(1, width, latent_bits(bits), dense_bytes)
    except ValueError:
        return width * dense_bytes


def latent_bits(bits: tuple[int, int]) -> int:
    """The width a latent attention layer's rows are stored at, from the cache's (key, value)
    widths: a row is both the keys (scores read it) and the values (outputs are mixed from it),
    so it gets the wider of the two; neither side then loses precision it was given."""
    return max(bits)


# What a decoder layer keeps per sequence, in ``CacheFootprint.layout``.
KV, STATE, LATENT, NOTHING = "kv", "state", "latent", "nothing"


@dataclass(frozen=True)
class CacheFootprint:
    """The per-sequence state of a model's layers, as shapes: ``kv_layers`` holds
    ``(kv_heads, head_dim)`` of each attention layer, ``state_layers`` the state size of each
    recurrent layer, ``latent_layers`` the row width (numbers per position) of each latent
    attention layer.

    ``layout`` says what each decoder layer keeps, in the model's order: :data:`KV`,
    :data:`STATE`, :data:`LATENT` or :data:`NOTHING`; the n-th ``KV`` layer has the n-th entry
    of ``kv_layers``, and so on. Empty where the order is unknown: the totals hold, a layer's own
    part (:meth:`layer_cache_bytes`) is then unknown."""

    kv_layers: tuple[tuple[int, int], ...] = ()
    state_layers: tuple[StateSize, ...] = ()
    latent_layers: tuple[int, ...] = ()
    layout: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.layout:
            return
        for kind, entries in ((KV, self.kv_layers), (STATE, self.state_layers), (LATENT, self.latent_layers)):
            if self.layout.count(kind) != len(entries):
                raise ValueError(
                    f"the layout has {self.layout.count(kind)} {kind} layers for {len(entries)} shapes"
                )
        unknown = set(self.layout) - {KV, STATE, LATENT, NOTHING}
        if unknown:
            raise ValueError(f"unknown layer kinds in the layout: {', '.join(sorted(unknown))}")

    @classmethod
    def uniform(cls, layers: int, kv_heads: int, head_dim: int) -> CacheFootprint:
        """A model whose every layer attends with the same shape."""
        return cls(kv_layers=((kv_heads, head_dim),) * layers, layout=(KV,) * layers)

    @property
    def recurrent(self) -> bool:
        return bool(self.state_layers)

    def kv_bytes_per_token(self, bits: tuple[int, int] = (16, 16), dense_bytes: int = 2) -> int:
        """Keys and values of one position in every attention layer, and its row in every
        latent attention layer. A head size (or row width) the quantized cache cannot pack is
        counted unquantized (loading says why it fails)."""
        kv = sum(_kv_layer_bytes(heads, head_dim, bits, dense_bytes) for heads, head_dim in self.kv_layers)
        return kv + sum(_latent_row_bytes(width, bits, dense_bytes) for width in self.latent_layers)

    def state_bytes(self, dense_bytes: int = 2) -> int:
        """One sequence's state in every recurrent layer."""
        return sum(numbers * (itemsize or dense_bytes) for numbers, itemsize in self.state_layers)

    def cache_bytes(
        self,
        tokens: int,
        bits: tuple[int, int] = (16, 16),
        dense_bytes: int = 2,
        max_sequences: int = DEFAULT_MAX_SEQUENCES,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> int:
        """The cache for ``tokens`` positions: keys and values of the attention layers, and where
        the model has recurrent layers, their state in ``max_sequences`` slots plus the scratch
        slot, and the snapshot pool. ``dense_bytes``: bytes per number of an unquantized side
        and of a state in the cache's dtype."""
        copies = self._state_copies(tokens, bits, dense_bytes, max_sequences, page_size)
        return tokens * self.kv_bytes_per_token(bits, dense_bytes) + copies * self.state_bytes(dense_bytes)

    def _state_copies(
        self, tokens: int, bits: tuple[int, int], dense_bytes: int, max_sequences: int, page_size: int
    ) -> int:
        """How many copies of each recurrent layer's state the cache keeps: ``max_sequences``
        slots, the scratch slot and the snapshot pool (0 for a model without recurrent layers)."""
        if not self.recurrent:
            return 0
        pages = max(1, -(-tokens // page_size))
        per_token = self.kv_bytes_per_token(bits, dense_bytes)
        state = self.state_bytes(dense_bytes)
        snapshots = snapshot_capacity(pages, max_sequences, pages * page_size * per_token, state)
        return max_sequences + 1 + snapshots

    def layer_cache_bytes(
        self,
        tokens: int,
        bits: tuple[int, int] = (16, 16),
        dense_bytes: int = 2,
        max_sequences: int = DEFAULT_MAX_SEQUENCES,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> tuple[int, ...] | None:
        """Each decoder layer's part of :meth:`cache_bytes` (the parts add up to it), in the
        model's order: an attention layer's keys and values grow with ``tokens``, a recurrent
        layer's state is a fixed size (its copies in the slots and the snapshot pool), a layer
        that keeps nothing has 0. None where the :attr:`layout` is unknown."""
        if not self.layout:
            return None
        kv = iter(self.kv_layers)
        states = iter(self.state_layers)
        latent = iter(self.latent_layers)
        copies = self._state_copies(tokens, bits, dense_bytes, max_sequences, page_size)
        parts = []
        for kind in self.layout:
            if kind == KV:
                parts.append(tokens * _kv_layer_bytes(*next(kv), bits, dense_bytes))
            elif kind == LATENT:
                parts.append(tokens * _latent_row_bytes(next(latent), bits, dense_bytes))
            elif kind == STATE:
                numbers, itemsize = next(states)
                parts.append(copies * numbers * (itemsize or dense_bytes))
            else:
                parts.append(0)
        return tuple(parts)
