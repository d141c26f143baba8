"""The sensitivity pre-pass of the converter: the LDLQ proxy prediction, the noise-injection
measurement on a tiny model, and an end-to-end conversion with allocation="sensitivity".

On CPU the trellis encoder is swapped for a cheap greedy one (as the other converter tests do),
and the prediction is checked with that encoder's own Gaussian MSE in place of the trellis's:
the formula (LDL trace, scales, padding) is what is under test. The ``cuda`` test checks it with
the real Viterbi and the measured trellis MSE.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from quant_helpers import cheap_encoder

import engine.convert.block_quantizer as block_quantizer
import engine.convert.quantize as quantize_mod
from engine.convert.block_runner import calibration_matmuls, run_block
from engine.convert.calibration_rows import calibration_ids
from engine.convert.errors import ConvertError
from engine.convert.hessians import HessianHook, capture_hessians, hessian_hooks, input_groups
from engine.convert.mse import TRELLIS_MSE
from engine.convert.options import ConvertOptions
from engine.convert.pipeline import convert_model
from engine.convert.sensitivity import (
    calibration_subset,
    ldlq_error,
    measure_sensitivity,
    predicted_proxies,
    predicted_proxy,
    relative_change,
)
from engine.convert.slots import block_linears
from engine.exl3 import EXL3Linear
from engine.exl3.codebooks import codebook_table


def _problem(gen: torch.Generator, n_in: int = 256, n_out: int = 256):
    """A weight with uneven rows and columns and a correlated Hessian with a spread spectrum."""
    w = torch.randn(n_out, n_in, generator=gen) * 0.02
    w *= torch.rand(n_out, 1, generator=gen) + 0.5
    mix = torch.randn(n_in, n_in, generator=gen) * torch.logspace(0, -1.5, n_in).unsqueeze(1)
    x = torch.randn(4 * n_in, n_in, generator=gen) @ mix
    return w, x.T @ x / x.shape[0]


def _prediction_ratio(monkeypatch, k: int, device: str, encoder_mse: float | None) -> float:
    """real proxy_error / predicted, for one random problem at a fixed (Gaussian-best) scale."""
    if encoder_mse is not None:
        monkeypatch.setitem(TRELLIS_MSE, k, encoder_mse)
    w, h = _problem(torch.Generator().manual_seed(11))
    w, h = w.to(device), h.to(device)
    real = quantize_mod.quantize_weight(w, h, k, "mul1", seed=3, search_scale=False).proxy_error
    _, predicted = predicted_proxy(w, h, k, seed=3)
    return real / predicted


@pytest.mark.parametrize("k", [2, 4])
def test_predicted_proxy_matches_ldlq(monkeypatch, k: int) -> None:
    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    # The cheap encoder's MSE on unit-Gaussian tiles at the scale quantize_weight uses.
    table = codebook_table("mul1")
    scale = quantize_mod.GAUSSIAN_SCALE[k] * float(table.float().std())
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    mse = float(((table[cheap_encoder(x * scale, k, table).long()].float() / scale - x) ** 2).mean())
    ratio = _prediction_ratio(monkeypatch, k, "cpu", mse)
    print(f"K={k}: real / predicted proxy = {ratio:.3f}")
    assert 0.5 < ratio < 2.0


@pytest.mark.cuda
@pytest.mark.parametrize("k", [2, 3, 4])
def test_predicted_proxy_matches_ldlq_viterbi(monkeypatch, k: int) -> None:
    ratio = _prediction_ratio(monkeypatch, k, "cuda", None)
    print(f"K={k}: real / predicted proxy (Viterbi) = {ratio:.3f}")
    assert 0.5 < ratio < 2.0


def test_prediction_scales_with_the_trellis_mse() -> None:
    w, h = _problem(torch.Generator().manual_seed(12), 128, 128)
    pred = predicted_proxies(w, h, [2, 4])
    (p2, r2), (p4, r4) = pred[2], pred[4]
    # At least the MSE ratio; a little more, since the feedback inflates K=2's strip targets more.
    mse_ratio = TRELLIS_MSE[2] / TRELLIS_MSE[4]
    assert mse_ratio <= p2 / p4 < 1.5 * mse_ratio and r2 / r4 == pytest.approx(p2 / p4)
    # Scaling the weight scales the absolute error with it, not the relative one.
    p4x, r4x = predicted_proxy(w * 3, h, 4)
    assert p4x == pytest.approx(9 * p4, rel=1e-3) and r4x == pytest.approx(r4, rel=1e-3)
    # Without feedback (L = I) it is mse * tr(H) per column, exactly.
    assert ldlq_error(h, None, 0.01) == pytest.approx(0.01 * float(h.diagonal().sum()))


def test_relative_change_is_per_token() -> None:
    # One token with a massive activation (as SmolLM2's attention-sink positions) must not hide
    # the error on all the others; the global ratio is kept for comparison.
    clean = torch.ones(1, 4, 8)
    clean[0, 0] *= 100
    noisy = clean.clone()
    noisy[0, 1:] += 0.1
    per_token, global_ = relative_change(noisy, clean)
    assert per_token == pytest.approx(0.75 * 0.01) and global_ < per_token / 100


def test_calibration_subset_spreads_rows() -> None:
    assert calibration_subset(10, 32).tolist() == list(range(10))
    rows = calibration_subset(250, 32)
    assert len(rows) == 32 and rows[0] == 0 and rows[-1] == 249  # reaches the random-token rows


# -- a tiny model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A random 2-layer Llama (no tokenizer: calibration uses random-token rows). The embedding
    is scaled up to unit RMS so that, as in trained models, the residual stream is larger than
    what one block adds to it (with the init's 0.02 embedding the blocks' updates dominate)."""
    from safetensors.torch import load_file, save_file

    from engine.bench.conversion import write_random_model
    from engine.shapes import shape_config

    directory = tmp_path_factory.mktemp("tiny") / "llama"
    cfg = shape_config("llama3.2-1b")
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    cfg.update(num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=128)
    write_random_model(directory, cfg)
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["model.embed_tokens.weight"] *= 50
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _prepass(src: Path, seed: int = 0, scale: dict[str, float] | None = None):
    from engine.model import load_model

    model = load_model(src, device="cpu", dtype=torch.float32).module
    per_block = [block_linears(b) for b in model.blocks]
    for slots in per_block:
        for s in slots:
            if scale and s.key in scale:
                with torch.inference_mode():  # the loader makes inference tensors
                    s.get().weight.mul_(scale[s.key])
    ids = calibration_ids(src, 3, 24, 96, 1.0, seed=0)
    with torch.inference_mode():
        hidden = model.embed(ids)
    before = [s.get().weight.clone() for slots in per_block for s in slots]
    logs: list[str] = []
    sens = measure_sensitivity(model.blocks, per_block, hidden, 3, 8, seed=seed, log=logs.append)
    after = [s.get().weight for slots in per_block for s in slots]
    assert all(torch.equal(a, b) for a, b in zip(after, before))  # every weight restored
    return sens, logs


def test_prepass_measures_every_linear(tiny_dir: Path) -> None:
    sens, logs = _prepass(tiny_dir)
    assert len(sens) == 14
    for s in sens.values():
        assert s.k_ref == 3 and 0 < s.error < 1 and 0 < s.proxy < 1
        assert torch.isfinite(torch.tensor([s.error, s.proxy])).all()
        assert s.at(3) == pytest.approx(s.error) and s.at(1) > s.at(2) > s.error > s.at(4) > s.at(8) > 0
    assert any("sensitivity block 2/2" in line for line in logs)
    again, _ = _prepass(tiny_dir)
    assert {k: v.error for k, v in again.items()} == {k: v.error for k, v in sens.items()}  # seeded


def test_prepass_sees_a_scaled_up_linear(tiny_dir: Path) -> None:
    key = "model.layers.0.self_attn.v_proj"
    base, _ = _prepass(tiny_dir)
    scaled, _ = _prepass(tiny_dir, scale={key: 4.0})
    # 4x the weights: 16x the noise power in its 4x larger (but still small) contribution.
    assert scaled[key].error > 8 * base[key].error
    assert all(scaled[k].error == pytest.approx(base[k].error, rel=0.5) for k in base if ".mlp." in k)


# -- end to end --------------------------------------------------------------------------------


def test_convert_with_sensitivity_allocation(tiny_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from engine.cache.paged import PagedKVCache
    from engine.exl3 import load_quantization_config
    from engine.generation.step import score_tokens
    from engine.model import load_model

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    monkeypatch.setattr(
        block_quantizer, "quantize_weights", partial(quantize_mod.quantize_weights, search_scale=False)
    )
    dst = tmp_path / "out"
    options = ConvertOptions(
        bits=3.5, head_bits=4, cal_rows=4, cal_cols=32, random_rows_fraction=1.0, device="cpu"
    )
    logs: list[str] = []
    report = convert_model(tiny_dir, dst, options, log=logs.append)
    assert any("sensitivity block 2/2" in line for line in logs)
    summary = next(line for line in logs if "bit allocation (sensitivity)" in line)
    assert "K=" in summary
    assert sum("predicted=" in line and " e=" in line for line in logs) == 14
    cfg = load_quantization_config(dst)
    bits = {
        k: v.bits_per_weight for k, v in cfg.tensor_storage.items() if k != "lm_head" and v.bits_per_weight
    }
    assert len(bits) == 14 and all(2 <= k <= 5 for k in bits.values())
    sizes = {}
    model = load_model(dst, device="cpu", dtype=torch.float32)
    for m in model.module.modules():
        if isinstance(m, EXL3Linear) and m.out_features != 96:  # not the head
            sizes[m.bits] = sizes.get(m.bits, 0) + m.in_features * m.out_features
    achieved = sum(k * n for k, n in sizes.items()) / sum(sizes.values())
    assert achieved <= 3.5 and report.bits == round(achieved, 2) and len(sizes) >= 2
    cache = PagedKVCache.for_model(model.spec, 16, page_size=16)
    logits = score_tokens(model.module, cache, [1, 5, 9, 13])
    assert logits.shape == (4, 96) and torch.isfinite(logits).all()
    assert not (dst / ".exl3_work").exists()
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["bits"] == report.bits


def test_resume_reuses_the_allocation(tiny_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    fast = partial(quantize_mod.quantize_weights, search_scale=False)
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the linears of the second block
            raise KeyboardInterrupt
        return fast(*args, **kwargs)

    monkeypatch.setattr(block_quantizer, "quantize_weights", failing)
    dst = tmp_path / "out"
    options = ConvertOptions(
        bits=3.25, head_bits=4, cal_rows=4, cal_cols=32, random_rows_fraction=1.0, device="cpu"
    )
    with pytest.raises(KeyboardInterrupt):
        convert_model(tiny_dir, dst, options, log=lambda m: None)
    saved = json.loads((dst / ".exl3_work" / "allocation.json").read_text())
    assert saved["allocation"] == "sensitivity" and len(saved["bits"]) == 14
    # A different allocation cannot resume this job.
    uniform = ConvertOptions(**{**options.__dict__, "allocation": "uniform"})
    with pytest.raises(ConvertError, match="cannot resume"):
        convert_model(tiny_dir, dst, uniform, resume=True, log=lambda m: None)
    logs: list[str] = []
    convert_model(tiny_dir, dst, options, resume=True, log=logs.append)
    assert not any("sensitivity block" in line for line in logs)  # no second pre-pass
    assert any("bit allocation (from allocation.json)" in line for line in logs)
    from engine.exl3 import load_quantization_config

    storage = load_quantization_config(dst).tensor_storage
    assert {k: storage[k].bits_per_weight for k in saved["bits"]} == saved["bits"]


def test_projections_of_one_input_share_one_hessian(tiny_dir: Path) -> None:
    """q/k/v (and gate/up) read one input: one hook, one x^T x, equal to what a hook per linear
    records; o and down keep their own."""
    from engine.model import load_model

    block = load_model(tiny_dir, device="cpu", dtype=torch.float32).module.blocks[0]
    slots = block_linears(block)
    hooks, handles = hessian_hooks(slots, torch.device("cpu"))
    separate = {s.key: HessianHook(s.in_features, torch.device("cpu")) for s in slots}
    handles += [s.get().register_forward_pre_hook(separate[s.key]) for s in slots]
    hidden = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        run_block(block, hidden, 2)
    for h in handles:
        h.remove()
    kinds = {s.kind: s.key for s in slots}
    assert hooks[kinds["q"]] is hooks[kinds["k"]] is hooks[kinds["v"]]
    assert hooks[kinds["gate"]] is hooks[kinds["up"]]
    assert len({id(h) for h in hooks.values()}) == 4  # qkv, o, gate/up, down
    for s in slots:
        assert hooks[s.key].count == separate[s.key].count == 24
        assert torch.equal(hooks[s.key].hessian(), separate[s.key].hessian()), s.kind


def test_sequential_capture_sees_the_quantized_linears_before_it(tiny_dir: Path) -> None:
    """With ``sequential``, a group's Hessian is captured again with the groups before it changed
    (quantized): it equals a hook's on a full forward of the changed block, and the forward
    stops at the group's input (the linears after it never run)."""
    from engine.model import load_model

    block = load_model(tiny_dir, device="cpu", dtype=torch.float32).module.blocks[0]
    slots = block_linears(block)
    groups = input_groups(slots)
    assert [[s.kind for s in g] for g in groups] == [["q", "k", "v"], ["o"], ["gate", "up"], ["down"]]
    hidden = torch.randn(3, 12, 64, generator=torch.Generator().manual_seed(7))
    before = capture_hessians(block, hidden, groups[1], 2)[groups[1][0].key].hessian()
    with torch.inference_mode():  # stands in for quantizing q and v
        groups[0][0].get().weight.mul_(1.1)
        groups[0][2].get().weight.mul_(0.9)
    down_calls = []
    watcher = groups[3][0].get().register_forward_pre_hook(lambda m, a: down_calls.append(1))
    captured = capture_hessians(block, hidden, groups[1], 2)[groups[1][0].key]
    assert not down_calls  # the forward ended at o_proj's input
    assert captured.count == 36
    watcher.remove()
    full = HessianHook(groups[1][0].in_features, torch.device("cpu"))
    handle = groups[1][0].get().register_forward_pre_hook(full)
    with torch.inference_mode():
        run_block(block, hidden, 2)
    handle.remove()
    assert torch.equal(captured.hessian(), full.hessian())
    assert not torch.allclose(captured.hessian(), before, rtol=1e-3)


@pytest.mark.slow
def test_sequential_conversion_changes_only_what_follows_the_first_group(
    tiny_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """The first input group (q/k/v) sees the same Hessian and seeds either way, so its tensors
    are the same bytes; o_proj's Hessian now comes from the quantized q/k/v and its tensors
    differ. The option is part of the job key (a resume cannot mix the two)."""
    from quant_helpers import cheap_encoder
    from safetensors.torch import load_file

    import engine.convert.quantize as quantize_mod

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    outputs = []
    for sequential in (False, True):
        options = ConvertOptions(
            bits=4.0,
            head_bits=4,
            cal_rows=3,
            cal_cols=16,
            device="cpu",
            allocation="uniform",
            random_rows_fraction=1.0,
            sequential=sequential,
        )
        dst = tmp_path / f"seq{int(sequential)}"
        convert_model(tiny_dir, dst, options, log=lambda m: None)
        tensors = {}
        for f in sorted(dst.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        outputs.append(tensors)
    plain, sequential = outputs
    layer0 = "model.layers.0."
    for name in ("q_proj", "k_proj", "v_proj"):
        key = f"{layer0}self_attn.{name}.trellis"
        assert torch.equal(plain[key], sequential[key]), name
    assert not torch.equal(
        plain[f"{layer0}self_attn.o_proj.suh"], sequential[f"{layer0}self_attn.o_proj.suh"]
    )
    assert ConvertOptions(bits=4.0, sequential=True).job_key() != ConvertOptions(bits=4.0).job_key()


def test_tf32_is_a_cuda_only_switch_outside_the_job_key() -> None:
    """On by default; blocks converted with or without TF32 may be resumed into one model; on CPU
    the switch changes nothing, and it is restored on exit."""
    assert ConvertOptions(bits=4.0).tf32
    assert ConvertOptions(bits=4.0, tf32=False).job_key() == ConvertOptions(bits=4.0).job_key()
    before = torch.backends.cuda.matmul.allow_tf32
    with calibration_matmuls(torch.device("cpu"), True):
        assert torch.backends.cuda.matmul.allow_tf32 == before
    with calibration_matmuls(torch.device("cuda"), True):
        assert torch.backends.cuda.matmul.allow_tf32  # the flag only; no CUDA call is made
    assert torch.backends.cuda.matmul.allow_tf32 == before


def test_tf32_flag_defaults_on_and_can_be_turned_off() -> None:
    import argparse

    from engine.commands.convert import add_tf32_arg

    p = argparse.ArgumentParser()
    add_tf32_arg(p)
    assert p.parse_args([]).tf32 and p.parse_args(["--tf32"]).tf32
    assert not p.parse_args(["--no-tf32"]).tf32


def test_prepass_keeps_or_reuses_the_callers_rows(tiny_dir: Path) -> None:
    """The pre-pass writes block outputs into buffers made once: the caller's rows are left as
    they were unless it hands them over (``own_hidden``), and the result is the same either way."""
    from engine.model import load_model

    model = load_model(tiny_dir, device="cpu", dtype=torch.float32).module
    per_block = [block_linears(b) for b in model.blocks]
    ids = calibration_ids(tiny_dir, 3, 24, 96, 1.0, seed=0)
    with torch.inference_mode():
        hidden = model.embed(ids).clone()
    kept = hidden.clone()
    pinned: list[torch.Tensor] = []
    kwargs = dict(log=lambda m: None)
    a = measure_sensitivity(model.blocks, per_block, hidden, 3, 2, pin=pinned.append, **kwargs)
    assert torch.equal(hidden, kept)
    assert len(pinned) == 3 and all(t.shape == hidden.shape for t in pinned)  # 2 + 1 for the caller's
    b = measure_sensitivity(model.blocks, per_block, hidden, 3, 2, own_hidden=True, **kwargs)
    assert not torch.equal(hidden, kept)  # handed over: reused as a buffer
    assert {k: v.error for k, v in a.items()} == {k: v.error for k, v in b.items()}


def test_relative_change_in_chunks_is_the_whole() -> None:
    gen = torch.Generator().manual_seed(2)
    clean = torch.randn(5, 6, 8, generator=gen)
    noisy = clean + 0.05 * torch.randn(5, 6, 8, generator=gen)
    whole = relative_change(noisy, clean)
    for chunk in (1, 2, 5):
        assert relative_change(noisy, clean, chunk, torch.device("cpu")) == pytest.approx(whole, rel=1e-12)
