"""EngineWorker/EngineClient against the scripted fake engine: streaming, cancel, errors."""

from __future__ import annotations

import threading

import pytest
from fake_engine import FakeEngine, default_reply, tokens_of

from app.worker import EngineClient, describe_error
from engine.api import GenerationRequest, ModelInfo, ReplyStats
from engine.errors import ModelLoadError

MESSAGES = [{"role": "user", "content": "hello"}]


def load(qtbot, client: EngineClient, path: str = "/models/tiny") -> ModelInfo:
    with qtbot.waitSignal(client.loaded, timeout=5000) as blocker:
        client.load(path)
    return blocker.args[0]


def test_load_reports_progress_then_model_info(qtbot, engine_client: EngineClient) -> None:
    progress: list[float] = []
    engine_client.loadProgress.connect(lambda f, _msg: progress.append(f))
    info = load(qtbot, engine_client)
    assert info.name == "tiny" and info.context_length == 2048
    assert info.memory_bytes == 123 * 1024 * 1024 and info.device == "cpu"
    assert progress[0] == 0.0 and progress[-1] == 1.0 and progress == sorted(progress)
    assert engine_client.is_loaded


def test_stream_arrives_in_order_off_the_gui_thread(qtbot, engine_client: EngineClient, fake_engine) -> None:
    gui_thread = threading.current_thread()
    seen_threads = []
    original = fake_engine.reply

    def reply(messages):
        seen_threads.append(threading.current_thread())
        return original(messages)

    fake_engine.reply = reply
    load(qtbot, engine_client)
    chunks: list[str] = []
    engine_client.chunk.connect(lambda rid, text: chunks.append(text))
    with qtbot.waitSignal(engine_client.generationFinished, timeout=5000) as blocker:
        rid = engine_client.generate(MESSAGES, GenerationRequest({"temperature": 0.3}, max_new_tokens=100))
    assert blocker.args[0] == rid
    stats = blocker.args[1]
    assert "".join(chunks) == default_reply(MESSAGES)
    assert stats.stop_reason == "eos" and stats.new_tokens == len(chunks)
    assert stats.prompt_tokens > 0 and stats.tokens_per_second > 0
    assert seen_threads and seen_threads[0] is not gui_thread
    assert fake_engine.calls[0]["settings"] == {"temperature": 0.3}
    assert fake_engine.calls[0]["max_new_tokens"] == 100


def test_cancel_stops_mid_reply(qtbot, engine_client: EngineClient, fake_engine: FakeEngine) -> None:
    fake_engine.reply = lambda m: "word " * 500
    fake_engine.token_delay = 0.005
    load(qtbot, engine_client)
    chunks: list[str] = []
    engine_client.chunk.connect(lambda rid, text: chunks.append(text))
    with qtbot.waitSignal(engine_client.generationFinished, timeout=5000) as blocker:
        rid = engine_client.generate(MESSAGES, GenerationRequest())
        qtbot.waitUntil(lambda: len(chunks) >= 3, timeout=3000)
        engine_client.cancel(rid)
    assert blocker.args[1].stop_reason == "cancelled"
    assert 3 <= blocker.args[1].new_tokens < 500


def test_cancel_before_start_skips_the_generation(qtbot, engine_client, fake_engine) -> None:
    load(qtbot, engine_client)
    # Block the engine thread so the second request is still queued when it is cancelled.
    fake_engine.reply = lambda m: "slow " * 40
    fake_engine.token_delay = 0.01
    first = engine_client.generate(MESSAGES, GenerationRequest())
    second = engine_client.generate(MESSAGES, GenerationRequest())
    engine_client.cancel(second)
    finished: dict[int, ReplyStats] = {}
    engine_client.generationFinished.connect(lambda rid, stats: finished.__setitem__(rid, stats))
    qtbot.waitUntil(lambda: len(finished) == 2, timeout=5000)
    assert finished[first].stop_reason == "eos"
    assert finished[second].stop_reason == "cancelled" and finished[second].new_tokens == 0
    assert len(fake_engine.calls) == 1


def test_load_error_becomes_a_message_and_the_worker_survives(qtbot, engine_client, fake_engine) -> None:
    fake_engine.load_error = ModelLoadError("model.safetensors is truncated")
    errors: list[str] = []
    engine_client.error.connect(errors.append)
    with qtbot.waitSignal(engine_client.loadFailed, timeout=5000) as blocker:
        engine_client.load("/models/broken")
    assert "model.safetensors is truncated" in blocker.args[0] and "broken" in blocker.args[0]
    assert errors == [blocker.args[0]]
    assert not engine_client.is_loaded and not engine_client.loading
    fake_engine.load_error = None
    assert load(qtbot, engine_client).name == "tiny"


@pytest.mark.parametrize(
    "exc",
    [RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), MemoryError()],
)
def test_out_of_memory_mid_reply_is_reported_readably(qtbot, engine_client, fake_engine, exc) -> None:
    fake_engine.generate_error = exc
    fake_engine.fail_after_tokens = 3
    load(qtbot, engine_client)
    chunks: list[str] = []
    errors: list[str] = []
    engine_client.chunk.connect(lambda rid, text: chunks.append(text))
    engine_client.error.connect(errors.append)
    with qtbot.waitSignal(engine_client.generationFinished, timeout=5000) as blocker:
        engine_client.generate(MESSAGES, GenerationRequest())
    stats = blocker.args[1]
    assert stats.stop_reason == "error" and stats.error.startswith("Out of memory")
    assert len(chunks) == 3 and errors == [stats.error]
    # Still usable afterwards.
    fake_engine.generate_error = None
    with qtbot.waitSignal(engine_client.generationFinished, timeout=5000) as blocker:
        engine_client.generate(MESSAGES, GenerationRequest())
    assert blocker.args[1].stop_reason == "eos"


def test_generate_without_a_model_says_so(qtbot, engine_client) -> None:
    with qtbot.waitSignal(engine_client.generationFinished, timeout=5000) as blocker:
        engine_client.generate(MESSAGES, GenerationRequest())
    assert blocker.args[1].stop_reason == "error"
    assert "no model is loaded" in blocker.args[1].error


def test_unload_and_token_count(qtbot, engine_client, fake_engine) -> None:
    load(qtbot, engine_client)
    with qtbot.waitSignal(engine_client.tokensCounted, timeout=5000) as blocker:
        rid = engine_client.count_tokens(MESSAGES)
    assert blocker.args == [rid, 5]
    with qtbot.waitSignal(engine_client.unloaded, timeout=5000):
        engine_client.unload()
    assert fake_engine.unloads == 1 and not engine_client.is_loaded


def test_starter_install_reports_progress_and_path(qtbot, engine_client, tmp_path) -> None:
    progress: list[str] = []
    engine_client.starterProgress.connect(lambda f, msg: progress.append(msg))
    with qtbot.waitSignal(engine_client.starterReady, timeout=5000) as blocker:
        engine_client.install_starter(tmp_path / "models")
    assert blocker.args[0] == str(tmp_path / "models" / "SmolLM2-135M-Instruct")
    assert progress


def test_describe_error_messages() -> None:
    class OutOfMemoryError(RuntimeError):  # what torch.OutOfMemoryError looks like by name
        pass

    assert describe_error(OutOfMemoryError("boom"), "loading x").startswith("Out of memory while loading x")
    assert describe_error(ModelLoadError("bad"), "loading x") == "Could not finish loading x: bad"
    missing = ModuleNotFoundError("No module named 'engine.session'", name="engine.session")
    assert "lacks the engine module engine.session" in describe_error(missing, "loading x")
    assert "unexpected ValueError: nope" in describe_error(ValueError("nope"), "the reply")


def test_long_conversations_are_trimmed_to_fit_the_context(qtbot, engine_client, fake_engine) -> None:
    fake_engine.context_length = 60
    load(qtbot, engine_client)
    history = [{"role": "system", "content": "be nice"}]
    for i in range(8):
        history.append({"role": "user", "content": f"question {i} " + "word " * 5})
        history.append({"role": "assistant", "content": f"answer {i} " + "word " * 5})
    history.append({"role": "user", "content": "last question"})
    with qtbot.waitSignal(engine_client.generationFinished, timeout=5000) as blocker:
        engine_client.generate(history, GenerationRequest(max_new_tokens=20))
    sent = fake_engine.calls[-1]["messages"]
    assert sent[0] == history[0] and sent[-1] == history[-1]  # system prompt and newest kept
    assert sent == [history[0], *history[len(history) - len(sent) + 1 :]]  # oldest turns left out
    session_tokens = sum(len(tokens_of(m["content"])) + 4 for m in sent)
    assert session_tokens + 20 <= 60
    assert blocker.args[1].trimmed_messages == len(history) - len(sent)


def test_reply_budget_is_capped_by_what_the_context_has_left(qtbot, engine_client, fake_engine) -> None:
    fake_engine.context_length = 40
    load(qtbot, engine_client)
    with qtbot.waitSignal(engine_client.generationFinished, timeout=5000):
        engine_client.generate(
            [{"role": "user", "content": "word " * 10}], GenerationRequest(max_new_tokens=1000)
        )
    prompt = len(tokens_of("word " * 10)) + 4  # the fake's count_tokens
    assert fake_engine.calls[-1]["max_new_tokens"] == 40 - prompt
