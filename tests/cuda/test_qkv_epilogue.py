"""The decode step's q/k/v GEMV that also rotates by RoPE and writes the KV cache (one launch),
against the projection launch followed by the RoPE + KV-write launch (GPU only)."""

from __future__ import annotations

import pytest
import torch

from engine.cache.paged import DenseStore, KVCacheLayer, PagedKVCache
from engine.cache.quantized import QuantizedStore
from engine.exl3 import EXL3Linear
from engine.generation.cuda_graph import DecodeGraphs
from engine.generation.step import StepItem, run_step
from engine.kernels import gemv
from engine.loading.synthetic_store import synthetic_model
from engine.modules.linear import ProjectionGroup
from engine.modules.rope import RopeSpec, RotaryEmbedding

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("cuda_extension")]


@pytest.fixture(autouse=True)
def _needs_the_int8_gemv():
    if not gemv.int8_gemv_available(torch.device("cuda")):
        pytest.skip("the int8 GEMV (sm_90+, the cluster GEMV) is not available here")


def _linear(in_f: int, out_f: int, k: int, g: torch.Generator, bias: bool = False) -> EXL3Linear:
    t = torch.randint(
        -(2**15), 2**15, (in_f // 16, out_f // 16, 16 * k), dtype=torch.int16, device="cuda", generator=g
    )
    suh = (torch.where(torch.rand(in_f, device="cuda", generator=g) < 0.5, -1.0, 1.0)).half()
    svh = (torch.where(torch.rand(out_f, device="cuda", generator=g) < 0.5, -1.0, 1.0) * 0.05).half()
    b = torch.randn(out_f, device="cuda", generator=g) if bias else None
    return EXL3Linear(t, suh, svh, "mul1", in_f, out_f, b, mode="streaming", dtype=torch.float16)


def _group(in_f: int, heads: int, kv_heads: int, head_dim: int, bias: bool = False) -> ProjectionGroup:
    g = torch.Generator(device="cuda").manual_seed(in_f + heads + head_dim)
    outs = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    return ProjectionGroup([(_linear(in_f, o, k, g, bias), [o]) for o, k in zip(outs, (4, 3, 5))])


def _cache(dtype, kv_heads: int, head_dim: int, slots: int = 256) -> KVCacheLayer:
    layer = KVCacheLayer(
        DenseStore(slots, kv_heads, head_dim, dtype, "cuda"),
        DenseStore(slots, kv_heads, head_dim, dtype, "cuda"),
        dtype,
    )
    layer.keys.data.copy_(torch.randn_like(layer.keys.data))  # rows not written must stay as they are
    layer.values.data.copy_(torch.randn_like(layer.values.data))
    return layer


def _twin(layer: KVCacheLayer) -> KVCacheLayer:
    twin = _cache(layer.dtype, layer.keys.data.shape[1], layer.keys.data.shape[2], layer.keys.data.shape[0])
    twin.keys.data.copy_(layer.keys.data)
    twin.values.data.copy_(layer.values.data)
    return twin


def _tables(head_dim: int, rows: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    rope = RotaryEmbedding(RopeSpec(theta=500000.0), head_dim, 8192).cuda()
    return rope.tables(torch.tensor([37, 4001, 5][:rows], device="cuda"), dtype)


def _apart(group, x, layer, slots, tables, heads, kv_heads, head_dim) -> torch.Tensor:
    """The two launches: the q/k/v GEMV, then RoPE + the KV write."""
    q, k, v = group(x)
    q = q.view(-1, heads, head_dim)
    q_rot = layer.write_rotated(
        slots, q, k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim), tables
    )
    assert q_rot is not None
    return q_rot


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
# Llama-3.2-1B's head_dim 64 (two heads in a GEMV column group) and Llama-3.1-8B's 128.
@pytest.mark.parametrize(
    ("in_f", "heads", "kv_heads", "head_dim"), [(512, 8, 2, 64), (1024, 8, 2, 128), (256, 2, 1, 128)]
)
@pytest.mark.parametrize("rows", [1, 2])
def test_one_launch_equals_projection_then_rope_and_write(dtype, in_f, heads, kv_heads, head_dim, rows):
    group = _group(in_f, heads, kv_heads, head_dim)
    x = torch.randn(rows, in_f, device="cuda").to(dtype)
    tables = _tables(head_dim, rows, dtype)
    fused_cache = _cache(dtype, kv_heads, head_dim)
    apart_cache, before = _twin(fused_cache), _twin(fused_cache)
    slots = torch.tensor([17, 200][:rows], device="cuda")
    q = fused_cache.project_rotated(group, x, tables, slots, head_dim)
    assert q is not None, "the one-launch path did not take this case"
    want = _apart(group, x, apart_cache, slots, tables, heads, kv_heads, head_dim)
    assert torch.equal(q.view_as(want), want)  # bit for bit, as the two launches
    assert torch.equal(fused_cache.keys.data, apart_cache.keys.data)
    assert torch.equal(fused_cache.values.data, apart_cache.values.data)
    for side in ("keys", "values"):  # the rows at the slots were written, no other
        new, old = getattr(fused_cache, side).data, getattr(before, side).data
        assert (new != old).any(dim=(1, 2)).nonzero().flatten().tolist() == [17, 200][:rows]


def test_slots_outside_the_cache_write_nothing():
    dtype, heads, kv_heads, head_dim = torch.bfloat16, 4, 2, 64
    group = _group(256, heads, kv_heads, head_dim)
    x = torch.randn(2, 256, device="cuda").to(dtype)
    tables = _tables(head_dim, 2, dtype)
    layer = _cache(dtype, kv_heads, head_dim, slots=64)
    before_k, before_v = layer.keys.data.clone(), layer.values.data.clone()
    q = layer.project_rotated(group, x, tables, torch.tensor([-1, 64], device="cuda"), head_dim)
    assert q is not None
    assert torch.equal(layer.keys.data, before_k) and torch.equal(layer.values.data, before_v)
    outside = torch.tensor([-1, 64], device="cuda")
    want = _apart(
        group, x, _cache(dtype, kv_heads, head_dim, slots=64), outside, tables, heads, kv_heads, head_dim
    )
    assert torch.equal(q.view_as(want), want)  # every query still rotates


def test_cases_it_does_not_take_fall_back():
    dtype, heads, kv_heads, head_dim = torch.bfloat16, 4, 2, 64
    group = _group(256, heads, kv_heads, head_dim)
    layer, slots = _cache(dtype, kv_heads, head_dim), torch.tensor([1, 2, 3], device="cuda")
    x3 = torch.randn(3, 256, device="cuda").to(dtype)
    assert layer.project_rotated(group, x3, _tables(head_dim, 3, dtype), slots, head_dim) is None  # 3 rows
    x = torch.randn(1, 256, device="cuda").to(dtype)
    tables = _tables(head_dim, 1, dtype)
    assert layer.project_rotated(group, x.float(), tables, slots[:1], head_dim) is None  # fp32
    biased = _group(256, heads, kv_heads, head_dim, bias=True)
    assert layer.project_rotated(biased, x, tables, slots[:1], head_dim) is None  # a bias to add
    fused_qkv = ProjectionGroup([(group.linears[0], [heads * head_dim])])
    assert layer.project_rotated(fused_qkv, x, tables, slots[:1], head_dim) is None  # not three linears
    quantized = KVCacheLayer(
        QuantizedStore(64, kv_heads, head_dim, 4, "cuda"),
        QuantizedStore(64, kv_heads, head_dim, 4, "cuda"),
        dtype,
    )
    assert quantized.project_rotated(group, x, tables, slots[:1], head_dim) is None  # a quantized cache


TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}


def _decode_logits(model, batch: int, steps: int = 12) -> list[torch.Tensor]:
    """A prefill, then teacher-forced decode steps replayed from CUDA graphs."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (9, 14)[:batch]]
    forced = torch.randint(3, 500, (steps, batch), generator=gen).tolist()
    cache = PagedKVCache.for_model(model.spec, 256, page_size=8, dtype=model.dtype, device="cuda")
    tables = [cache.pages.allocate(6) for _ in prompts]
    out = run_step(model.module, cache, [StepItem(p, 0, t, "last") for p, t in zip(prompts, tables)])
    graphs = DecodeGraphs(model.module, cache, max_batch=2, min_pages=1)
    past = [len(p) for p in prompts]
    for tokens in forced:
        got = graphs.run([StepItem([t], n, table) for t, n, table in zip(tokens, past, tables)])
        assert got is not None and graphs.failed is None, graphs.failed
        out += got
        past = [n + 1 for n in past]
    return out


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_steps_give_the_same_logits_with_and_without_it(monkeypatch, batch):
    model = synthetic_model(TINY, 4, "cuda", torch.bfloat16)
    taken = []
    real = gemv.exl3_qkv_rope_write

    def spy(*args, **kwargs):
        q = real(*args, **kwargs)
        taken.append(q is not None)
        return q

    monkeypatch.setattr(gemv, "exl3_qkv_rope_write", spy)
    one_launch = _decode_logits(model, batch)
    assert taken and all(taken), "the decode steps did not take the one-launch path"

    def no_epilogue(*args, **kwargs):  # the caller then projects, rotates and writes apart
        return None

    real = no_epilogue  # what the spy calls from now on
    taken.clear()
    apart = _decode_logits(model, batch)
    assert not any(taken)
    assert len(one_launch) == len(apart)
    for i, (a, b) in enumerate(zip(one_launch, apart)):
        assert torch.equal(a, b), f"logits {i} differ: max {(a - b).abs().max().item()}"
