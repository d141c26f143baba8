"""Sampling settings, declared once as data (no torch here).

:data:`SETTINGS` describes each scalar setting: its default, the values the engine accepts, the
range and step an editor offers, and a label. :class:`SamplingSettings` takes its defaults from
it, :meth:`SamplingSettings.validate` its accepted ranges (and the words its errors use), and the
app (``app/chat/presets.py``) its defaults and spin boxes: no number is written twice, so the
app's editors and the engine's checks cannot drift apart.

This module imports no torch: the GUI reads it at start-up without loading the engine runtime.
What the settings *do* (the processors and the one reference sampler) is
:mod:`engine.generation.sampling`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.errors import SamplingSettingError

Number = int | float


@dataclass(frozen=True)
class Setting:
    """One scalar sampling setting. ``low``/``high``: the accepted range (None: unbounded; a real
    setting must be finite either way), ``low_open``/``high_open`` exclude the bound itself.
    ``editor``: the (min, max) an editor offers, inside the accepted range (None: no editor);
    ``step``: its increment. ``note``: what the neutral value means, shown in errors."""

    name: str
    label: str
    default: Number | None
    whole: bool  # an integer setting (else any real number)
    low: Number | None = None
    high: Number | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""
    editor: tuple[Number, Number] | None = None
    step: Number | None = None
    optional: bool = False  # None is a value (e.g. the seed: None = a random one)

    def accepts(self, value: object) -> bool:
        if value is None:
            return self.optional
        if isinstance(value, bool):  # a bool is an int to Python, never a setting's value
            return False
        if self.whole:
            if not isinstance(value, numbers.Integral):
                return False
        elif not isinstance(value, numbers.Real) or not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    @property
    def allowed(self) -> str:
        """The accepted values in words, e.g. "a number in (0, 1] (1 = off)"."""
        both = self.low is not None and self.high is not None
        words = "a whole number" if self.whole else ("a number" if both else "a finite number")
        if both:
            words += f" in {'(' if self.low_open else '['}{_fmt(self.low)}, {_fmt(self.high)}"
            words += ")" if self.high_open else "]"
        elif self.low is not None:
            words += f" {'>' if self.low_open else '>='} {_fmt(self.low)}"
        elif self.high is not None:
            words += f" {'<' if self.high_open else '<='} {_fmt(self.high)}"
        return words + (f" ({self.note})" if self.note else "")


def _fmt(v: Number) -> str:
    if isinstance(v, int) and v >= 2**32 and v & (v - 1) == 0:
        return f"2**{v.bit_length() - 1}"  # the seed's bound: 2**64, not 18446744073709551616
    return f"{v:g}"


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "temperature",
        "Temperature",
        0.8,
        whole=False,
        low=0.0,
        note="0 = greedy",
        editor=(0.0, 5.0),
        step=0.05,
    ),
    Setting("top_k", "Top-k (0 = off)", 0, whole=True, low=0, note="0 = off", editor=(0, 1000), step=1),
    # 0 would keep no token: refused, and the editor starts one step above it.
    Setting(
        "top_p",
        "Top-p",
        1.0,
        whole=False,
        low=0.0,
        high=1.0,
        low_open=True,
        note="1 = off",
        editor=(0.01, 1.0),
        step=0.01,
    ),
    Setting(
        "min_p", "Min-p", 0.0, whole=False, low=0.0, high=1.0, note="0 = off", editor=(0.0, 1.0), step=0.01
    ),
    # > 1 discourages every token already in the context (CTRL-style: see sampling.py).
    Setting(
        "repetition_penalty",
        "Repetition penalty",
        1.0,
        whole=False,
        low=0.0,
        low_open=True,
        note="1 = off",
        editor=(0.5, 2.0),
        step=0.01,
    ),
    # Subtracted once from every token already generated (OpenAI-style).
    Setting(
        "presence_penalty",
        "Presence penalty",
        0.0,
        whole=False,
        note="0 = off",
        editor=(-2.0, 2.0),
        step=0.05,
    ),
    # Subtracted per occurrence in the generated tokens (OpenAI-style).
    Setting(
        "frequency_penalty",
        "Frequency penalty",
        0.0,
        whole=False,
        note="0 = off",
        editor=(-2.0, 2.0),
        step=0.05,
    ),
    # torch's generator takes 64-bit seeds; a negative one is refused rather than wrapped, since
    # elsewhere (llama.cpp) -1 means "random". No editor: the app never sets it.
    Setting("seed", "Seed", None, whole=True, low=0, high=2**64, high_open=True, optional=True),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}

# logit_bias is a mapping, not a scalar, so it has no row above (and no editor in the app).
# OpenAI's range for each bias; -100/+100 in practice bans/forces a token.
LOGIT_BIAS_LIMIT = 100.0
LOGIT_BIAS_ALLOWED = (
    f"a mapping of token ids (whole numbers >= 0) to numbers in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"
)


def _default(name: str) -> Number | None:
    return BY_NAME[name].default


@dataclass
class SamplingSettings:
    """How one job turns logits into tokens. The fields' meanings and ranges: :data:`SETTINGS`;
    ``logit_bias``: ``{token id: bias}`` added to the raw logits before anything else (OpenAI's
    semantics; ids past the vocabulary are ignored; None or empty: none)."""

    temperature: float = _default("temperature")
    top_k: int = _default("top_k")
    top_p: float = _default("top_p")
    min_p: float = _default("min_p")
    repetition_penalty: float = _default("repetition_penalty")
    presence_penalty: float = _default("presence_penalty")
    frequency_penalty: float = _default("frequency_penalty")
    seed: int | None = _default("seed")
    logit_bias: Mapping[int, float] | None = field(default_factory=dict)

    @classmethod
    def greedy(cls) -> SamplingSettings:
        return cls(temperature=0.0)

    @property
    def is_greedy(self) -> bool:
        """The token is the argmax of the (processed) logits: no draw, no uniform used."""
        return self.temperature <= 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Raise :class:`~engine.errors.SamplingSettingError` naming the first field outside its
        range (:data:`SETTINGS` order, then ``logit_bias``). The one check of these values: the
        Sampler runs it for every job, and entry points (the CLI, the app's worker, a server) call
        it to refuse bad values before any model work."""
        for setting in SETTINGS:
            value = getattr(self, setting.name)
            if not setting.accepts(value):
                raise SamplingSettingError(setting.name, setting.allowed, value)
        bias = self.logit_bias
        if bias is None:  # OpenAI's null: no bias
            return
        if not isinstance(bias, Mapping):
            raise SamplingSettingError("logit_bias", LOGIT_BIAS_ALLOWED, bias)
        token_id = Setting("token id", "", None, whole=True, low=0)
        limit = Setting("bias", "", None, whole=False, low=-LOGIT_BIAS_LIMIT, high=LOGIT_BIAS_LIMIT)
        for token, value in bias.items():
            if not (token_id.accepts(token) and limit.accepts(value)):
                raise SamplingSettingError("logit_bias", LOGIT_BIAS_ALLOWED, {token: value})
