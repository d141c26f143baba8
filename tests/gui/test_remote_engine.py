"""Remote engines in the app: Settings › Engines adds an endpoint (its key to the keyring), its
models join the picker, and chats run through the same worker signals as a local model, against
a deliberately faulty endpoint (tests/support/faulty_endpoint.py) and against ``python -m engine
serve`` in another process. Failures keep what arrived and say what happened; the GUI thread
never stalls over 50 ms meanwhile (a 5 ms QTimer probe, its thread CPU time between ticks)."""

from __future__ import annotations

import re
import time

import pytest
from engine_serve_process import engine_serve
from faulty_endpoint import KEY, PARTIAL, REPLY, FaultyEndpoint
from gui_helpers import send, visible_texts, wait_idle
from memory_keyring import memory_keyring
from PySide6.QtCore import QTimer

from app.library.model import PATH_ROLE
from app.remote.refs import make_ref


@pytest.fixture(scope="module")
def endpoint():
    with FaultyEndpoint() as running:
        yield running


@pytest.fixture
def keys():
    with memory_keyring() as backend:
        yield backend


class StallProbe:
    """The longest stretch of GUI-thread CPU time between two ticks of a 5 ms timer."""

    def __init__(self) -> None:
        self.ticks: list[tuple[float, float]] = []
        self.timer = QTimer()
        self.timer.setInterval(5)
        self.timer.timeout.connect(lambda: self.ticks.append((time.perf_counter(), time.thread_time())))

    def __enter__(self) -> StallProbe:
        self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.timer.stop()

    @property
    def longest_cpu_ms(self) -> float:
        cpu = [b[1] - a[1] for a, b in zip(self.ticks, self.ticks[1:])]
        return 1000 * max(cpu, default=0.0)


def add_endpoint(qtbot, window, url: str, key: str = "") -> None:
    dialog = window.open_engines()
    with qtbot.waitSignal(window.remote.refreshed, timeout=10000):
        assert dialog.add(url, key)
    dialog.close()


def picker_refs(window) -> list[str]:
    picker = window.model_bar.picker
    return [picker.itemData(i, PATH_ROLE) for i in range(picker.count())]


def load_remote(qtbot, window, ref: str, timeout: int = 10000) -> None:
    with qtbot.waitSignal(window.engine.loaded, timeout=timeout):
        window.request_load(ref)


def test_endpoint_models_join_the_picker_and_chat(qtbot, window, endpoint, keys):
    add_endpoint(qtbot, window, endpoint.base_url, KEY)
    refs = picker_refs(window)
    assert make_ref(endpoint.base_url, "good") in refs
    assert (
        keys.passwords
        and KEY not in window.store.db.execute("SELECT group_concat(value) FROM settings").fetchone()[0]
    )
    load_remote(qtbot, window, make_ref(endpoint.base_url, "good"))
    assert "remote (127.0.0.1" in window.model_bar.status.toolTip() + window.model_bar.status.text()
    with StallProbe() as probe:
        send(qtbot, window, "Hello there")
    assert visible_texts(window)[-1] == ("assistant", REPLY)
    stats = window.chat.model.items()[-1].stats
    assert stats["new_tokens"] == 9 and stats["prompt_tokens"] == 11
    assert probe.longest_cpu_ms < 50, probe.longest_cpu_ms
    body = endpoint.requests[-1]
    assert body["messages"][0]["role"] == "system"  # the conversation's system prompt goes along
    assert body["messages"][-1] == {"role": "user", "content": "Hello there"}
    # Regenerate: another request, a sibling reply.
    assert window.chat.regenerate()
    wait_idle(qtbot, window)
    assert window.chat.model.items()[-1].sibling_count == 2


def test_a_wrong_key_fails_the_load_with_a_clear_message(qtbot, window, endpoint, keys):
    add_endpoint(qtbot, window, endpoint.base_url, "not-the-key")
    assert window.remote.listed == {}  # the listing was refused too
    with qtbot.waitSignal(window.engine.loadFailed, timeout=10000) as failed:
        window.request_load(make_ref(endpoint.base_url, "good"))
    assert "refused the API key (HTTP 401)" in failed.args[0]
    assert "not-the-key" not in failed.args[0]


@pytest.mark.parametrize(
    ("model", "kept", "message"),
    [
        ("drop", PARTIAL, r"dropped mid-reply|ended before the reply did"),
        ("busy", None, r"HTTP 429.*Try again in 7 s"),
        ("broken", None, r"server error \(HTTP 500\)"),
    ],
)
def test_faults_keep_what_arrived_and_say_why(qtbot, window, endpoint, keys, model, kept, message):
    add_endpoint(qtbot, window, endpoint.base_url, KEY)
    load_remote(qtbot, window, make_ref(endpoint.base_url, model))
    errors: list[str] = []
    window.chat.errorOccurred.connect(errors.append)
    with StallProbe() as probe:
        send(qtbot, window, "Hello")
    assert errors and re.search(message, errors[-1]), errors
    last = visible_texts(window)[-1]
    if kept is None:
        assert last == ("user", "Hello")  # nothing arrived: the branch ends at the question
    else:
        assert last == ("assistant", kept)
        stored = window.store.current_path(window.chat.conversation_id)[-1]
        assert stored.content == kept and stored.complete
    assert probe.longest_cpu_ms < 50, probe.longest_cpu_ms


def test_slow_first_byte_keeps_the_gui_responsive_and_stop_works(qtbot, window, endpoint, keys):
    add_endpoint(qtbot, window, endpoint.base_url, KEY)
    load_remote(qtbot, window, make_ref(endpoint.base_url, "slow"))
    with StallProbe() as probe:
        send(qtbot, window, "Hello", wait=False)
        qtbot.wait(300)  # the endpoint is silent for a second
        started = time.perf_counter()
        window.chat.stop()
        wait_idle(qtbot, window, timeout=2000)
        assert time.perf_counter() - started < 0.5
    assert probe.longest_cpu_ms < 50, probe.longest_cpu_ms
    with StallProbe() as probe:
        send(qtbot, window, "Again", wait=False)
        wait_idle(qtbot, window, timeout=10000)
    assert visible_texts(window)[-1] == ("assistant", REPLY)
    assert probe.longest_cpu_ms < 50, probe.longest_cpu_ms


@pytest.mark.slow
def test_the_app_against_engine_serve_in_another_process(qtbot, window, smollm2_dir, keys):
    with engine_serve(smollm2_dir, "s3") as served:
        base_url = served.base_url
        add_endpoint(qtbot, window, base_url, "s3")
        ref = make_ref(base_url, smollm2_dir.name)
        assert ref in picker_refs(window)
        load_remote(qtbot, window, ref)
        window.chat.new_conversation()
        window.chat.set_sampling("precise", {"max_new_tokens": 12})
        with StallProbe() as probe:
            send(qtbot, window, "What is the capital of France?", wait=False)
            wait_idle(qtbot, window, timeout=120000)
        role, text = visible_texts(window)[-1]
        assert role == "assistant" and text.strip()
        stats = window.chat.model.items()[-1].stats
        assert 0 < stats["new_tokens"] <= 12 and stats["prompt_tokens"] > 0
        assert probe.longest_cpu_ms < 50, probe.longest_cpu_ms
