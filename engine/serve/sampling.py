"""A request's sampling fields as the engine's settings, its token budget and its stops."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import SamplingSettingError
from engine.generation.sampling import SamplingSettings
from engine.serve.errors import bad_request
from engine.serve.schemas import MAX_STOPS, SamplingFields

# OpenAI's defaults where a request says nothing (the engine's own differ: the app's presets).
DEFAULT_TEMPERATURE = 1.0


@dataclass(frozen=True)
class Sampling:
    settings: SamplingSettings
    max_tokens: int | None  # None: the server's default
    stops: tuple[str, ...]


def read_sampling(request: SamplingFields, max_tokens: int | None) -> Sampling:
    """``max_tokens``: the budget the request asked for (chat's ``max_completion_tokens`` or
    ``max_tokens``), checked here."""
    if request.n not in (None, 1):
        raise bad_request("only n=1 is supported: send one request per completion", param="n")
    if max_tokens is not None and max_tokens < 1:
        chosen = getattr(request, "max_completion_tokens", None) is not None
        param = "max_completion_tokens" if chosen else "max_tokens"
        raise bad_request(f"{param} must be at least 1, got {max_tokens}", param=param)
    stops = request.stop
    if isinstance(stops, str):
        stops = [stops]
    stops = [s for s in stops or () if s]
    if len(stops) > MAX_STOPS:
        raise bad_request(f"at most {MAX_STOPS} stop sequences, got {len(stops)}", param="stop")
    bias = {}
    for key, value in (request.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise bad_request(f"logit_bias keys are token ids, got {key!r}", param="logit_bias") from None
    settings = SamplingSettings(
        temperature=DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k or 0,
        min_p=request.min_p or 0.0,
        repetition_penalty=request.repetition_penalty or 1.0,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        seed=request.seed,
        logit_bias=bias,
    )
    try:
        settings.validate()
    except SamplingSettingError as exc:
        raise bad_request(str(exc), param=exc.field) from None
    return Sampling(settings, max_tokens, tuple(stops))
