"""Encoder side: tail-biting Viterbi, block LDL, per-linear quantization, the convert pipeline.

The Viterbi costs ~65 536 states x 512 steps per tile, so on CPU these tests use a handful of
tiles; the pipeline test swaps in a cheap (valid, low-quality) encoder so it checks structure
fast. Quality figures (MSE per K, converted-model KL) come from ``python -m engine.convert.mse``
and a GPU conversion, see the closing report of issue 3.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quant_helpers import cheap_encoder

import engine.convert.quantize as quantize_mod
from engine.convert.ldl import block_ldl
from engine.convert.viterbi import encode_tiles
from engine.exl3 import EXL3Linear, load_quantization_config
from engine.exl3.codebooks import codebook_table
from engine.exl3.trellis import pack_states, unpack_states


def test_viterbi_recovers_an_exact_path() -> None:
    # Values that some tail-biting path decodes to exactly: the optimum has zero error.
    k = 3
    table = codebook_table("mcg")
    gen = torch.Generator().manual_seed(0)
    trellis = torch.randint(-(2**15), 2**15, (2, 16 * k), dtype=torch.int16, generator=gen)
    x = table[unpack_states(trellis).long()].float()
    states = encode_tiles(x, k, table)
    assert torch.equal(table[states.long()].float(), x)
    # The result is a valid tail-biting path: it survives pack -> unpack.
    assert torch.equal(unpack_states(pack_states(states, k)), states)


def test_viterbi_beats_nearest_free_path() -> None:
    # On Gaussian data the trellis code at K=2 lands near its known MSE (~0.07 at the best
    # scale), far below what K=2 scalar quantization gets (0.118, Lloyd-Max).
    k = 2
    table = codebook_table("3inst")
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1))
    scale = 0.95 * float(table.float().std())
    states = encode_tiles(x * scale, k, table)
    mse = float(((table[states.long()].float() / scale - x) ** 2).mean())
    assert mse < 0.1
    assert torch.equal(unpack_states(pack_states(states, k)), states)


def test_block_ldl_factorises() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(200, 64, generator=gen, dtype=torch.float64)
    h = x.T @ x / 200
    lower, damp = block_ldl(h, damping=0.0)
    assert damp == 0.0
    blocks = lower.reshape(4, 16, 4, 16)
    for i in range(4):
        assert torch.allclose(blocks[i, :, i, :], torch.eye(16, dtype=torch.float64), atol=1e-10)
        for j in range(i + 1, 4):
            assert blocks[i, :, j, :].abs().max() == 0  # block lower-triangular
    # H = L D L^T with D block diagonal: L^{-1} H L^{-T} has no off-diagonal blocks.
    l_inv = torch.linalg.inv(lower)
    d = (l_inv @ h @ l_inv.T).reshape(4, 16, 4, 16).clone()
    for i in range(4):
        d[i, :, i, :] = 0
    assert d.abs().max() < 1e-8 * h.abs().max()
    messages: list[str] = []
    eye, damp = block_ldl(torch.full((16, 16), float("nan")), warn=messages.append)
    assert damp == float("inf") and torch.equal(eye, torch.eye(16, dtype=torch.float64)) and messages
    # A singular Hessian (rank 1) still factorises thanks to damping.
    v = torch.randn(32, 1, generator=gen, dtype=torch.float64)
    _, damp = block_ldl(v @ v.T, damping=0.0, warn=messages.append)
    assert 0 < damp < float("inf")


def test_quantize_weight_round_trip(monkeypatch) -> None:
    # Padding (200 x 300 -> 256 x 384), the scale/sign bookkeeping and the stored layout, with a
    # cheap encoder: what comes back must be the weight up to the (coarse) quantization error.
    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(300, 200, generator=gen) * 0.02
    w[5] = 0  # a dead output channel
    x = torch.randn(512, 200, generator=gen)
    qt = quantize_mod.quantize_weight(w, x.T @ x / 512, 4, "mul1", seed=1)
    assert qt.trellis.shape == (16, 24, 64) and qt.trellis.dtype == torch.int16
    assert qt.suh.shape == (256,) and qt.svh.shape == (384,) and qt.suh.dtype == torch.float16
    assert (qt.svh[300:] == 0).all() and qt.svh[5] == 0
    tensors = qt.tensors("layer")
    assert set(tensors) == {"layer.suh", "layer.svh", "layer.mul1", "layer.trellis"}
    layer = EXL3Linear.from_tensors(tensors, 200, 300, None)
    w_hat = layer.reconstruct()
    assert w_hat.shape == (300, 200) and (w_hat[5] == 0).all()
    rel = float((w_hat - w).norm() / w.norm())
    assert rel < 0.3  # greedy at K=4: ~0.15; a transposition or sign slip gives ~1.4


@pytest.mark.slow
def test_convert_pipeline(exl3_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from engine.cache.paged import PagedKVCache
    from engine.convert.errors import ConvertError
    from engine.convert.options import ConvertOptions
    from engine.convert.pipeline import convert_model
    from engine.generation.step import score_tokens
    from engine.model import load_model

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    src, dst = exl3_dir / "tiny-llama-hf", tmp_path / "out"
    options = ConvertOptions(bits=2.5, head_bits=4, codebook="mcg", cal_rows=2, cal_cols=32, device="cpu")
    logs: list[str] = []
    report = convert_model(src, dst, options, log=logs.append)
    assert report.bits == 2.5 and len(report.blocks) == 2 and all("rfn" in b for b in report.blocks)
    assert any("block 2/2" in line for line in logs)
    # The reference layout: flags, tensor_storage, copied tokenizer, no work dir left behind.
    cfg = load_quantization_config(dst)
    assert cfg is not None and cfg.codebook == "mcg" and cfg.head_bits == 4 and cfg.bits == 2.5
    q_proj = cfg.tensor_storage["model.layers.0.self_attn.q_proj"]
    assert set(q_proj.stored_tensors) == {
        f"model.layers.0.self_attn.q_proj.{s}" for s in ("suh", "svh", "mcg", "trellis")
    }
    assert cfg.tensor_storage["lm_head"].bits_per_weight == 4
    assert (dst / "tokenizer.json").is_file() and not (dst / ".exl3_work").exists()
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "exl3"
    # It loads back in our engine, every projection and the head as EXL3 linears.
    model = load_model(dst, device="cpu", dtype=torch.float32)
    linears = [m for m in model.module.modules() if isinstance(m, EXL3Linear)]
    assert len(linears) == 15 and {m.bits for m in linears} >= {2, 3}
    cache = PagedKVCache.for_model(model.spec, 16, page_size=16)
    logits = score_tokens(model.module, cache, [1, 5, 9, 13])
    assert logits.shape == (4, 2048) and torch.isfinite(logits).all()
    # A second run into the same directory needs --resume once the first saved work (finished
    # blocks, the bit allocation); with it, finished blocks are reused.
    work = dst / ".exl3_work"
    work.mkdir()
    (work / "block_0000.safetensors").write_bytes(b"")
    with pytest.raises(ConvertError, match="resume"):
        convert_model(src, dst, options, log=logs.append)


@pytest.mark.slow
def test_a_run_that_saved_nothing_does_not_block_the_next(
    exl3_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    from engine.convert.options import ConvertOptions
    from engine.convert.pipeline import convert_model
    from engine.errors import EngineError

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    good = exl3_dir / "tiny-llama-hf"
    bad = tmp_path / "truncated"
    bad.mkdir()
    for f in good.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    dst = tmp_path / "out"
    options = ConvertOptions(bits=2.5, head_bits=4, codebook="mcg", cal_rows=2, cal_cols=32, device="cpu")
    with pytest.raises(EngineError, match="truncated"):
        convert_model(bad, dst, options, log=lambda m: None)
    assert (dst / ".exl3_work" / "job.json").is_file()  # it had started
    report = convert_model(good, dst, options, log=lambda m: None)  # no --resume needed
    assert len(report.blocks) == 2 and not (dst / ".exl3_work").exists()


def _correlated_problem(gen: torch.Generator, n_in: int = 256, n_out: int = 128):
    """A weight and a Hessian with a steep spectrum, so LDLQ's error feedback is large."""
    w = torch.randn(n_out, n_in, generator=gen) * 0.02
    mix = torch.randn(n_in, n_in, generator=gen) * torch.logspace(0, -3, n_in).unsqueeze(1)
    x = torch.randn(4 * n_in, n_in, generator=gen) @ mix
    return w, x.T @ x / x.shape[0]


@pytest.mark.parametrize("search_rows", [1024, 128])
def test_ldlq_scale_search_finds_the_lowest_proxy_error(monkeypatch, search_rows: int) -> None:
    # The LDLQ-aware search (a column sample, optionally only the leading rows) must land on a
    # scale whose full LDLQ pass is as good as the best of several forced scales.
    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    monkeypatch.setattr(quantize_mod, "SEARCH_ROWS", search_rows)
    w, h = _correlated_problem(torch.Generator().manual_seed(5))
    std = float(codebook_table("mul1").float().std())
    searched = quantize_mod.quantize_weight(w, h, 6, "mul1", seed=2)

    real_search = quantize_mod.choose_scale_ldlq
    forced: dict[float, float] = {}
    for factor in (0.4, 0.6, 0.8, 1.0):
        monkeypatch.setattr(quantize_mod, "choose_scale_ldlq", lambda *a, f=factor, **k: f * std)
        forced[factor] = quantize_mod.quantize_weight(w, h, 6, "mul1", seed=2).proxy_error
    monkeypatch.setattr(quantize_mod, "choose_scale_ldlq", real_search)
    assert searched.proxy_error <= 1.1 * min(forced.values())
    assert 0.25 * std <= searched.scale <= 1.15 * std
    # Without a Hessian there is no feedback, and the plain search around the prior is used.
    plain = quantize_mod.quantize_weight(w, None, 6, "mul1", seed=2)
    prior = quantize_mod.GAUSSIAN_SCALE[6]
    assert abs(plain.scale / std - prior) <= 0.1 * prior + 1e-6


def test_lockstep_ldlq_equals_one_at_a_time() -> None:
    # The real Viterbi on small problems: strips of different counts and widths, with and
    # without feedback, encoded together give each problem exactly its own result.
    table = codebook_table("mcg")
    gen = torch.Generator().manual_seed(7)
    problems = []
    for rows, cols in ((48, 16), (16, 32), (32, 16)):
        x = torch.randn(64, rows, generator=gen, dtype=torch.float64)
        lower, _ = block_ldl(x.T @ x / 64)
        problems.append((torch.randn(rows, cols, generator=gen), lower.float()))
    problems.append((torch.randn(32, 16, generator=gen), None))
    together = quantize_mod.ldlq_many(problems, 2, table)
    for problem, (states, q) in zip(problems, together):
        ((alone_states, alone_q),) = quantize_mod.ldlq_many([problem], 2, table)
        assert torch.equal(states, alone_states) and torch.equal(q, alone_q)
        assert states.shape == (problem[0].shape[0] // 16, problem[0].shape[1] // 16, 256)


def test_quantize_weights_equals_one_at_a_time(monkeypatch) -> None:
    # A block's linears quantized together (different shapes, K, one without a Hessian) store
    # exactly what each stores when quantized alone.
    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    gen = torch.Generator().manual_seed(8)
    jobs = []
    for out_f, in_f, k in ((160, 200, 3), (300, 128, 4), (96, 200, 3)):
        x = torch.randn(256, in_f, generator=gen)
        w = torch.randn(out_f, in_f, generator=gen)
        jobs.append(quantize_mod.WeightJob(w, x.T @ x / 256, k, seed=len(jobs)))
    jobs.append(quantize_mod.WeightJob(torch.randn(64, 128, generator=gen), None, 3, seed=9))
    for job, qt in zip(jobs, quantize_mod.quantize_weights(jobs, "mul1")):
        alone = quantize_mod.quantize_weight(job.weight, job.hessian, job.bits, "mul1", seed=job.seed)
        assert torch.equal(qt.trellis, alone.trellis)
        assert torch.equal(qt.suh, alone.suh) and torch.equal(qt.svh, alone.svh)
        assert qt.scale == alone.scale and qt.proxy_error == alone.proxy_error


def test_lockstep_groups_bound_the_weights_in_flight(monkeypatch) -> None:
    import engine.convert.block_quantizer as block_quantizer
    from engine.convert.slots import LinearSlot

    def slot(name: str, n_in: int, n_out: int):
        return LinearSlot(name, name, None, name, n_in, n_out)

    monkeypatch.setattr(block_quantizer, "LOCKSTEP_WEIGHTS", 1000)
    slots = [slot("q", 10, 40), slot("k", 10, 20), slot("v", 10, 20), slot("o", 40, 10), slot("down", 50, 30)]
    groups = [[s.key for s in group] for group in block_quantizer.lockstep_groups(slots)]
    assert groups == [["q", "k", "v"], ["o"], ["down"]]  # 800 + 400 > 1000; 1500 alone


@pytest.mark.slow
def test_conversion_does_not_depend_on_the_lockstep_grouping(
    exl3_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    # The seeds follow each linear's place in the block, not its group: a block converted one
    # linear at a time stores the same bytes as the block converted together.
    from safetensors.torch import load_file

    import engine.convert.block_quantizer as block_quantizer
    from engine.convert.options import ConvertOptions
    from engine.convert.pipeline import convert_model

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    options = ConvertOptions(bits=3.5, head_bits=4, codebook="mcg", cal_rows=2, cal_cols=32, device="cpu")
    outputs = []
    for limit in (block_quantizer.LOCKSTEP_WEIGHTS, 1):
        monkeypatch.setattr(block_quantizer, "LOCKSTEP_WEIGHTS", limit)
        dst = tmp_path / f"out{limit}"
        convert_model(exl3_dir / "tiny-llama-hf", dst, options, log=lambda m: None)
        tensors = {}
        for f in sorted(dst.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        outputs.append(tensors)
    together, alone = outputs
    assert set(together) == set(alone) and len(together) > 30
    assert all(torch.equal(together[k], alone[k]) for k in together)


@pytest.mark.slow
def test_convert_command_shows_a_progress_bar_with_an_eta(
    exl3_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    from engine.cli import main as cli_main

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    src, dst = exl3_dir / "tiny-llama-hf", tmp_path / "out"
    argv = ["convert", "-i", str(src), "-o", str(dst), "-b", "2.5", "--codebook", "mcg", "--device", "cpu"]
    assert cli_main([*argv, "--cal-rows", "2", "--cal-cols", "32", "--head-bits", "4"]) == 0
    out, err = capsys.readouterr()
    bars = [b for b in err.split("\r") if b.strip()]
    fractions = [float(b.split("]")[1].split("%")[0]) for b in bars if b.startswith("[")]
    assert fractions[0] == 0.0 and fractions[-1] == 100.0 and fractions == sorted(fractions)
    assert any("block 1/2, ETA" in b for b in bars) and "done in" in bars[-1]
    assert " -- block 2/2:" in out and not any(line.startswith("[") for line in out.splitlines())


def test_an_interrupted_convert_says_what_is_saved_and_how_to_go_on(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    import engine.convert.pipeline as pipeline
    from engine.cli import main as cli_main
    from engine.convert.checkpoints import WORK_DIR

    dst = tmp_path / "out"

    def interrupted(src, out, options, resume=False, log=print, progress=None):
        work = Path(out) / WORK_DIR
        work.mkdir(parents=True)
        for i in range(3):
            (work / f"block_{i:04d}.safetensors").write_bytes(b"")
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "convert_model", interrupted)
    assert cli_main(["convert", "-i", str(tmp_path), "-o", str(dst), "-b", "4"]) == 130
    err = capsys.readouterr().err
    assert "3 finished block(s) are saved" in err and "--resume" in err


@pytest.mark.slow
def test_a_full_disk_keeps_the_finished_blocks_for_resume(
    exl3_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    import errno

    import safetensors.torch

    from engine.convert.errors import ConvertError
    from engine.convert.options import ConvertOptions
    from engine.convert.pipeline import convert_model

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    real_save = safetensors.torch.save_file
    calls = []

    def save_until_full(tensors, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:  # the second block: the disk fills up halfway through the file
            Path(path).write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_until_full)
    src, dst = exl3_dir / "tiny-llama-hf", tmp_path / "out"
    options = ConvertOptions(bits=2.5, head_bits=4, codebook="mcg", cal_rows=2, cal_cols=32, device="cpu")
    with pytest.raises(ConvertError, match="no space left on the device.*1 finished block.*--resume"):
        convert_model(src, dst, options, log=lambda m: None)
    work = dst / ".exl3_work"
    assert (work / "block_0000.safetensors").is_file() and not (work / "block_0001.safetensors").exists()
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)  # space freed
    report = convert_model(src, dst, options, resume=True, log=lambda m: None)
    assert report.blocks[0] == {"block": 0, "resumed": True} and "rfn" in report.blocks[1]
    assert (dst / "config.json").is_file() and not work.exists()


def test_an_error_after_the_bar_starts_on_its_own_line(tmp_path: Path, monkeypatch, capsys) -> None:
    import engine.convert.pipeline as pipeline
    from engine.cli import main as cli_main
    from engine.convert.errors import ConvertError

    def failing(src, out, options, resume=False, log=print, progress=None):
        progress(0.5, "block 1/2")
        raise ConvertError("boom")

    monkeypatch.setattr(pipeline, "convert_model", failing)
    assert cli_main(["convert", "-i", str(tmp_path), "-o", str(tmp_path / "o"), "-b", "4"]) == 2
    assert "\nerror: boom" in capsys.readouterr().err
