"""Fewer kernels per decode step (issue 6): the residual adds fused with the norms that follow
them, the one-launch KV write, the eager path's key positions made once per step.

On the CPU the restructured decoder must give bit for bit what the unfused one gave; the dispatch
to the CUDA kernels is checked with a stand-in extension (their numbers: tests/cuda).
"""

from __future__ import annotations

import types

import pytest
import torch

from engine.cache.paged import KVCacheLayer, PagedKVCache
from engine.cache.quantized import DenseStore, QuantizedStore
from engine.generation.step import StepItem, run_step
from engine.kernels import attention, fused, loader
from engine.model import load_model
from engine.modules.batch import BatchLayout, SequenceSlice
from engine.modules.decoder import CausalLM
from engine.modules.layer_norm import LayerNorm
from engine.modules.norms import RMSNorm, add_and_norm
from engine.modules.splice import InputSplice


def _unfused_forward(self, input_ids, batch, cache, logit_rows=None, splice=None):
    """CausalLM.forward as it was before the fusion: every add on its own, then the norm."""
    h = self.embed(input_ids)
    if splice is not None:
        h = splice.apply(h)
    for i, b in enumerate(self.blocks):
        a = b.mixer(b.mixer_norm(h), batch, cache.layer(i))
        if b.mixer_out_norm is not None:
            a = b.mixer_out_norm(a)
        h = h + a
        m = b.feed_forward(b.feed_forward_norm(h))
        if b.feed_forward_out_norm is not None:
            m = b.feed_forward_out_norm(m)
        h = h + m
        if splice is not None:
            h = splice.after_layer(i, h)
    if logit_rows is not None:
        h = h[logit_rows]
    logits = self.lm_head(self.final_norm(h)).float()
    if self.final_softcap is not None:
        logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
    return logits


def _steps(model, cache) -> list[torch.Tensor]:
    """A batched prefill (one sequence wants all rows' logits, one only the last: a row subset),
    then batched decode steps; every logits tensor in order."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (21, 6)]
    tables = [cache.pages.allocate(4) for _ in prompts]
    out = run_step(
        model, cache, [StepItem(prompts[0], 0, tables[0], "all"), StepItem(prompts[1], 0, tables[1], "last")]
    )
    past = [len(p) for p in prompts]
    for step in range(3):
        items = [StepItem([5 + step + i], past[i], tables[i]) for i in range(2)]
        out += run_step(model, cache, items)
        past = [p + 1 for p in past]
    return out


@pytest.mark.parametrize(
    "variant", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"]
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_restructured_decoder_is_bit_identical(variant, dtype, tiny_model_factory, monkeypatch):
    directory, _ = tiny_model_factory(variant)
    model = load_model(directory, device="cpu", dtype=dtype)
    torch_dtype = getattr(torch, dtype)

    def cache():
        return PagedKVCache.for_model(model.spec, 256, page_size=8, dtype=torch_dtype)

    fused = _steps(model.module, cache())
    with monkeypatch.context() as m:
        m.setattr(CausalLM, "forward", _unfused_forward)
        unfused = _steps(model.module, cache())
    assert len(fused) == len(unfused) == 8
    for f, u in zip(fused, unfused):
        assert f.dtype == u.dtype and torch.equal(f, u)


def test_block_forward_is_the_sum_of_residual_forward(tiny_model_factory):
    """DecoderBlock.forward (the converter runs blocks one at a time) is unchanged."""
    directory, _ = tiny_model_factory("Gemma3ForCausalLM")
    loaded = load_model(directory, device="cpu", dtype="bfloat16")
    block = loaded.module.blocks[1]
    h = torch.randn(7, 64, dtype=torch.bfloat16)
    layouts = []
    for _ in range(2):
        cache = PagedKVCache.for_model(loaded.spec, 64, page_size=8, dtype=torch.bfloat16)
        slots = cache.slots(cache.pages.allocate(1), 0, 7)
        layouts.append((BatchLayout([SequenceSlice(0, 7, 0, slots)], torch.arange(7), slots), cache.layer(1)))
    out = block(h, *layouts[0])
    b = block  # the unfused block, written out
    a = b.mixer_out_norm(b.mixer(b.mixer_norm(h), *layouts[1]))
    h2 = h + a
    expected = h2 + b.feed_forward_out_norm(b.feed_forward(b.feed_forward_norm(h2)))
    assert torch.equal(out, expected)


def test_splice_with_layer_additions_is_bit_identical(tiny_model_factory, monkeypatch):
    """Vectors added to the residual stream after some layers (Qwen3-VL deepstack) see the whole
    stream: the deferred add is done before them, and the result does not change."""
    directory, _ = tiny_model_factory("LlamaForCausalLM")
    loaded = load_model(directory, device="cpu", dtype="bfloat16")
    model = loaded.module
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 320, (9,), generator=gen)
    splice = InputSplice(
        torch.tensor([2, 3, 4]),
        torch.randn(3, 64, generator=gen),
        [torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen)],  # after layers 0 and 1
    )
    rows = torch.tensor([4, 8])

    def run():
        cache = PagedKVCache.for_model(loaded.spec, 64, page_size=8, dtype=torch.bfloat16)
        slots = cache.slots(cache.pages.allocate(2), 0, 9)
        batch = BatchLayout([SequenceSlice(0, 9, 0, slots)], torch.arange(9), slots)
        return model(ids, batch, cache, rows, splice=splice)

    fused = run()
    monkeypatch.setattr(CausalLM, "forward", _unfused_forward)
    assert torch.equal(fused, run())


def test_add_and_norm_on_the_cpu_is_the_two_torch_steps():
    gen = torch.Generator().manual_seed(0)
    h, d = torch.randn(3, 32, generator=gen).bfloat16(), torch.randn(3, 32, generator=gen).bfloat16()
    for norm in (
        RMSNorm(torch.rand(32, generator=gen).bfloat16(), 1e-6),
        RMSNorm(torch.rand(32, generator=gen).bfloat16(), 1e-6, offset=1.0),
        LayerNorm(torch.rand(32, generator=gen).bfloat16(), torch.zeros(32).bfloat16(), 1e-5),
    ):
        s, y = add_and_norm(h, d, norm)
        assert s.dtype == torch.bfloat16 and torch.equal(s, h + d)
        assert torch.equal(y, norm(h + d))


def test_one_key_positions_tensor_per_step():
    batch = BatchLayout([], torch.arange(3), torch.arange(3))
    first = batch.key_positions(2, 9, torch.device("cpu"))
    assert first.tolist() == list(range(2, 9))
    assert batch.key_positions(2, 9, "cpu") is first  # shared by every layer
    assert batch.key_positions(0, 9, "cpu").tolist() == list(range(9))


# -- dispatch to the kernels, with a stand-in extension ----------------------------------------


class FakeExtension(types.SimpleNamespace):
    """Computes what the kernels compute, with torch, and records the calls."""

    def __init__(self) -> None:
        super().__init__(calls=[])

    def rms_norm(self, x, weight, eps, offset):  # makes kernels.fused._fused_ready accept it
        raise AssertionError("not expected here")

    def add_rms_norm(self, h, delta, weight, eps, offset):
        self.calls.append(("add_rms_norm", h, delta, weight, eps, offset))
        s = h + delta
        return s, RMSNorm(weight, eps, offset)(s)

    def kv_cache_write(self, k, v, slots, k_cache, v_cache):
        self.calls.append(("kv_cache_write", k, v, slots, k_cache, v_cache))
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)

    def rope_kv_write(self, q, k, v, cos, sin, slots, k_cache, v_cache):
        self.calls.append(("rope_kv_write", q, k, v, slots, k_cache, v_cache))
        return q.clone()  # the dispatch is under test here; the kernel's bits are a GPU test's


@pytest.fixture
def fake(monkeypatch) -> FakeExtension:
    ext = FakeExtension()
    monkeypatch.setattr(loader, "kernel_ready", lambda *tensors: ext)
    return ext


def test_add_rms_norm_gets_rows_and_returns_the_callers_shape(fake):
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(2, 3, 48, generator=gen).half()
    d = torch.randn(2, 3, 48, generator=gen).half()
    w = torch.rand(48, generator=gen).half()
    s, y = fused.add_rms_norm(h, d, w, 1e-5, 1.0)
    assert s.shape == y.shape == h.shape and torch.equal(s, h + d)
    assert torch.equal(y, RMSNorm(w, 1e-5, 1.0)(h + d))
    ((_, rh, rd, rw, eps, offset),) = fake.calls
    assert rh.shape == rd.shape == (6, 48) and rw is w and (eps, offset) == (1e-5, 1.0)


def test_add_rms_norm_leaves_other_cases_to_torch(fake, monkeypatch):
    h, w = torch.randn(4, 16).half(), torch.ones(16).half()
    assert fused.add_rms_norm(h, torch.randn(4, 16).float(), w, 1e-5, 0.0) is None  # mixed dtypes
    assert fused.add_rms_norm(h, torch.randn(4, 16).half(), w.float(), 1e-5, 0.0) is None
    assert fused.add_rms_norm(h, torch.randn(1, 16).half(), w, 1e-5, 0.0) is None  # broadcast
    assert fused.add_rms_norm(h, torch.randn(16, 4).half().t(), w, 1e-5, 0.0) is None  # strided inner dim
    assert fused.add_rms_norm(h, h, torch.ones(8).half(), 1e-5, 0.0) is None  # weight width
    # A strided weight: its contiguous copy would be a kernel's output, which a chained norm reads
    # before it waits for the kernels before it (ext/chained_launch.cuh): torch computes it.
    assert fused.add_rms_norm(h, h, torch.ones(32).half()[::2], 1e-5, 0.0) is None
    assert fused.add_rms_norm(h.to(torch.float64), h.to(torch.float64), w.double(), 1e-5, 0.0) is None
    assert fake.calls == []
    monkeypatch.setattr(loader, "kernel_ready", lambda *tensors: types.SimpleNamespace(rms_norm=None))
    assert fused.add_rms_norm(h, h, w, 1e-5, 0.0) is None  # an extension built before the kernel


def _dense_layer(dtype=torch.float16, heads=2, head_dim=8) -> KVCacheLayer:
    return KVCacheLayer(
        DenseStore(32, heads, head_dim, dtype, "cpu"), DenseStore(32, heads, head_dim, dtype, "cpu"), dtype
    )


def test_kv_write_of_two_dense_sides_is_one_call(fake):
    layer = _dense_layer()
    qkv = torch.randn(3, (4 + 2 + 2) * 8).half()  # k and v as column slices of a fused qkv output
    k, v = qkv[:, 32:48].view(3, 2, 8), qkv[:, 48:].view(3, 2, 8)
    slots = torch.tensor([9, 0, 31], dtype=torch.int32)
    layer.write(slots, k, v)
    ((name, fk, fv, fslots, kc, vc),) = fake.calls
    assert name == "kv_cache_write" and fk is k and fv is v
    assert kc is layer.keys.data and vc is layer.values.data
    assert fslots.dtype == torch.int64 and fslots.tolist() == [9, 0, 31]
    keys, values = layer.read(torch.tensor([9, 0, 31]))
    assert torch.equal(keys, k) and torch.equal(values, v)


def test_kv_write_leaves_other_cases_to_the_stores(fake, monkeypatch):
    slots = torch.tensor([1, 2])
    k = torch.randn(2, 2, 8).half()
    mixed = KVCacheLayer(
        DenseStore(32, 2, 8, torch.float16, "cpu"), QuantizedStore(32, 2, 8, 4, "cpu"), torch.float16
    )
    mixed.write(slots, k, k)  # one quantized side
    layer = _dense_layer()
    layer.write(slots, k.float(), k.float())  # needs a dtype conversion
    assert torch.equal(layer.read(slots)[0], k.float().half())
    layer.write(slots, torch.randn(2, 8, 2).half().transpose(1, 2), k)  # heads not contiguous
    assert attention.kv_cache_write(layer.keys, layer.values, slots, k[:, :1], k) is None  # wrong head count
    assert attention.kv_cache_write(layer.keys, layer.values, slots[:1], k, k) is None  # one slot per row
    assert fake.calls == []
    monkeypatch.setattr(loader, "kernel_ready", lambda *tensors: types.SimpleNamespace())
    assert attention.kv_cache_write(layer.keys, layer.values, slots, k, k) is None  # an older extension


def test_rope_kv_write_dispatch_and_what_it_leaves_to_two_launches(fake):
    layer = _dense_layer()
    qkv = torch.randn(3, (4 + 2 + 2) * 8).half()  # q, k and v as column slices of one output
    q, k, v = qkv[:, :32].view(3, 4, 8), qkv[:, 32:48].view(3, 2, 8), qkv[:, 48:].view(3, 2, 8)
    cos, sin = torch.ones(3, 1, 8).half(), torch.zeros(3, 1, 8).half()
    slots = torch.tensor([9, 0, 31], dtype=torch.int32)
    assert layer.write_rotated(slots, q, k, v, (cos, sin)) is not None
    ((name, fq, fk, fv, fslots, kc, vc),) = fake.calls
    assert name == "rope_kv_write" and fq is q and fk is k and fv is v
    assert kc is layer.keys.data and vc is layer.values.data
    assert fslots.dtype == torch.int64 and fslots.tolist() == [9, 0, 31]
    fake.calls.clear()
    quantized = KVCacheLayer(
        QuantizedStore(32, 2, 8, 4, "cpu"), QuantizedStore(32, 2, 8, 4, "cpu"), torch.float16
    )
    assert quantized.write_rotated(slots, q, k, v, (cos, sin)) is None  # quantized sides
    assert layer.write_rotated(slots, q, k, v, (cos.float(), sin.float())) is None  # table dtype
    assert layer.write_rotated(slots[:2], q, k, v, (cos, sin)) is None  # one slot per token
    assert layer.write_rotated(slots, q, k, v[:, :1], (cos, sin)) is None  # v is not k's shape
    assert layer.write_rotated(slots, q.transpose(1, 2), k, v, (cos, sin)) is None  # q's heads strided
    assert fake.calls == []


def test_kv_write_on_the_cpu_is_index_copy():
    layer = _dense_layer(torch.bfloat16)
    k, v = torch.randn(4, 2, 8).bfloat16(), torch.randn(4, 2, 8).bfloat16()
    slots = torch.tensor([3, 1, 30, 7])
    assert attention.kv_cache_write(layer.keys, layer.values, slots, k, v) is None
    layer.write(slots, k, v)
    assert torch.equal(layer.keys.data[slots], k) and torch.equal(layer.values.data[slots], v)
