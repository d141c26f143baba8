"""The app's torch-free KV-cache memory estimate agrees with the engine's cache layout."""

from __future__ import annotations

import json

import pytest

from engine.cache_footprint import CacheFootprint, snapshot_capacity
from engine.inspect import CACHE_BITS_CHOICES, ModelInfo, inspect_model, kv_bytes_per_token


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


# LFM2's layout: attention at ``full_attn_idxs``, short convolutions elsewhere.
LFM2 = {
    "architectures": ["Lfm2ForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "full_attn_idxs": [3],
    "conv_L_cache": 3,
}


def _inspect(tmp_path, config: dict) -> ModelInfo:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return inspect_model(tmp_path)


def test_a_hybrid_counts_kv_for_its_attention_layers_and_state_per_sequence(tmp_path) -> None:
    """Keys and values only for the attention layer; each convolution's window once per sequence
    slot (16), the scratch slot and the snapshot pool (two per slot, one per page at most)."""
    info = _inspect(tmp_path, LFM2)
    attention = 2 * 2 * 16 * 2  # one layer's keys and values: 2 heads x 16, fp16
    state = 3 * 64 * 2 * 2  # three convolutions' last 2 inputs of 64, fp16 (the cache's dtype)
    assert info.kv_cache_bytes(4096, 2) == 4096 * attention + (16 + 1 + 32) * state  # 64 pages
    assert info.kv_cache_bytes(128, 2) == 128 * attention + (16 + 1 + 2) * state  # 2 pages
    # Quantized widths shrink only the keys and values: 16 numbers -> 8 bytes of codes + a scale.
    assert info.kv_cache_bytes(4096, 2, (4, 4)) == 4096 * 2 * 2 * (8 + 2) + (16 + 1 + 32) * state
    assert info.memory_needed(4096, "cuda") > info.memory_needed(1024, "cuda")


def test_each_layer_keeps_its_own_part_of_the_cache(tmp_path) -> None:
    """What a layer split puts beside each layer: the convolutions' fixed state (its copies in the
    slots and the snapshot pool), the attention layer's keys and values for the context."""
    info = _inspect(tmp_path, LFM2)
    state = 64 * 2 * 2  # one convolution's last 2 inputs of 64, fp16
    attention = 2 * 2 * 16 * 2
    assert info.layer_cache_bytes(4096) == (49 * state,) * 3 + (4096 * attention,)
    assert sum(info.layer_cache_bytes(128, 2, (4, 4))) == info.kv_cache_bytes(128, 2, (4, 4))
    plain = ModelInfo(path=None, name="m", num_layers=4, num_kv_heads=2, head_dim=16)
    assert plain.layer_cache_bytes(100) == (100 * attention,) * 4
    assert ModelInfo(path=None, name="m", num_layers=2).layer_cache_bytes(100) == (0, 0)  # no shapes


def test_a_layer_that_keeps_nothing_has_no_cache_and_the_order_must_fit() -> None:
    """Nemotron-H's feed-forward-only layers and Gemma 4's readers of shared keys keep nothing."""
    footprint = CacheFootprint(((2, 16),), ((10, 4),), layout=("state", "nothing", "kv"))
    parts = footprint.layer_cache_bytes(64, max_sequences=1)
    assert (
        parts[1] == 0
        and parts[2] == 64 * 2 * 2 * 16 * 2
        and sum(parts) == footprint.cache_bytes(64, max_sequences=1)
    )
    assert CacheFootprint(((2, 16),)).layer_cache_bytes(64) is None  # the order is unknown
    with pytest.raises(ValueError, match="1 kv layers for 2 shapes"):
        CacheFootprint(((2, 16), (2, 16)), layout=("kv", "nothing"))
    with pytest.raises(ValueError, match="unknown layer kinds in the layout: conv"):
        CacheFootprint(((2, 16),), layout=("kv", "conv"))


def test_the_snapshot_pool_never_outweighs_the_kv_pages() -> None:
    assert snapshot_capacity(64, 16, kv_bytes=10**9, state_bytes=1000) == 32  # two per sequence
    assert snapshot_capacity(8, 16, kv_bytes=10**9, state_bytes=1000) == 8  # one per page
    assert snapshot_capacity(64, 16, kv_bytes=10_500, state_bytes=1000) == 10  # the KV's bytes
    assert snapshot_capacity(64, 16, kv_bytes=10, state_bytes=1000) == 1  # but at least one
    assert snapshot_capacity(64, 0, kv_bytes=10**9, state_bytes=1000) == 0  # no recurrent state


def test_a_layout_of_an_unknown_family_is_estimated_as_attention(tmp_path) -> None:
    mystery = _inspect(tmp_path, dict(LFM2, architectures=["LlamaForCausalLM"], layer_types=["conv"] * 4))
    plain = ModelInfo(path=None, name="m", num_layers=4, num_kv_heads=2, head_dim=16)
    assert mystery.kv_cache_bytes(4096, 2) == plain.kv_cache_bytes(4096, 2) == 4 * 4096 * 2 * 2 * 16 * 2
