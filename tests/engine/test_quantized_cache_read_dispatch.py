"""Which quantized-cache reads go to the CUDA kernel (engine.kernels.attention.quantized_cache_read),
checked on the CPU with a stand-in extension; the kernel's numbers are tested in tests/cuda."""

from __future__ import annotations

import types

import torch

from engine.cache.quantized import QuantizedStore
from engine.kernels import attention, loader


def _filled(head_dim: int = 64, bits: int = 4) -> QuantizedStore:
    store = QuantizedStore(16, 2, head_dim, bits, "cpu")
    store.write(torch.arange(16), torch.randn(16, 2, head_dim))
    return store


class FakeExtension(types.SimpleNamespace):
    def __init__(self) -> None:
        super().__init__(calls=[])

    def quantized_cache_read(self, codes, scales, slots, bits, dtype):
        self.calls.append((codes, scales, slots, bits, dtype))
        return torch.full((slots.numel(), codes.shape[1], codes.shape[2] * 8), 7.0, dtype=dtype)


def test_cpu_read_is_the_torch_path():
    store = _filled()
    slots = torch.tensor([3, 3, 0, 15, 7])
    assert attention.quantized_cache_read(store, slots, torch.float16) is None
    want = store.dequantize(store.codes[slots], store.scales[slots], torch.float16)
    assert torch.equal(store.read(slots, torch.float16), want)


def test_kernel_gets_the_store_and_int64_slots(monkeypatch):
    fake = FakeExtension()
    monkeypatch.setattr(loader, "kernel_ready", lambda *tensors: fake)
    store = _filled(bits=5)
    slots = torch.tensor([4, 1, 1], dtype=torch.int32)
    out = store.read(slots, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 2, 64) and (out == 7).all()
    ((codes, scales, passed, bits, dtype),) = fake.calls
    assert codes is store.codes and scales is store.scales and bits == 5 and dtype == torch.bfloat16
    assert passed.dtype == torch.int64 and passed.is_contiguous() and passed.tolist() == [4, 1, 1]


def test_cases_left_to_the_torch_path(monkeypatch):
    fake = FakeExtension()
    monkeypatch.setattr(loader, "kernel_ready", lambda *tensors: fake)
    store, slots = _filled(), torch.tensor([0, 5])
    # fp32 (the exact reference the GPU tests compare against) and 16-number groups (head size 48)
    want = store.dequantize(store.codes[slots], store.scales[slots], torch.float32)
    assert torch.equal(store.read(slots, torch.float32), want)
    assert attention.quantized_cache_read(_filled(head_dim=48), slots, torch.float16) is None
    assert fake.calls == []
    # An extension built before the kernel existed
    monkeypatch.setattr(loader, "kernel_ready", lambda *tensors: types.SimpleNamespace())
    assert attention.quantized_cache_read(store, slots, torch.float16) is None


def test_reads_past_the_kernels_index_range_stay_on_torch(monkeypatch):
    fake = FakeExtension()
    monkeypatch.setattr(loader, "kernel_ready", lambda *tensors: fake)
    store = _filled()  # 2 heads of 64: 16 units per slot
    monkeypatch.setattr(attention, "QUANTIZED_READ_MAX_UNITS", 16 * 4)
    assert attention.quantized_cache_read(store, torch.arange(4), torch.float16) is not None
    assert attention.quantized_cache_read(store, torch.arange(5), torch.float16) is None
