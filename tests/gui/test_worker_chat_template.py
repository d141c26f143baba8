"""The app's worker against the real engine and a tiny model whose chat template runs away: the
reply fails with the template's limit as the error message, the engine thread stays usable for
the next reply, and quitting while such a template renders does not leave the thread running
(which used to abort the app with "QThread destroyed while running")."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from app.worker import EngineClient
from engine.api import GenerationRequest, ReplyStats
from engine.tokenizer import TemplateLimits

RUNAWAY = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
GOOD = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
MESSAGES = [{"role": "user", "content": "hello"}]
# Clients whose thread outlived the test: kept referenced, so a failing test fails with its
# assertion rather than a QThread destroyed under a running thread.
_STUCK: list[EngineClient] = []


@pytest.fixture
def model_dir(exl3_dir: Path, tmp_path: Path) -> Path:
    """The fixtures' tiny Llama (4 MB), with the runaway template as its chat template."""
    directory = tmp_path / "runaway-template"
    shutil.copytree(exl3_dir / "tiny-llama-hf", directory)
    for path in directory.iterdir():
        path.chmod(0o644)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": RUNAWAY}))
    return directory


@pytest.fixture
def client(qtbot, model_dir: Path):
    engine = EngineClient()  # the real engine, in its own QThread
    with qtbot.waitSignal(engine.loaded, timeout=120_000):
        engine.load(model_dir, "cpu")
    yield engine
    engine.shutdown()
    if engine._thread.isRunning():
        _STUCK.append(engine)


def tokenizer(client: EngineClient):
    # Read and set between replies only, while the engine thread is idle.
    return client.worker._session.tokenizer


def reply(qtbot, client: EngineClient) -> tuple[ReplyStats, float]:
    started = time.monotonic()
    with qtbot.waitSignal(client.generationFinished, timeout=30_000) as finished:
        client.generate(MESSAGES, GenerationRequest({"temperature": 0.0}, max_new_tokens=4))
    return finished.args[1], time.monotonic() - started


def test_template_limit_is_the_replys_error_and_the_next_reply_works(qtbot, client: EngineClient) -> None:
    made_with = tokenizer(client).template_limits
    tokenizer(client).template_limits = TemplateLimits(seconds=1.0, max_loop_iterations=10**12)
    errors: list[str] = []
    client.error.connect(errors.append)

    stats, seconds = reply(qtbot, client)
    assert stats.stop_reason == "error"
    assert "time limit" in stats.error and "more than 1 s" in stats.error
    assert stats.error.startswith("Could not finish the reply: ")
    assert "Traceback" not in stats.error and "\n" not in stats.error
    assert errors == [stats.error]  # the error signal carries the same one message
    assert seconds < 6.0

    tokenizer(client).chat_template = GOOD
    stats, _ = reply(qtbot, client)
    assert stats.stop_reason in ("eos", "max_new_tokens", "stop_string"), stats
    assert stats.new_tokens > 0 and stats.prompt_tokens > 0
    assert len(errors) == 1  # nothing new went wrong
    # The session sized the size limit for the model's 4096-token context.
    assert made_with == TemplateLimits().for_context(4096)


def test_quitting_while_a_runaway_template_renders_joins_the_thread(qtbot, client: EngineClient) -> None:
    tokenizer(client).template_limits = TemplateLimits(seconds=2.0, max_loop_iterations=10**12)
    client.generate(MESSAGES, GenerationRequest({"temperature": 0.0}, max_new_tokens=4))
    time.sleep(0.3)  # the engine thread is inside the template now
    started = time.monotonic()
    client.shutdown(timeout_ms=10_000)
    assert not client._thread.isRunning(), "the engine thread was still rendering after 10 s"
    assert time.monotonic() - started < 6.0
