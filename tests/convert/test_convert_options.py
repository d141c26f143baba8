"""ConvertOptions are checked once, when they are made: each bad option is refused by name."""

from __future__ import annotations

import dataclasses

import pytest

from engine.convert.errors import ConvertError
from engine.convert.options import ConvertOptions


def test_the_defaults_and_every_choice_are_accepted() -> None:
    ConvertOptions(bits=4.0)
    for value in (1.0, 8.0):
        ConvertOptions(bits=value, head_bits=16, random_rows_fraction=1.0, generated_rows=1.0, damping=0.0)
    for codebook in ("mul1", "mcg", "3inst"):
        for states in ("auto", "device", "host"):
            ConvertOptions(
                bits=2.5, codebook=codebook, states=states, allocation="uniform", tune_target="model"
            )


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("bits", 8.5, "within 1.0..8.0, got 8.5"),
        ("bits", float("nan"), "within 1.0..8.0"),
        ("head_bits", 12, "1..8 or 16, got 12"),
        ("codebook", "e8p", "unknown codebook 'e8p'; choose one of 3inst, mcg, mul1"),
        ("allocation", "random", "unknown allocation 'random'; choose one of sensitivity, uniform"),
        ("tune_target", "layer", "unknown tuning target 'layer'; choose one of block, model"),
        ("states", "disk", "unknown place for the states 'disk'; choose one of auto, device, host"),
        ("cal_rows", 0, "at least 1, got 0"),
        ("cal_cols", 0, "at least 1, got 0"),
        ("sensitivity_rows", 0, "at least 1, got 0"),
        ("shard_size_mb", 0, "at least 1, got 0"),
        ("tune_steps", -1, "not be negative, got -1"),
        ("tune_lr", 0.0, "above 0, got 0.0"),
        ("damping", -0.1, "not be negative, got -0.1"),
        ("random_rows_fraction", 1.5, "within 0..1, got 1.5"),
        ("generated_rows", -0.5, "within 0..1, got -0.5"),
    ],
)
def test_a_bad_option_is_refused_by_name(option: str, value: object, message: str) -> None:
    with pytest.raises(ConvertError, match=f"^converter option {option}: .*{message}"):
        ConvertOptions(**{"bits": 4.0, option: value})
    # The same check guards a copy made with other values.
    with pytest.raises(ConvertError, match=f"converter option {option}:"):
        dataclasses.replace(ConvertOptions(bits=4.0), **{option: value})


def test_the_convert_command_runs_the_kernels_the_environment_chose(tmp_path, monkeypatch) -> None:
    """``engine convert`` applies the development switches to the process's extension before it
    converts: the build TRELLIS_EXT_CACHE or TRELLIS_EXT_PREBUILT names is the one it runs, not a
    JIT build of its own in the user cache folder."""
    from engine import kernels
    from engine.cli import main
    from engine.convert import pipeline

    seen = {}

    def record(src, dst, options, **_):
        seen.update(kernels.loader.settings().__dict__)
        return None

    monkeypatch.setattr(pipeline, "convert_model", record)
    monkeypatch.setenv("TRELLIS_EXT_CACHE", str(tmp_path / "jit"))
    monkeypatch.setenv("TRELLIS_EXT_PREBUILT", str(tmp_path / "pre"))
    try:
        assert main(["convert", "-i", str(tmp_path), "-o", str(tmp_path / "out"), "-b", "4"]) == 0
    finally:
        kernels.configure()
    assert seen["cache_dir"] == tmp_path / "jit" and seen["prebuilt_dir"] == tmp_path / "pre"
