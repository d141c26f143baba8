"""Sampling presets, declared as data.

A conversation stores a preset name plus its own overrides; what is sent to the engine is the
preset's values updated by the overrides. Keys are the fields of the engine's
``SamplingSettings`` plus ``max_new_tokens`` (a generation limit, not a sampler setting).
"""

from __future__ import annotations

from typing import Any

from engine.generation.sampling_settings import SETTINGS

# The engine's settings (defaults, ranges, labels) are read from its one description of them
# (torch-free, so the GUI starts without the engine runtime). max_new_tokens is the app's own: a
# generation limit, not a sampler setting, with a longer default than the engine's Job.
MAX_NEW_TOKENS_DEFAULT = 1024

SAMPLING_DEFAULTS: dict[str, Any] = {s.name: s.default for s in SETTINGS}
SAMPLING_DEFAULTS["max_new_tokens"] = MAX_NEW_TOKENS_DEFAULT

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

# What the settings editor shows: key -> (label, minimum, maximum, step); whole-number settings
# have int bounds (a spin box), the others float ones. Settings without an editor range (the seed)
# are not shown.
FIELDS: dict[str, tuple[str, float, float, float]] = {
    s.name: (s.label, *s.editor, s.step) for s in SETTINGS if s.editor is not None
}
FIELDS["max_new_tokens"] = ("Max new tokens", 1, 32768, 16)
# Each editor's tooltip: what the setting does, in the engine's words.
TOOLTIPS: dict[str, str] = {s.name: s.tip for s in SETTINGS if s.editor is not None and s.tip}
TOOLTIPS["max_new_tokens"] = "The longest a reply may get, in tokens."


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
