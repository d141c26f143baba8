"""CPU parts of the conversion timing command: random-row calibration, the random model, stage timing."""

from __future__ import annotations

import json

import pytest
import torch

from engine.bench import conversion as convert_bench
from engine.convert.calibration_rows import calibration_ids


def test_all_random_calibration_needs_no_tokenizer(tmp_path) -> None:
    ids = calibration_ids(tmp_path, rows=4, cols=8, vocab=50, random_fraction=1.0, seed=3)
    assert ids.shape == (4, 8) and ids.dtype == torch.long
    assert int(ids.min()) >= 0 and int(ids.max()) < 50
    assert torch.equal(ids, calibration_ids(tmp_path, 4, 8, 50, 1.0, 3))  # seeded


def test_random_model_has_the_shape(tmp_path) -> None:
    from safetensors import safe_open

    from engine.config import ModelConfig
    from engine.shapes import shape_config

    cfg = shape_config("llama3.2-1b")
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
    cfg.update(num_key_value_heads=1, head_dim=32, vocab_size=96)
    nbytes = convert_bench.write_random_model(tmp_path, cfg)
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 2
    assert ModelConfig.from_dir(tmp_path).architecture == "LlamaForCausalLM"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.1.self_attn.k_proj.weight").shape == (32, 64)
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight").shape == (64, 128)
    assert "lm_head.weight" not in keys  # tied, as the published model
    assert len(keys) == 2 + 2 * 9
    assert nbytes == (96 * 64 + 64 + 2 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 128 + 2 * 64)) * 2


def test_stage_timer_attributes_and_restores() -> None:
    from engine.convert import block_quantizer, pipeline, quantize

    def wrapped() -> tuple:
        return pipeline.run_block, block_quantizer.run_block, quantize.encode_tiles, quantize.block_ldl

    originals = wrapped()
    timer = convert_bench.StageTimer(torch.device("cpu"))
    timer.install()
    try:
        x = torch.zeros(3, 256)
        table = torch.zeros(65536, dtype=torch.float16)
        quantize.encode_tiles(x, 8, table)
        assert timer.viterbi_tiles == 3
        assert timer.seconds["viterbi"] > 0
    finally:
        timer.uninstall()
    assert wrapped() == originals
    stages = timer.stages()
    assert set(stages) == set(convert_bench.STAGES)
    assert stages["quantize_other"] == 0.0


def test_peak_host_memory_is_this_process_high_water_mark() -> None:
    from engine.bench.conversion import peak_host_bytes

    before = peak_host_bytes()
    if before is None:
        pytest.skip("no resource module on this platform")
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB touched
    after = peak_host_bytes()
    assert 10 * 2**20 < before <= after < 64 * 2**30
    assert after >= block.numel() * 4  # at least what is resident now


def test_stage_peaks_nest_and_reset(monkeypatch) -> None:
    """On CUDA each wrapped stage records the peak allocated while it ran; a stage inside another
    counts towards both, and the whole run's peak survives the resets. Faked counters here."""
    counter = {"allocated": 0, "peak": 0}

    def allocate(n: int) -> None:
        counter["allocated"] += n
        counter["peak"] = max(counter["peak"], counter["allocated"])

    def reset(device=None) -> None:
        counter["peak"] = counter["allocated"]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counter["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)

    class Stages:
        @staticmethod
        def inner() -> None:
            allocate(50)
            allocate(-50)

        @staticmethod
        def outer() -> None:
            allocate(10)
            Stages.inner()
            allocate(-10)

    timer = convert_bench.StageTimer(torch.device("cuda", 0))
    timer.wrap(Stages, "inner", lambda a: "viterbi")
    timer.wrap(Stages, "outer", lambda a: "quantize_total", peak="quantize_block")
    allocate(100)  # held outside any stage (the states)
    allocate(-100)
    allocate(5)
    Stages.outer()
    allocate(200)  # after the stages: the head's Hessian, say
    allocate(-200)
    timer.finish_peaks()
    timer.uninstall()
    assert timer.peaks_gb() == {
        "outside_stages": round(205 / 1e9, 2),
        "quantize_block": round(65 / 1e9, 2),
        "viterbi": round(65 / 1e9, 2),
    }
    assert dict(timer.stage_peaks) == {"outside_stages": 205, "quantize_block": 65, "viterbi": 65}
    assert timer.overall_peak == 205


def test_stage_peaks_are_a_cuda_only_step() -> None:
    timer = convert_bench.StageTimer(torch.device("cpu"))
    timer.wrap(convert_bench, "peak_host_bytes", lambda a: "refit")
    try:
        convert_bench.peak_host_bytes()
    finally:
        timer.uninstall()
    timer.finish_peaks()
    assert timer.peaks_gb() == {} and timer.overall_peak == 0
