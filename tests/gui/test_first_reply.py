"""The first reply after a load (issue 40, defect 5): the model is warmed up while it loads,
behind the load's progress, and a long prompt says "Reading your message (N tokens)" with
progress until the reply starts."""

from __future__ import annotations

from gui_helpers import load_model, send, wait_idle


def test_the_warm_up_is_part_of_loading(qtbot, window, fake_engine) -> None:
    fake_engine.warm_up_delay = 0.2
    messages: list[tuple[float, str]] = []
    window.engine.loadProgress.connect(lambda f, m: messages.append((f, m)))
    warm_ups_at_loaded: list[int] = []
    window.engine.loaded.connect(lambda _info: warm_ups_at_loaded.append(fake_engine.warm_ups))
    load_model(qtbot, window)
    assert warm_ups_at_loaded == [1]  # done before "loaded"
    assert ("Warming up" in [m for _, m in messages]) and messages[-1] == (1.0, "Loaded")
    assert [f for f, _ in messages] == sorted(f for f, _ in messages)  # the bar never goes back
    send(qtbot, window, "hello")
    assert fake_engine.calls[-1]["warmed_up"] and fake_engine.warm_ups == 1  # not again


def test_a_long_prompt_says_it_is_being_read(qtbot, window, fake_engine) -> None:
    fake_engine.prefill_chunk = 100
    fake_engine.prefill_delay = 0.1
    load_model(qtbot, window)
    pane = window.chat_pane
    send(qtbot, window, "word " * 800, wait=False)
    qtbot.waitUntil(lambda: pane.speed_label.text().startswith("Reading your message ("), timeout=5000)
    assert pane.prefill_bar.isVisible() and pane.prefill_bar.maximum() > 800
    assert "tokens)…" in pane.speed_label.text()
    qtbot.waitUntil(lambda: pane.prefill_bar.value() >= 300, timeout=5000)  # it moves
    wait_idle(qtbot, window)
    assert not pane.prefill_bar.isVisible() and "tokens/s" in pane.speed_label.text()

    # A short prompt is read too fast to be worth saying.
    seen = []
    window.chat.prefillProgress.connect(lambda done, total: seen.append(pane.speed_label.text()))
    send(qtbot, window, "short one")
    assert not any(text.startswith("Reading") for text in seen)
