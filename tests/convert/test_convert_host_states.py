"""The converter's state handling on the CPU: block runs into a reused buffer, the chunked
per-block error, the tuning runner's output device, host page-locking (a CUDA-only step, faked
here) and the quantizer's bounded-memory proxy error and packing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine.cache.state import KVPages
from engine.convert.block_quantizer import tuning_runner
from engine.convert.block_runner import block_device, forward_rows, relative_frobenius, run_block, run_rows
from engine.convert.calibration_rows import calibration_ids
from engine.convert.host_states import HostPins
from engine.convert.options import ConvertOptions
from engine.convert.pipeline import convert_model
from engine.convert.quantize import _pack, _proxy_ratio, _proxy_terms
from engine.exl3.trellis import pack_states


@pytest.fixture(scope="module")
def block_and_states(tmp_path_factory) -> tuple[nn.Module, torch.Tensor]:
    """Block 0 of a random 2-layer Llama and embedded random calibration rows (5 x 16)."""
    from engine.bench.conversion import write_random_model
    from engine.model import load_model
    from engine.shapes import shape_config

    directory = tmp_path_factory.mktemp("tiny") / "llama"
    cfg = shape_config("llama3.2-1b")
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    cfg.update(num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=64)
    write_random_model(directory, cfg)
    model = load_model(directory, device="cpu", dtype=torch.float32).module
    ids = calibration_ids(directory, 5, 16, 96, 1.0, seed=0)
    with torch.inference_mode():
        hidden = model.embed(ids) * 50
    return model.blocks[0], hidden.clone()


def test_run_block_into_a_given_buffer(block_and_states) -> None:
    block, hidden = block_and_states
    with torch.inference_mode():
        fresh = run_block(block, hidden, 2)
        buffer = torch.full_like(hidden, float("nan"))
        returned = run_block(block, hidden, 2, out=buffer)
        in_place = run_block(block, hidden.clone(), 2, in_place=True)
    assert returned is buffer
    assert torch.equal(buffer, fresh)  # every row written, the same values
    assert torch.equal(in_place, fresh)
    assert not torch.equal(fresh, hidden)


def test_run_rows_and_forward_rows_agree(block_and_states) -> None:
    block, hidden = block_and_states
    with torch.inference_mode():
        a = run_rows(block, hidden[:2])
        b = forward_rows(block, hidden[:2])
    assert torch.equal(a, b) and b.device == block_device(block)


def test_relative_frobenius_is_the_direct_formula() -> None:
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(7, 5, 12, generator=gen)
    out = ref + 0.03 * torch.randn(7, 5, 12, generator=gen)
    direct = float((out.double() - ref.double()).norm() / ref.double().norm())
    for chunk in (1, 2, 3, 7, 100):
        assert relative_frobenius(out, ref, chunk, torch.device("cpu")) == pytest.approx(direct, rel=1e-12)
    assert relative_frobenius(ref, ref, 2, torch.device("cpu")) == 0.0
    zero = torch.zeros(2, 3, 4)
    assert relative_frobenius(zero, zero, 1, torch.device("cpu")) == 0.0


class _MetaBlock(nn.Module):
    """A stand-in block on the ``meta`` device: returns its input (shape-only, no data)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, device="meta"))
        self.state = KVPages(kv_heads=1, head_dim=4)  # what its mixer keeps per sequence

    def forward(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        return x * self.weight


def test_the_tuning_runner_keeps_the_output_on_the_blocks_device() -> None:
    """Host states: the tuning loss must be computed where the block runs (the GPU in a real
    run), so the runner moves the rows there and leaves the output there. A ``meta`` block
    stands for the other device here."""
    block = _MetaBlock()
    rows = torch.ones(2, 3, 4)  # on the host
    out = tuning_runner(block)(rows)
    assert out.device.type == "meta" and out.shape == rows.shape
    with pytest.raises((NotImplementedError, RuntimeError)):
        run_rows(block, rows)  # brings the output home: impossible from meta


def test_pinning_is_skipped_without_cuda(monkeypatch) -> None:
    def no_cuda():
        raise AssertionError("CUDA runtime touched on a CPU conversion")

    monkeypatch.setattr(torch.cuda, "cudart", no_cuda)
    notes: list[str] = []
    with HostPins(torch.device("cpu"), notes.append) as pins:
        t = torch.zeros(4, 5)
        assert pins.pin(t) is False
        pins.unpin(t)
    assert notes == []


class _FakeCudart:
    def __init__(self, result: int) -> None:
        self.result = result
        self.registered: dict[int, int] = {}
        self.cleared = 0

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        assert flags == 0
        if self.result == 0:
            self.registered[ptr] = nbytes
        return self.result

    def cudaHostUnregister(self, ptr: int) -> int:
        del self.registered[ptr]
        return 0

    def cudaGetLastError(self) -> int:
        self.cleared += 1
        return 0


def test_pinning_registers_exactly_the_tensor_and_unregisters(monkeypatch) -> None:
    fake = _FakeCudart(0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    notes: list[str] = []
    a, b = torch.zeros(3, 5, 7), torch.zeros(11)
    with HostPins(torch.device("cuda", 0), notes.append) as pins:
        assert pins.pin(a) and pins.pin(b) and pins.pin(a)  # a second pin is a no-op
        assert fake.registered == {a.data_ptr(): 3 * 5 * 7 * 4, b.data_ptr(): 44}  # no rounding up
        pins.unpin(b)
        assert fake.registered == {a.data_ptr(): 420}
        assert not pins.pin(torch.zeros(2, 3).t())  # not contiguous: left pageable
    assert fake.registered == {}  # everything unregistered on the way out
    assert len(notes) == 1 and "pageable" in notes[0]


def test_a_failed_registration_leaves_the_states_pageable(monkeypatch) -> None:
    fake = _FakeCudart(2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    notes: list[str] = []
    with HostPins(torch.device("cuda", 0), notes.append) as pins:
        assert pins.pin(torch.zeros(8)) is False
    assert fake.cleared == 1 and fake.registered == {}
    assert len(notes) == 1 and "error 2" in notes[0] and "same results" in notes[0]


def test_proxy_error_in_column_blocks_is_the_whole_sum(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(32, 48, generator=gen)
    q = target + 0.1 * torch.randn(32, 48, generator=gen)
    a = torch.randn(32, 32, generator=gen, dtype=torch.float64)
    h = a @ a.T
    e, t = (target - q).double(), target.double()
    whole = float(((h @ e) * e).sum() / ((h @ t) * t).sum())
    plain = float(e.pow(2).sum() / t.pow(2).sum())
    monkeypatch.setattr("engine.convert.quantize.PROXY_BLOCK", 32 * 5)  # 5 columns per block

    def proxy(hessian):  # as the quantizer takes it: the error's terms over the target's
        return _proxy_ratio(_proxy_terms(target - q, hessian), _proxy_terms(target, hessian))

    assert proxy(h) == pytest.approx(whole, rel=1e-12)
    assert proxy(None) == pytest.approx(plain, rel=1e-12)


@pytest.mark.parametrize("k", [1, 3, 6, 8])
def test_packing_in_blocks_of_tiles_is_bit_identical(monkeypatch, k: int) -> None:
    states = torch.randint(
        0, 65536, (5, 3, 256), generator=torch.Generator().manual_seed(k), dtype=torch.int32
    )
    monkeypatch.setattr("engine.convert.quantize.PACK_TILES", 4)  # one row of 3 tiles per step
    assert torch.equal(_pack(states, k), pack_states(states, k))


def test_rfn_logged_per_block(tmp_path: Path, block_and_states, monkeypatch) -> None:
    """The converter reports the chunked relative error (finite, small: a 6-bit block)."""
    from quant_helpers import cheap_encoder

    import engine.convert.quantize as quantize_mod
    from engine.bench.conversion import write_random_model
    from engine.shapes import shape_config

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    src = tmp_path / "src"
    cfg = shape_config("llama3.2-1b")
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    cfg.update(num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=64)
    write_random_model(src, cfg)
    options = ConvertOptions(
        bits=6.0,
        head_bits=6,
        cal_rows=3,
        cal_cols=16,
        random_rows_fraction=1.0,
        device="cpu",
        allocation="uniform",
    )
    report = convert_model(src, tmp_path / "out", options, log=lambda m: None)
    rfns = [b["rfn"] for b in report.blocks]
    assert len(rfns) == 2 and all(0 < r < 0.2 for r in rfns)
