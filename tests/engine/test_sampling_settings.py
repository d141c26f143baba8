"""``SamplingSettings.validate``: the one range check every entry point (CLI, app, server) uses."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.errors import EngineError, SamplingSettingError
from engine.generation.sampling import Sampler, SamplingSettings

NAN, INF = math.nan, math.inf

# field -> values outside its range (NaN and infinities, negatives, past the top, wrong types)
BAD = {
    "temperature": [NAN, INF, -INF, -0.1, -1, "0.7", None, True],
    "top_k": [-1, -3, 2.5, 40.0, NAN, "40", True],
    "top_p": [NAN, INF, 0.0, -0.5, 1.0001, 2, None],
    "min_p": [NAN, INF, -0.01, 1.5, "0.1"],
    "repetition_penalty": [NAN, INF, 0.0, -1.0],
    "presence_penalty": [NAN, INF, -INF, "0"],
    "frequency_penalty": [NAN, -INF, INF],
    "dry_multiplier": [NAN, -0.1, INF],
    "dry_base": [0.99, NAN, INF, 0],
    "dry_allowed_length": [0, -1, 2.5, True],
    "xtc_threshold": [-0.1, 1.1, NAN],
    "xtc_probability": [-0.1, 1.1, NAN],
    "top_n_sigma": [-0.5, NAN, INF],
    "typical_p": [0.0, 1.01, NAN],
    "seed": [-1, 2**64, 1.5, "7", True],
}

# field -> values at the edges of its range, all accepted
GOOD = {
    "temperature": [0.0, 0, 1e-6, 5.0, 1000.0, np.float32(0.7)],
    "top_k": [0, 1, 50, np.int64(40)],
    "top_p": [1.0, 1, 1e-9, 0.5],
    "min_p": [0.0, 0.05, 1.0],
    "repetition_penalty": [1.0, 1e-3, 2.0],
    "presence_penalty": [0.0, -2.0, 2.0, -100.0],
    "frequency_penalty": [0.0, -2.0, 2.0],
    "dry_multiplier": [0.0, 0.8, 5.0],
    "dry_base": [1.0, 1.75, 4.0],
    "dry_allowed_length": [1, 2, 100],
    "xtc_threshold": [0.0, 0.1, 1.0],
    "xtc_probability": [0.0, 0.5, 1.0],
    "top_n_sigma": [0.0, 1.0, 10.0],
    "typical_p": [1.0, 0.5, 1e-6],
    "seed": [None, 0, 12345, 2**64 - 1],
}

ALLOWED_WORDS = {  # what each message must say about the allowed range
    "temperature": ">= 0",
    "top_k": ">= 0",
    "top_p": "(0, 1]",
    "min_p": "[0, 1]",
    "repetition_penalty": "> 0",
    "presence_penalty": "finite",
    "frequency_penalty": "finite",
    "dry_multiplier": ">= 0",
    "dry_base": ">= 1",
    "dry_allowed_length": ">= 1",
    "xtc_threshold": "[0, 1]",
    "xtc_probability": "[0, 1]",
    "top_n_sigma": ">= 0",
    "typical_p": "(0, 1]",
    "seed": "[0, 2**64)",
}


@pytest.mark.parametrize("field,value", [(f, v) for f, values in BAD.items() for v in values])
def test_out_of_range_values_are_refused_naming_the_field(field: str, value: object) -> None:
    settings = SamplingSettings(**{field: value})
    with pytest.raises(SamplingSettingError) as caught:
        settings.validate()
    err = caught.value
    assert err.field == field and err.value is value
    assert str(err).startswith(f"{field} must be ") and ALLOWED_WORDS[field] in str(err)
    # A user-facing engine error (the app shows it, the CLI exits 2) and still a ValueError.
    assert isinstance(err, EngineError) and isinstance(err, ValueError)


@pytest.mark.parametrize("field,value", [(f, v) for f, values in GOOD.items() for v in values])
def test_values_at_the_edges_of_each_range_are_accepted(field: str, value: object) -> None:
    SamplingSettings(**{field: value}).validate()


def test_the_sampler_refuses_what_validate_refuses() -> None:
    # Every job's Sampler runs the same check, so no entry point can skip it.
    with pytest.raises(SamplingSettingError, match="temperature must be a finite number >= 0"):
        Sampler(SamplingSettings(temperature=NAN))
    with pytest.raises(SamplingSettingError, match="top_k"):
        Sampler(SamplingSettings(top_k=-3))


def test_accepted_edges_sample_sensibly() -> None:
    # min_p = 1 keeps only the likeliest token(s): a legal value, not a degenerate one.
    import torch

    logits = torch.tensor([0.0, 3.0, 1.0, 3.0 - 1e-3])
    sampler = Sampler(SamplingSettings(temperature=1.0, min_p=1.0, seed=2**64 - 1))
    assert {sampler.sample(logits, [], []) for _ in range(20)} == {1}


BAD_BIAS = [{-1: 1.0}, {"5": 1.0}, {True: 1.0}, {2.0: 1.0}, {5: 100.5}, {5: -101}, {5: NAN}, {5: "1"}]


@pytest.mark.parametrize("bias", BAD_BIAS + [[(5, 1.0)], "5:1"])
def test_a_bad_logit_bias_is_refused_naming_the_entry(bias: object) -> None:
    with pytest.raises(SamplingSettingError) as caught:
        SamplingSettings(logit_bias=bias).validate()
    err = caught.value
    assert err.field == "logit_bias" and "token ids (whole numbers >= 0)" in str(err)
    if isinstance(bias, dict):
        assert err.value == bias  # the offending entry, not the whole mapping


@pytest.mark.parametrize("bias", [None, {}, {0: -100.0}, {2**40: 100}, {np.int64(3): np.float32(0.5)}])
def test_logit_bias_accepts_openai_ranges(bias: dict) -> None:
    SamplingSettings(logit_bias=bias).validate()


def test_validate_and_the_app_read_one_description_of_each_setting() -> None:
    # The accepted ranges are the descriptions' (no second copy to drift), and what an editor
    # offers, and each default, lies inside them.
    from engine.generation.sampling_settings import SETTINGS

    assert [s.name for s in SETTINGS] == [f for f in ALLOWED_WORDS]
    for setting in SETTINGS:
        with pytest.raises(SamplingSettingError) as caught:
            SamplingSettings(**{setting.name: BAD[setting.name][0]}).validate()
        assert caught.value.allowed == setting.allowed
        assert setting.default == getattr(SamplingSettings(), setting.name)
        assert setting.accepts(setting.default)
        if setting.editor is not None:
            low, high = setting.editor
            assert setting.accepts(low) and setting.accepts(high) and low < high
            assert 0 < setting.step <= high - low
            assert isinstance(low, int) == isinstance(setting.step, int) == setting.whole


def test_the_descriptions_import_no_torch() -> None:
    # The GUI reads them at start-up; torch takes seconds to import and is not needed there.
    import subprocess
    import sys

    code = "import sys, engine.generation.sampling_settings; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize(
    "field,value",
    [
        ("banned_strings", "Paris"),
        ("banned_strings", ["ok", ""]),
        ("banned_strings", ["x" * 201]),
        ("banned_strings", [3]),
        ("dry_sequence_breakers", "\n"),
        ("dry_sequence_breakers", [None]),
    ],
)
def test_string_lists_are_refused_naming_the_entry(field: str, value: object) -> None:
    with pytest.raises(SamplingSettingError) as caught:
        SamplingSettings(**{field: value}).validate()
    assert caught.value.field == field and "a list of non-empty strings" in str(caught.value)


def test_every_setting_with_an_editor_has_a_tooltip() -> None:
    from engine.generation.sampling_settings import SETTINGS

    for setting in SETTINGS:
        assert setting.editor is None or setting.tip, setting.name
