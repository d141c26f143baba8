"""The fused decode-step kernels (ext/fused_ops.cu) against the torch modules they replace."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import capture

from engine import kernels
from engine.cache.paged import KVCacheLayer
from engine.cache.quantized import DenseStore, QuantizedStore
from engine.kernels import attention, loader
from engine.kernels import fused as fused_ops
from engine.modules.mlp import ACTIVATIONS
from engine.modules.norms import RMSNorm, add_and_norm
from engine.modules.rope import RopeSpec, RotaryEmbedding

pytestmark = pytest.mark.cuda

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _tol(dtype: torch.dtype) -> dict:
    # One rounding of the output dtype (rsqrt/exp may differ from torch's by an ulp in fp32); the
    # Llama RMSNorm rounds twice (x / rms, then * weight), so fp16 allows two ulps.
    return {
        torch.float16: {"rtol": 2e-3, "atol": 2e-3},
        torch.bfloat16: {"rtol": 8e-3, "atol": 8e-3},
        torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    }[dtype]


def _torch_path(module, *args):
    """The module's own torch code on the GPU (the fused op switched off)."""
    saved = loader.kernel_ready
    loader.kernel_ready = lambda *t: None
    try:
        return module(*args)
    finally:
        loader.kernel_ready = saved


@pytest.fixture(autouse=True)
def _need_extension():
    if kernels.extension() is None:
        pytest.skip(f"CUDA extension unavailable: {kernels.status()['reason']}")


@pytest.mark.parametrize("dtype", DTYPES)
# 4100 (not a multiple of 8: scalar accesses) and 40000 (over 4 vectors x 1024 threads) take the
# two-pass loop; the others fit the registers (kRegPacks in ext/fused_ops.cu).
@pytest.mark.parametrize("width", [64, 576, 2048, 4096, 5120, 2304, 4100, 40000])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("rows", [1, 3, 257])
def test_rms_norm_matches_module(dtype, width, offset, rows) -> None:
    torch.manual_seed(width + rows)
    weight = (torch.randn(width, device="cuda") * 0.2 + (0.0 if offset else 1.0)).to(dtype)
    norm = RMSNorm(weight, 1e-6, offset)
    x = (torch.randn(rows, width, device="cuda") * 3).to(dtype)
    fused = fused_ops.rms_norm(x, norm.weight, norm.eps, norm.offset)
    assert fused is not None and fused.dtype == dtype and fused.shape == x.shape
    torch.testing.assert_close(fused, _torch_path(norm, x), **_tol(dtype))
    # The module takes the fused path on its own.
    torch.testing.assert_close(norm(x), fused, rtol=0, atol=0)


def test_rms_norm_strided_rows() -> None:
    x = torch.randn(5, 3 * 256, device="cuda", dtype=torch.float16)[:, 256:512]
    norm = RMSNorm(torch.ones(256, device="cuda", dtype=torch.float16), 1e-5)
    torch.testing.assert_close(norm(x), _torch_path(norm, x.contiguous()), **_tol(torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
# (80, 0.25): 10 rotated pairs per head, not a whole 16-byte vector: the scalar kernel runs.
@pytest.mark.parametrize(("head_dim", "partial"), [(64, 1.0), (128, 1.0), (256, 1.0), (96, 0.5), (80, 0.25)])
@pytest.mark.parametrize("tokens", [1, 7, 130, 1000])
def test_rope_matches_module(dtype, head_dim, partial, tokens) -> None:
    torch.manual_seed(head_dim + tokens)
    rope = RotaryEmbedding(RopeSpec(theta=10000.0, partial_rotary_factor=partial), head_dim, 4096).cuda()
    positions = torch.randint(0, 4000, (tokens,), device="cuda")
    tables = rope.tables(positions, dtype)
    # q and k as the column slices of one fused projection output, as in attention.
    qkv = torch.randn(tokens, (8 + 2 + 2) * head_dim, device="cuda").to(dtype)
    q = qkv[:, : 8 * head_dim].view(tokens, 8, head_dim)
    k = qkv[:, 8 * head_dim : 10 * head_dim].view(tokens, 2, head_dim)
    fq, fk = rope.apply_pair(q, k, tables)
    tq, tk = _torch_path(lambda a, b: (rope.apply(a, tables), rope.apply(b, tables)), q, k)
    torch.testing.assert_close(fq, tq, **_tol(dtype))
    torch.testing.assert_close(fk, tk, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh", "gelu", "relu"])
# 1004: not a multiple of a 16-byte vector (the scalar kernel); 2000 rows: prefill sizes.
@pytest.mark.parametrize(("rows", "width"), [(1, 14336), (5, 1536), (64, 8192), (3, 1004), (2000, 2048)])
def test_act_mul_matches_torch(dtype, activation, rows, width) -> None:
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * width, device="cuda") * 2).to(dtype)
    gate, up = gate_up[:, :width], gate_up[:, width:]
    fused = fused_ops.act_mul(gate, up, activation)
    assert fused is not None
    expected = ACTIVATIONS[activation](gate) * up
    torch.testing.assert_close(fused, expected, **_tol(dtype))


def test_fused_ops_in_a_cuda_graph() -> None:
    x = torch.randn(4, 1024, device="cuda", dtype=torch.float16)
    norm = RMSNorm(torch.rand(1024, device="cuda", dtype=torch.float16) + 0.5, 1e-5)
    eager = norm(x)
    static_x = x.clone()
    graph, out = capture(lambda: norm(static_x))
    static_x.copy_(x * 2)
    graph.replay()
    torch.testing.assert_close(out, norm(x * 2), rtol=0, atol=0)
    assert not torch.equal(out, eager)


# -- residual add + RMSNorm in one launch ----------------------------------------------------------

ADD_NORM_WIDTHS = [576, 2048, 4096, 5120, 2304, 64, 4100, 40000]  # the last two: the two-pass loop
ADD_NORM_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 1000]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", ADD_NORM_WIDTHS)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("rows", ADD_NORM_ROWS)
def test_add_rms_norm_matches_add_then_norm(dtype, width, offset, rows) -> None:
    torch.manual_seed(width * 7 + rows)
    weight = (torch.randn(width, device="cuda") * 0.2 + (0.0 if offset else 1.0)).to(dtype)
    norm = RMSNorm(weight, 1e-6, offset)
    h = (torch.randn(rows, width, device="cuda") * 3).to(dtype)
    delta = (torch.randn(rows, width, device="cuda") * 2).to(dtype)
    fused = fused_ops.add_rms_norm(h, delta, norm.weight, norm.eps, norm.offset)
    assert fused is not None
    s, y = fused
    assert s.dtype == y.dtype == dtype and s.shape == y.shape == h.shape
    # The sum is exactly what torch's add stores (the CPU path and the decoder's numerics rely on it)
    assert torch.equal(s, h + delta)
    # ... and the norm is the rms_norm kernel's arithmetic on it, bit for bit ...
    assert torch.equal(y, fused_ops.rms_norm(h + delta, norm.weight, norm.eps, norm.offset))
    # ... so within one rounding of the torch module.
    torch.testing.assert_close(y, _torch_path(norm, h + delta), **_tol(dtype))
    # add_and_norm (what the decoder calls) takes the fused path on its own.
    s2, y2 = add_and_norm(h, delta, norm)
    assert torch.equal(s2, s) and torch.equal(y2, y)


def test_add_rms_norm_strided_rows_and_leading_dims() -> None:
    big_h = torch.randn(6, 3 * 512, device="cuda", dtype=torch.bfloat16)
    big_d = torch.randn(6, 2 * 512, device="cuda", dtype=torch.bfloat16)
    h, delta = big_h[:, 512:1024], big_d[:, 512:]  # row strides 1536 and 1024
    norm = RMSNorm(torch.rand(512, device="cuda", dtype=torch.bfloat16) + 0.5, 1e-5)
    s, y = fused_ops.add_rms_norm(h, delta, norm.weight, norm.eps, norm.offset)
    assert torch.equal(s, h + delta) and torch.equal(y, norm(h + delta))
    h3, d3 = h.contiguous().view(2, 3, 512), delta.contiguous().view(2, 3, 512)
    s3, y3 = fused_ops.add_rms_norm(h3, d3, norm.weight, norm.eps, norm.offset)
    assert s3.shape == y3.shape == (2, 3, 512) and torch.equal(y3.view(6, 512), y)
    # Nothing to do for zero rows.
    s0, y0 = fused_ops.add_rms_norm(h[:0], delta[:0], norm.weight, norm.eps, norm.offset)
    assert s0.shape == y0.shape == (0, 512)


def test_add_rms_norm_in_a_cuda_graph() -> None:
    norm = RMSNorm(torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5, 1e-5)
    h, delta = (torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    graph, (s, y) = capture(lambda: add_and_norm(h, delta, norm))
    new_h, new_d = torch.randn_like(h), torch.randn_like(delta)
    h.copy_(new_h)
    delta.copy_(new_d)
    graph.replay()
    assert torch.equal(s, new_h + new_d) and torch.equal(y, norm(new_h + new_d))


# -- keys and values into the dense cache in one launch ------------------------------------------


def _kv_layer(dtype, kv_heads, head_dim, slots=2048) -> KVCacheLayer:
    layer = KVCacheLayer(
        DenseStore(slots, kv_heads, head_dim, dtype, "cuda"),
        DenseStore(slots, kv_heads, head_dim, dtype, "cuda"),
        dtype,
    )
    layer.keys.data.copy_(torch.randn_like(layer.keys.data))  # untouched rows must stay as they are
    layer.values.data.copy_(torch.randn_like(layer.values.data))
    return layer


def _kv(tokens, kv_heads, head_dim, dtype, fused_qkv):
    """k and v as the attention has them: separate tensors, or column slices of one qkv output."""
    if not fused_qkv:
        return (torch.randn(tokens, kv_heads, head_dim, device="cuda").to(dtype) for _ in range(2))
    q_width, kv_width = 4 * kv_heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_width + 2 * kv_width, device="cuda").to(dtype)
    k = qkv[:, q_width : q_width + kv_width].view(tokens, kv_heads, head_dim)
    return k, qkv[:, q_width + kv_width :].view(tokens, kv_heads, head_dim)


# (8, 128), (2, 64), (1, 256): 16-byte words; (3, 6) fp16: 36-byte rows, 4-byte words; (1, 3) fp16: 2.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(8, 128), (2, 64), (1, 256), (3, 6), (1, 3)])
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 8, 1000])
@pytest.mark.parametrize("fused_qkv", [False, True])
def test_kv_cache_write_matches_index_copy(dtype, kv_heads, head_dim, tokens, fused_qkv) -> None:
    torch.manual_seed(tokens + head_dim)
    layer, ref = _kv_layer(dtype, kv_heads, head_dim), _kv_layer(dtype, kv_heads, head_dim)
    ref.keys.data.copy_(layer.keys.data)
    ref.values.data.copy_(layer.values.data)
    k, v = _kv(tokens, kv_heads, head_dim, dtype, fused_qkv)
    slots = torch.randperm(2048, device="cuda")[:tokens]
    assert attention.kv_cache_write(layer.keys, layer.values, slots, k, v) is not None
    ref.keys.data.index_copy_(0, slots, k)
    ref.values.data.index_copy_(0, slots, v)
    assert torch.equal(layer.keys.data, ref.keys.data) and torch.equal(layer.values.data, ref.values.data)


def test_kv_cache_layer_write_takes_the_fused_path(monkeypatch) -> None:
    layer = _kv_layer(torch.float16, 8, 128)
    k, v = _kv(4, 8, 128, torch.float16, True)
    slots = torch.tensor([5, 900, 17, 2047], device="cuda", dtype=torch.int32)
    calls = []
    real = attention.kv_cache_write
    monkeypatch.setattr(attention, "kv_cache_write", lambda *a: calls.append(real(*a)) or calls[-1])
    layer.write(slots, k, v)
    assert len(calls) == 1 and calls[0] is not None  # the kernel wrote both sides
    keys, values = layer.read(slots.long())
    assert torch.equal(keys, k) and torch.equal(values, v)


def test_kv_cache_write_skips_slots_outside_the_cache(cuda_extension) -> None:
    layer = _kv_layer(torch.bfloat16, 2, 64, slots=64)
    before_k, before_v = layer.keys.data.clone(), layer.values.data.clone()
    k, v = _kv(3, 2, 64, torch.bfloat16, False)
    cuda_extension.kv_cache_write(
        k, v, torch.tensor([-1, 64, 10], device="cuda"), layer.keys.data, layer.values.data
    )
    before_k[10], before_v[10] = k[2], v[2]
    assert torch.equal(layer.keys.data, before_k) and torch.equal(layer.values.data, before_v)


def test_kv_cache_write_in_a_cuda_graph() -> None:
    layer, ref = _kv_layer(torch.bfloat16, 8, 128), _kv_layer(torch.bfloat16, 8, 128)
    k, v = _kv(2, 8, 128, torch.bfloat16, True)
    slots = torch.tensor([3, 4], device="cuda")
    graph, _ = capture(lambda: layer.write(slots, k, v))
    new_k, new_v = torch.randn_like(k), torch.randn_like(v)
    k.copy_(new_k)
    v.copy_(new_v)
    slots.copy_(torch.tensor([100, 7], device="cuda"))
    ref.keys.data.copy_(layer.keys.data)
    ref.values.data.copy_(layer.values.data)
    graph.replay()
    ref.keys.data[[100, 7]] = new_k
    ref.values.data[[100, 7]] = new_v
    assert torch.equal(layer.keys.data, ref.keys.data) and torch.equal(layer.values.data, ref.values.data)


# -- RoPE and the KV write in one launch ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
# (80, 0.25): the scalar kernel (10 rotated pairs per head, not a whole 16-byte vector).
@pytest.mark.parametrize(("head_dim", "partial"), [(128, 1.0), (64, 1.0), (96, 0.5), (80, 0.25)])
@pytest.mark.parametrize("tokens", [1, 3, 8, 300])
def test_rope_kv_write_equals_rope_then_kv_write(dtype, head_dim, partial, tokens) -> None:
    """q rotated, the rotated keys and the values in the cache: bit for bit what fused_ops.rope then
    attention.kv_cache_write give, with q/k/v as column slices of one fused projection output."""
    torch.manual_seed(head_dim + tokens)
    rope = RotaryEmbedding(RopeSpec(theta=10000.0, partial_rotary_factor=partial), head_dim, 4096).cuda()
    tables = rope.tables(torch.randint(0, 4000, (tokens,), device="cuda"), dtype)
    qkv = torch.randn(tokens, (8 + 2 + 2) * head_dim, device="cuda").to(dtype)
    q = qkv[:, : 8 * head_dim].view(tokens, 8, head_dim)
    k = qkv[:, 8 * head_dim : 10 * head_dim].view(tokens, 2, head_dim)
    v = qkv[:, 10 * head_dim :].view(tokens, 2, head_dim)
    layer, ref = _kv_layer(dtype, 2, head_dim), _kv_layer(dtype, 2, head_dim)
    ref.keys.data.copy_(layer.keys.data)
    ref.values.data.copy_(layer.values.data)
    slots = torch.randperm(2048, device="cuda")[:tokens]
    q_fused = layer.write_rotated(slots, q, k, v, tables)
    assert q_fused is not None
    q_ref, k_ref = fused_ops.rope(q, k, *tables)
    assert attention.kv_cache_write(ref.keys, ref.values, slots, k_ref, v) is not None
    assert torch.equal(q_fused, q_ref)
    assert torch.equal(layer.keys.data, ref.keys.data) and torch.equal(layer.values.data, ref.values.data)


def test_rope_kv_write_skips_slots_outside_the_cache_and_falls_back_for_quantized() -> None:
    rope = RotaryEmbedding(RopeSpec(theta=10000.0), 64, 4096).cuda()
    tables = rope.tables(torch.tensor([3, 9, 27], device="cuda"), torch.bfloat16)
    q = torch.randn(3, 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = _kv(3, 2, 64, torch.bfloat16, False)
    layer = _kv_layer(torch.bfloat16, 2, 64, slots=64)
    before_k, before_v = layer.keys.data.clone(), layer.values.data.clone()
    q_fused = layer.write_rotated(torch.tensor([-1, 64, 10], device="cuda"), q, k, v, tables)
    q_ref, k_ref = fused_ops.rope(q, k, *tables)
    assert torch.equal(q_fused, q_ref)  # every query rotates, whatever its slot
    before_k[10], before_v[10] = k_ref[2], v[2]
    assert torch.equal(layer.keys.data, before_k) and torch.equal(layer.values.data, before_v)
    quantized = KVCacheLayer(
        QuantizedStore(64, 2, 64, 4, "cuda"), QuantizedStore(64, 2, 64, 4, "cuda"), torch.bfloat16
    )
    assert quantized.write_rotated(torch.tensor([1, 2, 3], device="cuda"), q, k, v, tables) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "spec, head_dim",
    [
        (
            RopeSpec(
                theta=500000.0,
                kind="llama3",
                params={
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            ),
            128,
        ),
        (RopeSpec(theta=10000.0), 64),
        (
            RopeSpec(
                theta=1e6, kind="yarn", params={"factor": 4.0, "original_max_position_embeddings": 32768}
            ),
            128,
        ),
        (RopeSpec(theta=10000.0, partial_rotary_factor=0.5), 96),
    ],
    ids=["llama3", "default-64", "yarn", "partial"],
)
def test_rope_tables_equal_torch_formula_bit_for_bit(spec, head_dim, dtype, monkeypatch):
    """The one-launch cos/sin tables equal the torch formula's (nine launches) bit for bit, at
    every position up to 128K, scaled (yarn's attention factor) or not."""
    rope = RotaryEmbedding(spec, head_dim, 131072).cuda()
    positions = torch.cat([torch.arange(0, 4096), torch.randint(4096, 131072, (2048,))]).cuda()
    assert (
        fused_ops.rope_tables(positions, rope.inv_freq, rope.attention_factor, dtype) is not None
    )  # the kernel runs
    cos, sin = rope.tables(positions, dtype)
    with monkeypatch.context() as m:
        m.setattr(fused_ops, "rope_tables", lambda *args: None)
        ref_cos, ref_sin = rope.tables(positions, dtype)
    assert cos.shape == ref_cos.shape == (positions.numel(), 1, rope.rotary_dim)
    assert cos.dtype == sin.dtype == dtype
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert rope.tables(positions[:0], dtype)[0].shape == (0, 1, rope.rotary_dim)
