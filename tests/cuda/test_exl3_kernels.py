"""EXL3 CUDA kernels against the torch reference and ExLlamaV3's fixtures (GPU only). The decode
is also checked bit for bit by the whole-weight kernel's tests (tests/cuda/test_exl3_weight.py)."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
from cuda_helpers import capture, rel_fro

import engine.exl3
from engine import kernels
from engine.exl3 import EXL3Linear
from engine.exl3.codebooks import CODEBOOKS, FLAG_VALUES
from engine.exl3.hadamard import blockwise_hadamard
from engine.exl3.reconstruct import apply_scales, decode_trellis
from engine.kernels import gemv, loader

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("cuda_extension")]

ALL_K = range(1, 9)
# u is rounded to fp16 after the input rotation (the MMA operand) and the output to the
# activation dtype: relative Frobenius error ~3e-4 for fp16/fp32, ~2e-3 for bf16 outputs.
TOL = {torch.float16: 1.5e-3, torch.float32: 1.5e-3, torch.bfloat16: 6e-3}


def _random_layer(in_f: int, out_f: int, k: int, seed: int, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    trellis = torch.randint(
        -(2**15), 2**15, (in_f // 16, out_f // 16, 16 * k), dtype=torch.int16, generator=g
    )
    sign = torch.where(torch.rand(in_f, generator=g) < 0.5, -1.0, 1.0)
    suh = (sign * (torch.rand(in_f, generator=g) + 0.5)).half()
    svh = (
        (torch.rand(out_f, generator=g) + 0.5) * torch.where(torch.rand(out_f, generator=g) < 0.5, -1.0, 1.0)
    ).half()
    return trellis.to(device), suh.to(device), svh.to(device)


def _exact_w(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str) -> torch.Tensor:
    """W (in, out) in float64 from the CPU reference decoder."""
    return apply_scales(decode_trellis(trellis.cpu(), codebook), suh.cpu(), svh.cpu(), torch.float64)


# ---- GEMV (1..16 rows): every K and codebook, several shapes -----------------------------------


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("k", ALL_K)
@pytest.mark.parametrize("shape", [(128, 256), (384, 640), (2304, 384)])
def test_gemv_every_k_and_codebook(codebook: str, k: int, shape: tuple[int, int]) -> None:
    trellis, suh, svh = _random_layer(*shape, k, seed=k * 7 + shape[1])
    w = _exact_w(trellis, suh, svh, codebook)
    for m in range(1, 17):  # 9..16: two MMA column groups per decoded tile
        x = torch.randn(m, shape[0], device="cuda", dtype=torch.float16)
        y = gemv.exl3_gemv(x, trellis, suh, svh, codebook)
        assert y.shape == (m, shape[1]) and y.dtype == torch.float16
        assert rel_fro(y, x.double().cpu() @ w) < TOL[torch.float16], (m, k, codebook)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gemv_dtypes_and_every_output_written(dtype: torch.dtype) -> None:
    """The workspace split-K GEMV (the portable one), called directly: on sm_90+ the dispatch
    runs the cluster GEMV instead, so this is where the pre-Hopper kernel is checked."""
    ext = kernels.extension()
    trellis, suh, svh = _random_layer(512, 384, 4, seed=3)
    w = _exact_w(trellis, suh, svh, "mul1")
    for m in (1, 3, 8, 9, 16):
        x = torch.randn(m, 512, device="cuda").to(dtype)
        partial, counters = gemv._workspace(x.device, 512, 384, m)
        for splits in (1, 2, 4):  # single-block path and the split-K ticket path
            y = torch.full((m, 384), float("nan"), device="cuda", dtype=dtype)
            used = ext.exl3_gemv(
                x, trellis, suh, svh, y, partial, counters, loader.CODEBOOK_IDS["mul1"], splits
            )
            assert used == splits
            assert torch.isfinite(y).all()
            assert rel_fro(y, x.double().cpu() @ w) < TOL[dtype]
        assert int(counters.abs().sum()) == 0  # tickets reset for the next launch


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("k", ALL_K)
def test_workspace_gemv_two_column_groups(codebook: str, k: int) -> None:
    """The portable GEMV at 9..16 rows (one decode per tile, MMAs for rows 0-7 and 8-15): 18
    input chunks at 8 per block (its limit above 8 rows) take 3..18 splits."""
    trellis, suh, svh = _random_layer(2304, 384, k, seed=k * 11 + 5)
    w = _exact_w(trellis, suh, svh, codebook)
    for m in range(9, 17):
        x = torch.randn(m, 2304, device="cuda", dtype=torch.float16)
        for splits in (3, 0):
            y = gemv.exl3_gemv(x, trellis, suh, svh, codebook, splits=splits, cluster=False)
            assert y.shape == (m, 384)
            assert rel_fro(y, x.double().cpu() @ w) < TOL[torch.float16], (m, k, codebook, splits)


def test_gemv_split_choices_agree_and_repeat() -> None:
    trellis, suh, svh = _random_layer(2048, 256, 3, seed=11)
    w = _exact_w(trellis, suh, svh, "3inst")
    # 16 chunks: one split holds them all up to 8 rows; the workspace GEMV's 9..16-row blocks hold 8
    for m, counts in ((5, (1, 3, 16, 0, 0)), (13, (2, 3, 16, 0, 0))):
        x = torch.randn(m, 2048, device="cuda", dtype=torch.float16)
        ys = [gemv.exl3_gemv(x, trellis, suh, svh, "3inst", splits=s) for s in counts]
        for y in ys[1:]:
            assert rel_fro(y, ys[0]) < 1e-3
        assert rel_fro(ys[-1], x.double().cpu() @ w) < TOL[torch.float16]


def test_gemv_llama_shapes() -> None:
    for in_f, out_f in [(4096, 1024), (14336, 512)]:  # deep K (many splits) and a tall matrix
        trellis, suh, svh = _random_layer(in_f, out_f, 4, seed=in_f)
        q = decode_trellis(trellis, "mcg").double()
        for m in (8, 16):
            x = torch.randn(m, in_f, device="cuda", dtype=torch.float16)
            y = gemv.exl3_gemv(x, trellis, suh, svh, "mcg")
            u = blockwise_hadamard(x.double() * suh.double(), dim=-1)
            expected = blockwise_hadamard(u @ q, dim=-1) * svh.double()
            assert rel_fro(y, expected) < TOL[torch.float16], m


def test_gemv_rejects_bad_input() -> None:
    trellis, suh, svh = _random_layer(256, 128, 2, seed=1)
    with pytest.raises(ValueError, match="1..16"):
        gemv.exl3_gemv(torch.randn(17, 256, device="cuda").half(), trellis, suh, svh, "mcg")
    with pytest.raises(ValueError, match="256"):
        gemv.exl3_gemv(torch.randn(2, 128, device="cuda").half(), trellis, suh, svh, "mcg")


# ---- EXL3Linear through the hook: all batch sizes, padding, bias --------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_exl3_linear_streaming_on_gpu(dtype: torch.dtype) -> None:
    k = 5
    trellis, suh, svh = _random_layer(256, 384, k, seed=5, device="cpu")
    svh[300:] = 0
    bias = torch.randn(384).half()
    t = {"trellis": trellis, "suh": suh, "svh": svh, "mcg": torch.tensor(FLAG_VALUES["mcg"])}
    cpu = EXL3Linear.from_tensors(t, 200, 300, bias=bias, mode="streaming")
    gpu = EXL3Linear.from_tensors(
        {n: v.cuda() for n, v in t.items()}, 200, 300, bias=bias.cuda(), mode="streaming"
    )
    for m in (1, 2, 7, 8, 13, 16, 17, 32, 33, 160):
        x = torch.randn(2, m, 200)
        y = gpu(x.cuda().to(dtype))
        assert y.shape == (2, m, 300) and y.dtype == dtype
        tol = TOL[dtype] if m <= gemv.GEMV_MAX_ROWS or dtype != torch.float32 else 1e-5
        assert rel_fro(y, cpu(x)) < tol, m


def test_fp32_large_batch_keeps_reference_precision(ref) -> None:
    t = {
        "trellis": ref("trellis_inputs")["K4.trellis"],
        "suh": ref("trellis_inputs")["K4.suh"],
        "svh": ref("trellis_inputs")["K4.svh"],
        "mul1": torch.tensor(FLAG_VALUES["mul1"]),
    }
    cpu = EXL3Linear.from_tensors(t, 128, 256, None, mode="streaming")
    gpu = EXL3Linear.from_tensors({n: v.cuda() for n, v in t.items()}, 128, 256, None, mode="streaming")
    x = ref("trellis_inputs")["x"].float()
    torch.testing.assert_close(gpu(x.cuda()).cpu(), cpu(x), rtol=1e-4, atol=1e-3)
    # The fixture outputs of ExLlamaV3's own kernels (m = 1: its int8 GEMV, hence the looser bound).
    decoded = ref("trellis_decode_mul1")
    for m in (1, 8, 160):
        bound = 1.5e-2 if m == 1 else 2e-3
        assert rel_fro(gpu(x[:m].cuda().half()), decoded[f"K4.y_m{m}"]) < bound


def test_cuda_graph_replay_matches_eager() -> None:
    trellis, suh, svh = _random_layer(1024, 512, 4, seed=9)
    t = {"trellis": trellis, "suh": suh, "svh": svh}
    layer = EXL3Linear.from_tensors(t, 1024, 512, None, mode="streaming")
    x = torch.randn(4, 1024, device="cuda", dtype=torch.float16)
    eager = layer(x).clone()
    graph, out = capture(lambda: layer(x))
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_fro(out, layer(x)) < 1e-3
    assert eager.shape == out.shape


# ---- whole models: GPU logits vs the CPU reference ----------------------------------------------


@pytest.mark.parametrize("variant", ["4.0bpw-h6-mul1", "2.5bpw-h4-mcg", "5.5bpw-h8-3inst"])
def test_fixture_model_logits_on_gpu(exl3_dir: Path, ref, monkeypatch, variant: str) -> None:
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens
    from engine.model import load_model

    monkeypatch.setattr(
        engine.exl3, "load_exl3_linear", functools.partial(engine.exl3.load_exl3_linear, mode="streaming")
    )
    ids = ref("logits")["input_ids"][0].tolist()
    model = load_model(exl3_dir / f"tiny-llama-exl3-{variant}", device="cuda", dtype=torch.float32)
    layers = [m for m in model.module.modules() if isinstance(m, EXL3Linear)]
    assert len(layers) == 15 and all(m.mode == "streaming" and m.trellis.is_cuda for m in layers)
    cache = PagedKVCache.for_model(model.spec, len(ids), page_size=16, dtype=model.dtype, device=model.device)
    got = score_tokens(model.module, cache, ids, chunk=13).float().cpu()  # 13-row chunks: two-group GEMVs
    spec = ref("logits")[f"spec_fp32.{variant}"][0]
    assert got.shape == spec.shape
    diff = (got - spec).abs()
    assert diff.max().item() < 0.05 and math.sqrt(diff.pow(2).mean().item()) < 0.01
    assert (got.argmax(-1) == spec.argmax(-1)).float().mean().item() >= 31 / 32
