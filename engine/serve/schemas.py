"""The request bodies the server accepts, as pydantic models, and reading one from raw bytes.

Unknown fields are allowed (clients send many we have no use for, ``user``, ``store``,
``metadata``...); fields we cannot honour are refused by the handlers with a reason rather than
ignored (``n`` > 1, ``logprobs``). Ranges are OpenAI's, so a request that OpenAI refuses is
refused here too, with the same kind of error.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.serve.errors import APIError, bad_request

MAX_STOPS = 4  # OpenAI's limit on stop sequences


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingFields(_Request):
    """What chat and text completions share."""

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = 1
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Extensions other local servers (vLLM, llama.cpp) accept under these names.
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)


class ChatRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


Model = TypeVar("Model", bound=BaseModel)


def parse_body(body: bytes, model: type[Model]) -> Model:
    """``body`` read as ``model``; a 400 naming what is wrong otherwise."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from None
