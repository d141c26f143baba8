"""A scripted stand-in for ``engine.session.ChatSession``, for fast GUI tests.

It speaks the same facade as the real engine (``load``-style factory, ``stream_chat`` yielding
chunks with ``text``/``done``/``stop_reason``/token counts, ``should_stop``), streams canned text
with a delay per token, and can be told to fail while loading or mid-reply.
"""

from __future__ import annotations

import json
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class FakeChunk:
    text: str
    done: bool = False
    stop_reason: str | None = None
    prompt_tokens: int = 0
    new_tokens: int = 0
    tokens_per_second: float = 0.0


def tokens_of(text: str) -> list[str]:
    """Split into word-ish pieces that concatenate back to ``text`` exactly."""
    return re.findall(r"\s*\S+|\s+", text)


def default_reply(messages: list[dict]) -> str:
    last = messages[-1]["content"] if messages else ""
    return f"You said: {last}. Here is some code:\n\n```python\nprint({last!r})\n```\n\nDone."


@dataclass
class FakeEngine:
    """Configuration + call log shared by every session it makes; pass ``engine.factory``."""

    reply: Callable[[list[dict]], str] = default_reply
    token_delay: float = 0.002
    load_delay: float = 0.0
    load_error: BaseException | None = None
    # Raise this after ``fail_after_tokens`` tokens of a reply.
    generate_error: BaseException | None = None
    fail_after_tokens: int = 0
    context_length: int = 2048
    calls: list[dict[str, Any]] = field(default_factory=list)
    loads: list[str] = field(default_factory=list)
    unloads: int = 0
    # Set when a token has been produced; tests wait on it to stop "mid-reply".
    streaming: threading.Event = field(default_factory=threading.Event)

    def factory(self, model_dir: str, device: str, progress: Callable[[float, str], None]) -> FakeSession:
        for i in range(5):
            progress(i / 5, f"Loading layer {i + 1}/5")
            time.sleep(self.load_delay / 5)
        if self.load_error is not None:
            raise self.load_error
        self.loads.append(model_dir)
        return FakeSession(self, Path(model_dir).name)

    def sampling(self, values: dict[str, Any]) -> dict[str, Any]:
        """Stands in for engine.generation.sampling.SamplingSettings construction."""
        return dict(values)


class FakeSession:
    def __init__(self, engine: FakeEngine, name: str) -> None:
        self.engine = engine
        self.model_name = name
        self.context_length = engine.context_length
        self.device = "cpu"

    def memory_bytes(self) -> int:
        return 123 * 1024 * 1024

    def count_tokens(self, messages: list[dict]) -> int:
        return sum(len(tokens_of(m["content"])) + 4 for m in messages)

    def stream_chat(
        self,
        messages: list[dict],
        settings: Any,
        max_new_tokens: int = 512,
        stop_strings: Sequence[str] = (),
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[FakeChunk]:
        engine = self.engine
        engine.calls.append(
            {"messages": list(messages), "settings": settings, "max_new_tokens": max_new_tokens}
        )
        prompt_tokens = self.count_tokens(messages)
        pieces = tokens_of(engine.reply(messages))
        started = time.perf_counter()
        produced = 0
        for piece in pieces:
            if should_stop is not None and should_stop():
                yield FakeChunk("", True, "cancelled", prompt_tokens, produced, _rate(produced, started))
                return
            if engine.generate_error is not None and produced >= engine.fail_after_tokens:
                raise engine.generate_error
            if produced >= max_new_tokens:
                yield FakeChunk("", True, "max_new_tokens", prompt_tokens, produced, _rate(produced, started))
                return
            # Paced against the clock (not sleep-per-token), so 1/200 s really gives 200 tokens/s.
            delay = started + (produced + 1) * engine.token_delay - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            produced += 1
            engine.streaming.set()
            yield FakeChunk(piece, False, None, prompt_tokens, produced, _rate(produced, started))
        yield FakeChunk("", True, "eos", prompt_tokens, produced, _rate(produced, started))

    def unload(self) -> None:
        self.engine.unloads += 1


def _rate(n: int, started: float) -> float:
    elapsed = time.perf_counter() - started
    return n / elapsed if elapsed > 0 else 0.0


def make_model_dir(target: Path, architecture: str = "LlamaForCausalLM") -> Path:
    """A folder that ``engine.inspect`` accepts as a loadable model (the fake never reads it)."""
    target.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "max_position_embeddings": 2048,
    }
    (target / "config.json").write_text(json.dumps(config))
    (target / "tokenizer.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F16", "shape": [8, 8], "data_offsets": [0, 128]}}).encode()
    (target / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(128))
    return target


def fake_starter(models_dir: Path, progress: Callable[[float, str], None] | None = None) -> Path:
    """Stands in for engine.starter.ensure_starter_model: makes a model folder, reports progress."""
    for i in range(3):
        if progress:
            progress(i / 3, "Importing starter model")
    return make_model_dir(models_dir / "SmolLM2-135M-Instruct")
