"""The gathered dequantizing read of a 2-8 bit cache (ext/quantized_cache_read.cu) against
:meth:`QuantizedStore.dequantize`, the torch path it replaces in prefill attention."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import capture

from engine.cache.quantized import QuantizedStore
from engine.kernels import attention

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("cuda_extension")]

# One unit in the last place, relative, of a normal number of each output type: the kernel and the
# torch path agree to fp32 rounding, so after the cast they differ by at most that.
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _store(bits: int, heads: int, head_dim: int, writer: str, num_slots: int = 512) -> QuantizedStore:
    """A store with random keys (an outlier channel, as real keys have) in every slot, written by
    the torch quantize path or the fused CUDA write."""
    g = torch.Generator(device="cuda").manual_seed(bits * 101 + head_dim + heads)
    store = QuantizedStore(num_slots, heads, head_dim, bits, "cuda")
    x = torch.randn(num_slots, heads, head_dim, generator=g, device="cuda")
    x[:, :, 3] *= 12
    x *= torch.rand(num_slots, 1, 1, generator=g, device="cuda") * 4  # scales differ per token
    slots = torch.randperm(num_slots, generator=g, device="cuda")  # written out of order
    if writer == "fused":
        assert attention.quantized_cache_write(store, slots, x.half()) is not None
    else:
        planes, scales = store.quantize(x)
        store.codes.index_copy_(0, slots, planes)
        store.scales.index_copy_(0, slots, scales)
    return store


def _check(store: QuantizedStore, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    got = attention.quantized_cache_read(store, slots, dtype)
    assert got is not None, "the kernel did not take this case"
    n, heads = slots.numel(), store.codes.shape[1]
    assert got.shape == (n, heads, store.head_dim) and got.dtype == dtype and got.is_contiguous()
    planes, scales = store.codes.index_select(0, slots), store.scales.index_select(0, slots)
    exact = store.dequantize(planes, scales, torch.float32)
    atol = 1e-5 * float(exact.abs().max()) if n else 0.0  # cancellation near zero: fp32 rounding only
    torch.testing.assert_close(got.float(), exact, rtol=ULP[dtype], atol=atol)
    # Against the torch path in the same dtype: at most one unit in the last place apart (the two
    # round at different points, so at 2-4 bits, whose outputs are few distinct values, up to ~7%
    # of them land one unit apart; measured on the H200).
    torch_path = store.dequantize(planes, scales, dtype)
    torch.testing.assert_close(got.float(), torch_path.float(), rtol=2 * ULP[dtype], atol=atol)
    return got


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("writer", ["torch", "fused"])
@pytest.mark.parametrize("heads", [1, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_read_equals_dequantize(bits, head_dim, heads, writer, dtype):
    store = _store(bits, heads, head_dim, writer)
    g = torch.Generator(device="cuda").manual_seed(bits + head_dim)
    num_slots = store.codes.shape[0]
    # A random order with repeats, a permutation of every slot, one slot, a contiguous run.
    _check(store, torch.randint(0, num_slots, (700,), generator=g, device="cuda"), dtype)
    _check(store, torch.randperm(num_slots, generator=g, device="cuda"), dtype)
    _check(store, torch.tensor([num_slots - 1], device="cuda"), dtype)
    _check(store, torch.arange(37, 37 + 301, device="cuda"), dtype)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5])
def test_tiny_reads_leave_the_rest_of_the_warp_idle(n):
    # 1 head of 64: 8 units per row, so n rows fill a fraction of one warp.
    store = _store(4, 1, 64, "torch", num_slots=16)
    slots = torch.arange(n, device="cuda").flip(0)
    got = _check(store, slots, torch.float16)
    assert got.shape == (n, 1, 64)


def test_other_head_size_multiple_of_32():
    store = _store(5, 2, 96, "torch", num_slots=64)  # 12 units per row: rows straddle warps
    _check(store, torch.randint(0, 64, (333,), device="cuda"), torch.bfloat16)


def test_int32_slots_are_accepted():
    store = _store(3, 8, 128, "fused")
    got = attention.quantized_cache_read(
        store, torch.arange(10, dtype=torch.int32, device="cuda"), torch.float16
    )
    want = attention.quantized_cache_read(store, torch.arange(10, device="cuda"), torch.float16)
    assert torch.equal(got, want)


def test_cases_the_kernel_does_not_take():
    store = _store(4, 2, 128, "torch", num_slots=32)
    slots = torch.arange(8, device="cuda")
    assert attention.quantized_cache_read(store, slots, torch.float32) is None  # fp32: the torch reference
    odd = QuantizedStore(32, 2, 48, 4, "cuda")  # group 16
    assert attention.quantized_cache_read(odd, slots, torch.float16) is None
    assert (
        attention.quantized_cache_read(QuantizedStore(32, 2, 128, 4, "cpu"), slots.cpu(), torch.float16)
        is None
    )


def test_store_read_uses_the_kernel(monkeypatch):
    store = _store(6, 8, 128, "fused")
    slots = torch.randint(0, 512, (200,), device="cuda")
    want = store.read(slots, torch.float32)  # the torch path (fp32 never goes to the kernel)
    calls = []
    real = attention.quantized_cache_read

    def spy(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(attention, "quantized_cache_read", spy)
    monkeypatch.setattr(store, "dequantize", lambda *a: pytest.fail("the torch path ran"))
    got = store.read(slots, torch.float16)
    assert calls == [True]
    torch.testing.assert_close(got.float(), want, rtol=ULP[torch.float16], atol=1e-4)


def test_graph_replay_with_new_slots_equals_eager():
    store = _store(4, 8, 128, "fused")
    slots = torch.randint(0, 512, (1000,), device="cuda")
    run = lambda: attention.quantized_cache_read(store, slots, torch.bfloat16)  # noqa: E731
    graph, out = capture(run)
    g = torch.Generator(device="cuda").manual_seed(5)
    for seed in range(3):
        slots.copy_(torch.randint(0, 512, (1000,), generator=g, device="cuda"))
        store.codes[seed] ^= 0x5A  # the cache contents may change between replays too
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run())
        _check(store, slots, torch.bfloat16)
