"""Every sampling editor in the conversation settings says what it does (its engine tooltip)."""

from __future__ import annotations

from app.chat.conversation_settings import ConversationSettingsDialog
from engine.generation.sampling_settings import SETTINGS


def test_every_sampling_editor_has_the_engines_tooltip(qtbot) -> None:
    dialog = ConversationSettingsDialog("", "balanced", {})
    qtbot.addWidget(dialog)
    for setting in SETTINGS:
        if setting.editor is not None:
            assert dialog.fields[setting.name].toolTip() == setting.tip
    assert dialog.fields["dry_multiplier"].value() == 0.0  # new samplers start off in every preset
    assert dialog.fields["max_new_tokens"].toolTip()
