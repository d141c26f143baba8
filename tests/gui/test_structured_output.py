"""Structured output in the app: a per-conversation JSON schema (checked when saved, persisted),
passed to the engine as a constraint, and a completed constrained reply shown as formatted JSON."""

from __future__ import annotations

import json
import subprocess
import sys

from fake_engine import FakeConstraint, FakeEngine
from gui_helpers import load_model, send, wait_idle

from app.chat.conversation_settings import ConversationSettingsDialog
from app.chat.structured import display_text, schema_problem
from app.worker import EngineClient
from engine.api import GenerationRequest, ReplyStats

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "tags"],
    }
)
REPLY = '{"name":"Ada","tags":["math","code"]}'
MESSAGES = [{"role": "user", "content": "who?"}]


def test_schema_persists_per_conversation(qtbot, make_window) -> None:
    window = make_window()
    with_schema = window.chat.new_conversation()
    window.chat.set_json_schema(SCHEMA)
    without = window.chat.new_conversation()
    window.close()
    again = make_window()  # a new window on a reopened store: what was saved is still there
    assert again.store.conversation(with_schema).json_schema == SCHEMA
    assert again.store.conversation(without).json_schema == ""


def test_dialog_refuses_an_invalid_schema_with_a_message(qtbot) -> None:
    dialog = ConversationSettingsDialog("sys", "balanced", {}, json_schema=SCHEMA)
    qtbot.addWidget(dialog)
    assert dialog.json_schema_text() == SCHEMA  # the stored schema is shown back
    dialog.show()

    dialog.json_schema.setPlainText('{"type": "object",')  # not JSON
    dialog.accept()
    assert dialog.isVisible() and dialog.result() != dialog.DialogCode.Accepted
    assert "not valid JSON" in dialog.schema_error.text() and dialog.schema_error.isVisible()

    dialog.json_schema.setPlainText('{"type": "objekt"}')  # JSON, but the engine refuses it
    dialog.accept()
    assert dialog.isVisible() and "cannot be used" in dialog.schema_error.text()

    dialog.json_schema.setPlainText(SCHEMA)
    dialog.accept()
    assert dialog.result() == dialog.DialogCode.Accepted and not dialog.schema_error.isVisible()
    assert dialog.json_schema_text() == SCHEMA


def test_schema_problem_matches_the_engine_compiler() -> None:
    assert schema_problem("") == "" and schema_problem("  \n") == ""
    assert schema_problem(SCHEMA) == ""
    assert "not valid JSON" in schema_problem("{")
    assert "minimum" in schema_problem('{"type": "integer", "minimum": "zero"}')


def _generate(qtbot, client: EngineClient, json_schema: str = "") -> ReplyStats:
    with qtbot.waitSignal(client.loaded, timeout=5000):
        client.load("/models/tiny")
    with qtbot.waitSignal(client.generationFinished, timeout=5000) as blocker:
        client.generate(MESSAGES, GenerationRequest(max_new_tokens=50, json_schema=json_schema))
    return blocker.args[1]


def test_worker_passes_a_constraint_only_when_a_schema_is_set(
    qtbot, engine_client: EngineClient, fake_engine: FakeEngine
) -> None:
    fake_engine.reply = lambda _m: REPLY
    stats = _generate(qtbot, engine_client, SCHEMA)
    assert fake_engine.calls[-1]["constraint"] == FakeConstraint(SCHEMA)
    assert stats.stop_reason == "constraint_complete" and stats.error == ""
    with qtbot.waitSignal(engine_client.generationFinished, timeout=5000) as blocker:
        engine_client.generate(MESSAGES, GenerationRequest(max_new_tokens=50))
    assert fake_engine.calls[-1]["constraint"] is None
    assert blocker.args[1].stop_reason == "eos"


def test_worker_reports_constraint_errors_readably(
    qtbot, engine_client: EngineClient, fake_engine: FakeEngine
) -> None:
    errors: list[str] = []
    engine_client.error.connect(errors.append)
    # Refused before any model work: the session is never asked.
    stats = _generate(qtbot, engine_client, "{not json")
    assert stats.stop_reason == "error" and "not valid JSON" in stats.error
    assert fake_engine.calls == []
    # The engine gives up mid-reply (chunk.error): its reason reaches the user.
    fake_engine.constraint_error = "no allowed token can follow"
    with qtbot.waitSignal(engine_client.generationFinished, timeout=5000) as blocker:
        engine_client.generate(MESSAGES, GenerationRequest(max_new_tokens=50, json_schema=SCHEMA))
    stats = blocker.args[1]
    assert stats.stop_reason == "constraint_error"
    assert "JSON schema" in stats.error and "no allowed token can follow" in stats.error
    assert errors[-1] == stats.error


def test_completed_constrained_reply_is_shown_formatted(qtbot, window, fake_engine: FakeEngine) -> None:
    fake_engine.reply = lambda _m: REPLY
    load_model(qtbot, window)
    window.chat.new_conversation()
    window.chat.set_json_schema(SCHEMA)
    send(qtbot, window, "who?")
    wait_idle(qtbot, window)

    assert fake_engine.calls[-1]["constraint"] == FakeConstraint(SCHEMA)
    reply = window.store.current_path(window.chat.conversation_id)[-1]
    assert reply.content == REPLY  # stored raw; formatted only for display
    assert reply.stats["stop_reason"] == "constraint_complete"
    shown = window.chat_pane.view.message_widget(1).plain_text()
    assert json.dumps(json.loads(REPLY), indent=2) in shown
    assert REPLY not in shown


def test_display_text_formats_only_completed_constrained_json() -> None:
    done = {"stop_reason": "constraint_complete"}
    assert display_text(REPLY, done) == f"```json\n{json.dumps(json.loads(REPLY), indent=2)}\n```"
    assert display_text(REPLY, {"stop_reason": "eos"}) == REPLY
    assert display_text('{"a": ', done) == '{"a": '  # not JSON after all: shown as written
    assert display_text('{"a":"```"}', done).startswith("````json\n")  # fence longer than the content's


def test_checking_a_schema_does_not_import_torch() -> None:
    # The dialog checks schemas on the GUI thread; torch must load only on the engine thread.
    code = (
        "import sys; from app.chat.structured import schema_problem; "
        f"assert schema_problem({SCHEMA!r}) == ''; assert 'torch' not in sys.modules, 'torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_export_and_import_keep_the_schema(store) -> None:
    from app.store.export import from_json, to_json

    conv = store.create_conversation("typed", json_schema=SCHEMA)
    data = to_json(store, conv.id)
    assert store.conversation(from_json(store, data)).json_schema == SCHEMA
    del data["json_schema"]  # an export from before structured output
    assert store.conversation(from_json(store, data)).json_schema == ""
