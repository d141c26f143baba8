"""Sampling presets, declared as data.

A conversation stores a preset name plus its own overrides; what is sent to the engine is the
preset's values updated by the overrides. Keys are the fields of the engine's
``SamplingSettings`` plus ``max_new_tokens`` (a generation limit, not a sampler setting).
"""

from __future__ import annotations

from typing import Any

# Defaults of engine.generation.sampling.SamplingSettings, restated so the GUI can show them
# without importing the engine runtime.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "temperature": 0.8,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "seed": None,
    "max_new_tokens": 1024,
}

PRESETS: dict[str, dict[str, Any]] = {
    "precise": {"temperature": 0.2, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.05},
    "balanced": {"temperature": 0.7, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.05},
    "creative": {"temperature": 1.0, "top_p": 1.0, "min_p": 0.05, "presence_penalty": 0.3},
    "greedy": {"temperature": 0.0},
}

PRESET_LABELS = {
    "precise": "Precise",
    "balanced": "Balanced",
    "creative": "Creative",
    "greedy": "Deterministic",
}

# What the settings editor shows: key -> (label, minimum, maximum, step). None bounds = no spin box.
FIELDS: dict[str, tuple[str, float, float, float]] = {
    "temperature": ("Temperature", 0.0, 5.0, 0.05),
    "top_k": ("Top-k (0 = off)", 0, 1000, 1),
    "top_p": ("Top-p", 0.01, 1.0, 0.01),  # 0 would keep no token: the engine refuses it
    "min_p": ("Min-p", 0.0, 1.0, 0.01),
    "repetition_penalty": ("Repetition penalty", 0.5, 2.0, 0.01),
    "presence_penalty": ("Presence penalty", -2.0, 2.0, 0.05),
    "frequency_penalty": ("Frequency penalty", -2.0, 2.0, 0.05),
    "max_new_tokens": ("Max new tokens", 1, 32768, 16),
}


def effective_sampling(preset: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Defaults, then the preset, then the conversation's own overrides."""
    values = dict(SAMPLING_DEFAULTS)
    values.update(PRESETS.get(preset, PRESETS["balanced"]))
    values.update({k: v for k, v in (overrides or {}).items() if k in SAMPLING_DEFAULTS})
    return values


def split_generation_limits(values: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """(sampler settings, max_new_tokens): the engine takes them as separate arguments."""
    sampler = {k: v for k, v in values.items() if k != "max_new_tokens"}
    return sampler, int(values.get("max_new_tokens") or SAMPLING_DEFAULTS["max_new_tokens"])
