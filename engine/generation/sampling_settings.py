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
    tip: str = ""  # one or two sentences for an editor's tooltip: what the setting does

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
        tip="Higher is more varied, lower more predictable; 0 always takes the likeliest token.",
    ),
    Setting(
        "top_k",
        "Top-k (0 = off)",
        0,
        whole=True,
        low=0,
        note="0 = off",
        editor=(0, 1000),
        step=1,
        tip="Only the k likeliest tokens can be chosen (0 = off).",
    ),
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
        tip="Only the likeliest tokens that together reach this probability can be chosen (1 = off).",
    ),
    Setting(
        "min_p",
        "Min-p",
        0.0,
        whole=False,
        low=0.0,
        high=1.0,
        note="0 = off",
        editor=(0.0, 1.0),
        step=0.01,
        tip="Drops tokens less likely than this fraction of the likeliest one (0 = off).",
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
        tip="Above 1 discourages every token already in the conversation (1 = off).",
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
        tip="Subtracted once from every token the reply already used (0 = off).",
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
        tip="Subtracted from a token once per time the reply already used it (0 = off).",
    ),
    # DRY ("don't repeat yourself", engine.generation.samplers.dry): a token that would extend a
    # sequence already seen earlier in the context loses multiplier * base ** (n - allowed) from
    # its logit, n the length of the repeat it would extend.
    Setting(
        "dry_multiplier",
        "DRY multiplier",
        0.0,
        whole=False,
        low=0.0,
        note="0 = off",
        editor=(0.0, 5.0),
        step=0.05,
        tip="Penalises tokens that would continue a passage already written earlier "
        "(0 = off; 0.8 is typical).",
    ),
    Setting(
        "dry_base",
        "DRY base",
        1.75,
        whole=False,
        low=1.0,
        editor=(1.0, 4.0),
        step=0.05,
        tip="How fast the DRY penalty grows with each further repeated token.",
    ),
    Setting(
        "dry_allowed_length",
        "DRY allowed length",
        2,
        whole=True,
        low=1,
        editor=(1, 20),
        step=1,
        tip="Repeats up to this many tokens long are not penalised by DRY.",
    ),
    # XTC ("exclude top choices", engine.generation.samplers.xtc): with this probability per
    # token, every token at least this likely except the least likely of them is removed.
    Setting(
        "xtc_threshold",
        "XTC threshold",
        0.1,
        whole=False,
        low=0.0,
        high=1.0,
        editor=(0.0, 0.5),
        step=0.01,
        tip="XTC considers the tokens at least this likely (above 0.5 it never acts).",
    ),
    Setting(
        "xtc_probability",
        "XTC probability",
        0.0,
        whole=False,
        low=0.0,
        high=1.0,
        note="0 = off",
        editor=(0.0, 1.0),
        step=0.05,
        tip="Chance per token that XTC removes the likeliest choices, keeping the least likely of "
        "those above the threshold (0 = off).",
    ),
    # Top-n-sigma: keep tokens whose logit is within n standard deviations of the best one.
    Setting(
        "top_n_sigma",
        "Top-n\u03c3",
        0.0,
        whole=False,
        low=0.0,
        note="0 = off",
        editor=(0.0, 5.0),
        step=0.05,
        tip="Keeps the tokens whose logit lies within n standard deviations of the best (0 = off).",
    ),
    # Locally typical sampling: keep the tokens whose surprise is closest to the entropy.
    Setting(
        "typical_p",
        "Typical-p",
        1.0,
        whole=False,
        low=0.0,
        high=1.0,
        low_open=True,
        note="1 = off",
        editor=(0.01, 1.0),
        step=0.01,
        tip="Keeps the tokens whose surprise is closest to the average, up to this mass (1 = off).",
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


# Lists of strings: DRY's sequence breakers and the banned strings. No editor in the app's
# spin-box pane either; a server or the CLI passes them. A banned string is matched in the reply's
# text and rewound (engine.generation.samplers.banned_strings): its length bounds how far back
# that can be, so it is capped.
DRY_SEQUENCE_BREAKERS = ("\n", ":", '"', "*")  # SillyTavern's and llama.cpp's defaults
BANNED_STRING_MAX_CHARS = 200
STRINGS_ALLOWED = "a list of non-empty strings"
BANNED_ALLOWED = f"a list of non-empty strings of at most {BANNED_STRING_MAX_CHARS} characters"


def _default(name: str) -> Number | None:
    return BY_NAME[name].default


def _check_strings(name: str, value: object, allowed: str, max_chars: int | None = None) -> None:
    """Refuse ``value`` unless it is a list (or tuple) of non-empty strings, each at most
    ``max_chars`` long; the error names the offending entry."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise SamplingSettingError(name, allowed, value)
    for entry in value:
        if not isinstance(entry, str) or not entry or (max_chars is not None and len(entry) > max_chars):
            raise SamplingSettingError(name, allowed, entry)


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
    # The samplers added after the OpenAI set (fields after these, so positional use still works).
    dry_multiplier: float = _default("dry_multiplier")
    dry_base: float = _default("dry_base")
    dry_allowed_length: int = _default("dry_allowed_length")
    xtc_threshold: float = _default("xtc_threshold")
    xtc_probability: float = _default("xtc_probability")
    top_n_sigma: float = _default("top_n_sigma")
    typical_p: float = _default("typical_p")
    # Text that ends a repeat for DRY: a token whose text holds one of these is never part of one.
    dry_sequence_breakers: tuple[str, ...] | list[str] = DRY_SEQUENCE_BREAKERS
    # Strings the reply must never contain: where one appears (across tokens too), generation
    # goes back to the token where it starts and draws that token again with it banned.
    banned_strings: tuple[str, ...] | list[str] = ()

    @classmethod
    def greedy(cls) -> SamplingSettings:
        return cls(temperature=0.0)

    @property
    def is_greedy(self) -> bool:
        """The token is the argmax of the (processed) logits: no draw, no uniform used."""
        return self.temperature <= 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Raise :class:`~engine.errors.SamplingSettingError` naming the first field outside its
        range (:data:`SETTINGS` order, then ``logit_bias``, ``dry_sequence_breakers`` and
        ``banned_strings``). The one check of these values: the
        Sampler runs it for every job, and entry points (the CLI, the app's worker, a server) call
        it to refuse bad values before any model work."""
        for setting in SETTINGS:
            value = getattr(self, setting.name)
            if not setting.accepts(value):
                raise SamplingSettingError(setting.name, setting.allowed, value)
        self._validate_logit_bias()
        _check_strings("dry_sequence_breakers", self.dry_sequence_breakers, STRINGS_ALLOWED)
        _check_strings("banned_strings", self.banned_strings, BANNED_ALLOWED, BANNED_STRING_MAX_CHARS)

    def _validate_logit_bias(self) -> None:
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
