"""Tail-biting Viterbi search over the EXL3 bitshift trellis (the encoder side of section 5).

For one tile, the 256 values (in storage order) are coded by a cyclic path of 16-bit states
where each state shifts in K new bits: ``s_i = ((s_{i-1} << K) | c_i) & 0xFFFF`` and
``s_{-1} = s_255``. The decoded value of a state is ``table[s]`` (a codebook, section 6.2). We
want the path minimising ``sum_i (table[s_i] - x_i)**2``.

Predecessors of ``s'`` are the ``2**K`` states ``h * 2**(16-K) + (s' >> K)``: a dynamic
programme over all 65 536 states per step, vectorised over tiles. The cyclic constraint
(``s_0 >> K == s_255 mod 2**(16-K)``: the last 16-K bits of the stream are the first state's
high bits) is handled the way QTIP describes: a first pass over the sequence rotated by half a
tile finds a good value for the overlap bits where the wrap-around sits in the middle, then a
second pass fixes them at both ends, which makes the result exactly tail-biting.

Memory per tile: 256 steps of back-pointers, ``256 * 2**(16-K)`` bytes (8 MB at K=1, 64 KB at
K=8), plus the cost row ``65536 * 4`` bytes; :func:`encode_tiles` batches accordingly.
"""

from __future__ import annotations

import torch

from engine.exl3.trellis import TILE_VALUES, check_bits

_STATES = 1 << 16
# Bytes of back-pointers + cost rows allowed per batch of tiles.
_BATCH_BYTES = 512 << 20


def _viterbi_pass(x: torch.Tensor, k: int, table: torch.Tensor, overlap: torch.Tensor | None) -> torch.Tensor:
    """One Viterbi pass over ``x`` ``(N, T)``; returns the best state path ``(N, T)`` (int64).

    ``overlap`` (``(N,)`` or None): when given, the first state's high ``16-K`` bits and the last
    state's low ``16-K`` bits must both equal it (the tail-biting condition).
    """
    n, steps = x.shape
    n_low = 1 << (16 - k)
    n_hi = 1 << k
    values = table.float()
    states = torch.arange(_STATES, device=x.device)
    inf = torch.tensor(float("inf"), device=x.device)
    # The squared error minus the per-step constant x_i**2 (which does not change the argmin).
    v2 = values * values

    def step_cost(i: int) -> torch.Tensor:
        return torch.addcmul(v2.unsqueeze(0), x[:, i : i + 1], values.unsqueeze(0), value=-2.0)

    cost = step_cost(0)
    if overlap is not None:
        cost = torch.where((states >> k).unsqueeze(0) == overlap.unsqueeze(1), cost, inf)
    back = torch.empty(steps, n, n_low, dtype=torch.uint8, device=x.device)
    for i in range(1, steps):
        # cost.view(n, 2**K, 2**(16-K))[:, h, low] is the cost of predecessor h*2**(16-K) + low.
        best, arg = cost.view(n, n_hi, n_low).min(dim=1)
        back[i] = arg.to(torch.uint8)
        # Successor s' = low * 2**K + c inherits best[low]; add its own value's error.
        cost = step_cost(i).view(n, n_low, n_hi).add_(best.unsqueeze(-1)).view(n, _STATES)
    if overlap is not None:
        cost = torch.where((states & (n_low - 1)).unsqueeze(0) == overlap.unsqueeze(1), cost, inf)
    path = torch.empty(n, steps, dtype=torch.int64, device=x.device)
    s = cost.argmin(dim=1)
    path[:, -1] = s
    rows = torch.arange(n, device=x.device)
    for i in range(steps - 1, 0, -1):
        low = s >> k
        s = back[i, rows, low].to(torch.int64) * n_low + low
        path[:, i - 1] = s
    return path


def encode_tiles_batch(x: torch.Tensor, k: int, table: torch.Tensor) -> torch.Tensor:
    """Tail-biting Viterbi for tiles ``x`` ``(N, 256)`` (storage order); states ``(N, 256)`` int32."""
    check_bits(k)
    if x.ndim != 2 or x.shape[1] != TILE_VALUES:
        raise ValueError(f"expected tiles of shape (N, {TILE_VALUES}), got {tuple(x.shape)}")
    x = x.float()
    half = TILE_VALUES // 2
    # Pass 1: rotate so the wrap-around point (between value 255 and value 0) is mid-sequence;
    # the state chosen for value 255 then sees good context on both sides.
    rotated = torch.roll(x, -half, dims=1)  # rotated[j] = x[(j + half) % 256]; x[255] at j = half - 1
    path = _viterbi_pass(rotated, k, table, None)
    overlap = path[:, half - 1] & ((1 << (16 - k)) - 1)
    # Pass 2: the exact optimum among paths whose overlap bits are those.
    return _viterbi_pass(x, k, table, overlap).to(torch.int32)


def encode_tiles(
    x: torch.Tensor, k: int, table: torch.Tensor, batch: int | None = None, use_kernel: bool = True
) -> torch.Tensor:
    """:func:`encode_tiles_batch` over any number of tiles, batched to bound memory.

    On a GPU the CUDA kernel (:func:`engine.kernels.viterbi.viterbi_encode`, same results) runs
    instead where it applies (``table`` one of the codebooks); ``use_kernel=False`` forces this
    torch path (tests, benchmarks).
    """
    check_bits(k)
    if use_kernel and x.is_cuda:
        from engine import kernels

        codebook = codebook_of_table(table)
        states = None if codebook is None else kernels.viterbi.viterbi_encode(x, k, codebook)
        if states is not None:
            return states
    if batch is None:
        per_tile = TILE_VALUES * (1 << (16 - k)) + 3 * _STATES * 4
        batch = max(1, _BATCH_BYTES // per_tile)
    out = [encode_tiles_batch(x[i : i + batch], k, table) for i in range(0, x.shape[0], batch)]
    return torch.cat(out) if out else torch.empty(0, TILE_VALUES, dtype=torch.int32, device=x.device)


def codebook_of_table(table: torch.Tensor) -> str | None:
    """Which codebook a value table is (the kernel computes the values arithmetically), else None.

    The converter passes the cached :func:`~engine.exl3.codebooks.codebook_table` tensors, so
    the identity test is the usual answer; any other table is compared by value.
    """
    from engine.exl3.codebooks import CODEBOOKS, codebook_table

    for known, name in _known_tables:
        if known is table and table._version == 0:  # unchanged since it was recognised
            return name
    found = None
    if table.shape == (_STATES,):
        for name in CODEBOOKS:
            ref = codebook_table(name, table.device)
            if ref is table or torch.equal(ref, table.to(ref.dtype)):
                found = name
                break
    if found is not None and not table.requires_grad and table._version == 0:
        # Remember it (held alive, so the identity test stays valid): the converter passes the
        # same table for every strip, and torch.equal would sync the host each time.
        _known_tables.append((table, found))
        del _known_tables[:-8]
    return found


_known_tables: list[tuple[torch.Tensor, str]] = []
