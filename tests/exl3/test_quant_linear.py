"""EXL3Linear (dense and streaming) against ExLlamaV3's layer outputs and float64 ground truth."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quant_helpers import rel_fro

from engine.exl3 import (
    EXL3Linear,
    MissingTensorError,
    TensorShapeError,
    exl3_tensor_names,
    is_exl3_linear,
    load_exl3_linear,
)
from engine.exl3.codebooks import CODEBOOKS, FLAG_VALUES
from engine.exl3.reconstruct import apply_scales, decode_trellis
from engine.exl3.trellis import pack_states, unpack_states

# Fixture README section 3: relative Frobenius error of the layer output.
Y_REL_FRO = 2e-3
Y_REL_FRO_MUL1_M1 = 1.5e-2  # ExLlamaV3's int8-activation GEMV for one row


def _fixture_tensors(ref, codebook: str, k: int) -> dict[str, torch.Tensor]:
    inputs = ref("trellis_inputs")
    t = {"trellis": inputs[f"K{k}.trellis"], "suh": inputs[f"K{k}.suh"], "svh": inputs[f"K{k}.svh"]}
    if codebook != "3inst":
        t[codebook] = torch.tensor(FLAG_VALUES[codebook], dtype=torch.int32)
    return t


@pytest.mark.parametrize("mode", ["dense", "streaming"])
@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("k", [2, 4, 6])
def test_forward_vs_reference(ref, mode: str, codebook: str, k: int) -> None:
    # The fixture linear is in = 128, out = 256 (non-square, catches transposes).
    layer = EXL3Linear.from_tensors(_fixture_tensors(ref, codebook, k), 128, 256, bias=None, mode=mode)
    assert layer.codebook == codebook and layer.bits == k
    x = ref("trellis_inputs")["x"]
    decoded = ref(f"trellis_decode_{codebook}")
    t = _fixture_tensors(ref, codebook, k)
    exact_w = apply_scales(decode_trellis(t["trellis"], codebook), t["suh"], t["svh"], torch.float64)
    for m in (1, 8, 160):
        y = layer(x[:m].float())
        assert y.shape == (m, 256) and y.dtype == torch.float32
        bound = Y_REL_FRO_MUL1_M1 if (codebook == "mul1" and m == 1) else Y_REL_FRO
        assert rel_fro(y, decoded[f"K{k}.y_m{m}"]) <= bound
        # Our reference path is essentially exact (float32 vs float64 ground truth).
        assert rel_fro(y, x[:m].double() @ exact_w) < 1e-5


def test_dense_equals_nn_linear_semantics(ref) -> None:
    t = _fixture_tensors(ref, "mcg", 4)
    bias = torch.randn(256, dtype=torch.float16)
    layer = EXL3Linear.from_tensors(t, 128, 256, bias=bias, mode="dense")
    w = layer.reconstruct()
    assert w.shape == (256, 128) and w.dtype == torch.float32  # HF orientation (out, in)
    x = torch.randn(2, 3, 128)
    ref_linear = torch.nn.Linear(128, 256)
    with torch.no_grad():
        ref_linear.weight.copy_(w)
        ref_linear.bias.copy_(bias.float())
    torch.testing.assert_close(layer(x), ref_linear(x))
    # bf16 / fp16 activations come back in their own dtype.
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_streaming_matches_dense_with_padding_and_bias() -> None:
    # A layer whose true sizes are not multiples of 128 (section 3.3): in 200 -> 256, out 300 -> 384.
    g = torch.Generator().manual_seed(0)
    k = 3
    trellis = torch.randint(-(2**15), 2**15, (16, 24, 16 * k), dtype=torch.int16, generator=g)
    suh = (torch.rand(256, generator=g) + 0.5).half()
    svh = (torch.rand(384, generator=g) + 0.5).half()
    svh[300:] = 0  # the converter zeroes padded output columns
    bias = torch.randn(384, generator=g).half()
    t = {"trellis": trellis, "suh": suh, "svh": svh, "bias": bias}
    dense = EXL3Linear.from_tensors(t, 200, 300, bias=None, mode="dense")
    stream = EXL3Linear.from_tensors(t, 200, 300, bias=None, mode="streaming")
    assert stream.trellis.dtype == torch.int16 and not hasattr(stream, "weight")
    x = torch.randn(5, 200, generator=g)
    yd, ys = dense(x), stream(x)
    assert yd.shape == ys.shape == (5, 300)
    torch.testing.assert_close(ys, yd, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(stream.reconstruct(), dense.reconstruct())
    # Exact: padded input rows meet zeros, padded outputs are trimmed.
    w = apply_scales(decode_trellis(trellis, "3inst"), suh, svh, torch.float64)[:200, :300]
    assert rel_fro(yd, x.double() @ w + bias[:300].double()) < 1e-5


def test_streaming_uses_row_blocks(monkeypatch) -> None:
    # Force several decode blocks and check they add up to the single-block result.
    import engine.exl3.exl3_linear as mod

    g = torch.Generator().manual_seed(1)
    t = {
        "trellis": torch.randint(-(2**15), 2**15, (16, 8, 32), dtype=torch.int16, generator=g),
        "suh": torch.ones(256, dtype=torch.float16),
        "svh": torch.ones(128, dtype=torch.float16),
    }
    layer = EXL3Linear.from_tensors(t, 256, 128, bias=None, mode="streaming")
    x = torch.randn(4, 256, generator=g)
    whole = layer(x)
    monkeypatch.setattr(mod, "_STREAM_BLOCK_WEIGHTS", 256 * 8 * 3)  # 3 tile rows per block
    torch.testing.assert_close(layer(x), whole, rtol=1e-5, atol=1e-5)


def test_legacy_sign_vectors() -> None:
    # su/sv (section 3.2) are packed sign bits; they must act exactly like the +-1 fp16 vectors.
    g = torch.Generator().manual_seed(2)
    trellis = torch.randint(-(2**15), 2**15, (8, 8, 32), dtype=torch.int16, generator=g)
    su = torch.randint(-(2**15), 2**15, (8,), dtype=torch.int16, generator=g)
    sv = torch.randint(-(2**15), 2**15, (8,), dtype=torch.int16, generator=g)
    from engine.exl3.reconstruct import expand_sign_bits

    legacy = EXL3Linear.from_tensors({"trellis": trellis, "su": su, "sv": sv}, 128, 128, None)
    modern = EXL3Linear.from_tensors(
        {"trellis": trellis, "suh": expand_sign_bits(su), "svh": expand_sign_bits(sv)}, 128, 128, None
    )
    assert torch.equal(legacy.reconstruct(), modern.reconstruct())


def test_errors_name_the_problem() -> None:
    trellis = torch.zeros(8, 16, 64, dtype=torch.int16)
    ok = {"trellis": trellis, "suh": torch.ones(128).half(), "svh": torch.ones(256).half()}
    with pytest.raises(MissingTensorError, match="svh"):
        EXL3Linear.from_tensors({"trellis": trellis, "suh": ok["suh"]}, 128, 256, None, name="x.q_proj")
    with pytest.raises(TensorShapeError, match="x.q_proj"):
        EXL3Linear.from_tensors(ok, 256, 128, None, name="x.q_proj")  # transposed sizes
    with pytest.raises(TensorShapeError, match="suh"):
        EXL3Linear.from_tensors({**ok, "suh": torch.ones(64).half()}, 128, 256, None)
    with pytest.raises(TensorShapeError, match="K"):
        EXL3Linear.from_tensors({**ok, "trellis": torch.zeros(8, 16, 160, dtype=torch.int16)}, 128, 256, None)
    with pytest.raises(TensorShapeError, match="mcg"):
        flags = {"mcg": torch.tensor(0), "mul1": torch.tensor(0)}
        EXL3Linear.from_tensors({**ok, **flags}, 128, 256, None)
    with pytest.raises(ValueError, match="mode"):
        EXL3Linear.from_tensors(ok, 128, 256, None, mode="sparse")


def test_load_from_model_file(exl3_dir: Path, ref) -> None:
    from safetensors import safe_open

    path = exl3_dir / "tiny-llama-exl3-2.5bpw-h4-mcg" / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        prefix = "model.layers.0.mlp.down_proj"
        assert is_exl3_linear(keys, prefix)
        assert not is_exl3_linear(keys, "model.embed_tokens")
        assert exl3_tensor_names(keys, prefix) == [f"{prefix}.{s}" for s in ("trellis", "suh", "svh", "mcg")]
        with_keys = load_exl3_linear(f.get_tensor, prefix, 512, 256, mode="streaming", keys=keys)

        def strict_get(name: str) -> torch.Tensor:
            if name not in keys:
                raise KeyError(name)
            return f.get_tensor(name)

        without_keys = load_exl3_linear(strict_get, prefix, 512, 256, mode="dense")
        with pytest.raises(MissingTensorError, match="gate_proj"):
            load_exl3_linear(strict_get, "model.layers.0.mlp.gate_proj_typo", 512, 256)
    assert with_keys.codebook == without_keys.codebook == "mcg"
    expected_q = ref("reconstructed_2.5bpw-h4-mcg")[f"{prefix}.q"]
    assert torch.equal(with_keys.inner_weight().view(torch.int16), expected_q.view(torch.int16))
    torch.testing.assert_close(with_keys.reconstruct(), without_keys.reconstruct())


def test_unpack_pack_on_layer_trellis(exl3_dir: Path) -> None:
    # The real converter's tiles satisfy the round trip too (the encoder's tail-biting paths).
    from safetensors import safe_open

    path = exl3_dir / "tiny-llama-exl3-5.5bpw-h8-3inst" / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        trellis = f.get_tensor("lm_head.trellis")
    assert torch.equal(pack_states(unpack_states(trellis), 8), trellis)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["dense", "streaming"])
def test_cuda_matches_cpu(ref, mode: str) -> None:
    t = _fixture_tensors(ref, "mul1", 4)
    cpu = EXL3Linear.from_tensors(t, 128, 256, None, mode=mode)
    gpu = EXL3Linear.from_tensors({k: v.cuda() for k, v in t.items()}, 128, 256, None, mode=mode)
    x = ref("trellis_inputs")["x"].float()
    torch.testing.assert_close(gpu(x.cuda()).cpu(), cpu(x), rtol=1e-4, atol=1e-3)
    if mode == "streaming":
        assert torch.equal(gpu.inner_weight().cpu().view(torch.int16), cpu.inner_weight().view(torch.int16))
