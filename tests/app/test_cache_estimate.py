"""The app's torch-free KV-cache memory estimate agrees with the engine's cache layout."""

from __future__ import annotations

import pytest

from engine.inspect import CACHE_BITS_CHOICES, ModelInfo, kv_bytes_per_token


@pytest.mark.parametrize("heads,head_dim", [(1, 64), (2, 80), (4, 128), (8, 96), (3, 72), (2, 256), (1, 8)])
def test_bytes_per_token_matches_the_engine(heads: int, head_dim: int) -> None:
    from engine.cache.quantized import bytes_per_token  # imports torch: only here, not in the app

    for bits in (*CACHE_BITS_CHOICES, 7):
        for dense in (2, 4):
            assert kv_bytes_per_token(heads, head_dim, bits, dense) == bytes_per_token(
                heads, head_dim, bits, dense
            )


def test_estimate_shrinks_with_the_cache_bits() -> None:
    info = ModelInfo(path=None, name="m", num_layers=4, num_kv_heads=2, head_dim=64, weight_bytes=10**6)
    ctx = 4096
    full = info.kv_cache_bytes(ctx, 2)
    assert full == 2 * 4 * 2 * 64 * ctx * 2  # keys + values, fp16
    assert info.kv_cache_bytes(ctx, 2, (16, 16)) == full
    # 4-bit: 64 numbers -> 32 bytes of codes + 2 scales of 2 bytes, per head and token.
    assert info.kv_cache_bytes(ctx, 2, (4, 4)) == 4 * ctx * 2 * 2 * (32 + 4)
    sizes = [info.kv_cache_bytes(ctx, 2, (b, b)) for b in CACHE_BITS_CHOICES]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    # Keys and values are independent: 4/8 lies between 4/4 and 8/8.
    assert (
        info.kv_cache_bytes(ctx, 2, (4, 4))
        < info.kv_cache_bytes(ctx, 2, (4, 8))
        < info.kv_cache_bytes(ctx, 2, (8, 8))
    )
    # The whole estimate follows (on the GPU and on the CPU, where an unquantized cache is fp32).
    for device in ("cuda", "cpu"):
        assert (
            info.memory_needed(ctx, device, (2, 2))
            < info.memory_needed(ctx, device, (8, 8))
            < info.memory_needed(ctx, device)
        )


def test_head_size_the_quantized_cache_cannot_pack_is_estimated_unquantized() -> None:
    info = ModelInfo(path=None, name="m", num_layers=1, num_kv_heads=1, head_dim=36)
    assert info.kv_cache_bytes(10, 2, (4, 4)) == info.kv_cache_bytes(10, 2)
