"""The 2-8 bit KV cache: packing, error per bit width, and a model running on it."""

import pytest
import torch

from engine.cache.paged import PagedKVCache, parse_cache_bits
from engine.cache.quantized import QuantizedStore, bytes_per_token, hadamard_matrix
from engine.generation.step import score_tokens
from engine.model import load_model


def test_hadamard_is_orthonormal():
    h = hadamard_matrix(32)
    assert torch.allclose(h @ h.T, torch.eye(32), atol=1e-6)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_codes_on_the_grid_round_trip_exactly(bits):
    store = QuantizedStore(4, 2, 64, bits, "cpu")
    levels = 2**bits - 1
    codes = torch.randint(0, levels + 1, (3, 2, 2, 32))
    codes[..., 0] = levels  # pin each group's maximum so the scale is exactly 1
    grid = (codes.float() - levels / 2) @ store.hadamard  # rotate back: writing rotates forward
    store.write(torch.tensor([0, 2, 3]), grid.reshape(3, 2, 64))
    back = store.read(torch.tensor([0, 2, 3]), torch.float32)
    assert torch.allclose(back, grid.reshape(3, 2, 64), atol=1e-3)


def test_reading_no_slots_gives_an_empty_result():
    # A read of zero slots must give an empty result (the torch path failed on it: reshape with -1).
    store = QuantizedStore(8, 2, 64, 4, "cpu")
    out = store.read(torch.empty(0, dtype=torch.int64), torch.float32)
    assert out.shape == (0, 2, 64) and out.dtype == torch.float32


def test_error_shrinks_with_bits_and_outliers_are_spread():
    x = torch.randn(256, 2, 128)
    x[:, :, 5] *= 20  # an outlier channel, as keys have
    errors = {}
    for bits in (2, 3, 4, 5, 6, 8):
        store = QuantizedStore(256, 2, 128, bits, "cpu")
        slots = torch.arange(256)
        store.write(slots, x)
        errors[bits] = ((store.read(slots, torch.float32) - x).norm() / x.norm()).item()
    assert all(errors[a] > errors[b] for a, b in zip((2, 3, 4, 5, 6), (3, 4, 5, 6, 8)))
    assert errors[8] < 0.01 and errors[4] < 0.12


def test_parse_cache_bits():
    assert parse_cache_bits(None) == (16, 16)
    assert parse_cache_bits("4") == (4, 4)
    assert parse_cache_bits("4,6") == (4, 6)
    with pytest.raises(ValueError, match="--cache-bits"):
        parse_cache_bits("9")


def test_memory_per_token_follows_bits():
    dense = bytes_per_token(8, 128, 16)
    assert dense == 2048
    assert bytes_per_token(8, 128, 4) == 8 * (64 + 8)
    assert bytes_per_token(8, 128, 2) < bytes_per_token(8, 128, 4) < bytes_per_token(8, 128, 8) < dense


@pytest.mark.parametrize("bits,tolerance", [((8, 8), 0.01), ((4, 6), 0.1), ((2, 2), 1.0)])
def test_model_runs_on_quantized_cache(tiny_model_factory, bits, tolerance):
    directory, _ = tiny_model_factory("Qwen3ForCausalLM")
    model = load_model(directory, device="cpu")
    ids = torch.randint(0, 320, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    exact = score_tokens(model.module, PagedKVCache.for_model(model.spec, 64, page_size=16), ids, chunk=16)
    cache = PagedKVCache.for_model(model.spec, 64, page_size=16, bits=bits)
    got = score_tokens(model.module, cache, ids, chunk=16)
    err = ((got - exact).norm() / exact.norm()).item()
    assert 0 < err < tolerance
    assert cache.nbytes < PagedKVCache.for_model(model.spec, 64, page_size=16).nbytes


def test_capacity_grows_as_bits_shrink(tiny_model_factory, capsys):
    from engine.cli import main

    directory, _ = tiny_model_factory("LlamaForCausalLM")
    assert main(["cache-capacity", "-m", str(directory), "--budget-gb", "1", "--json"]) == 0
    import json

    rows = {(r["k_bits"], r["v_bits"]): r["max_tokens"] for r in json.loads(capsys.readouterr().out)}
    # head_dim 16: 16 bits -> 32 bytes per head; 4 bits -> 8 bytes + one fp16 scale.
    assert rows[(4, 4)] / rows[(16, 16)] == pytest.approx(32 / 10, rel=0.01)
    assert rows[(2, 2)] > rows[(3, 3)] > rows[(4, 4)] > rows[(4, 6)] > rows[(8, 8)] > rows[(16, 16)]
