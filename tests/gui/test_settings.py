"""Settings: declared as data, validated, edited in generated dialogs, applied live, persisted."""

from __future__ import annotations

import subprocess
import sys

from app.chat.conversation_settings import ConversationSettingsDialog
from app.chat.presets import PRESETS, SAMPLING_DEFAULTS, effective_sampling, split_generation_limits
from app.settings.dialog import SettingsDialog
from app.settings.schema import BY_KEY, SETTINGS
from engine.generation.sampling_settings import BY_NAME


def test_schema_validation_coerces_or_falls_back() -> None:
    assert BY_KEY["appearance.theme"].validate("dark") == "dark"
    assert BY_KEY["appearance.theme"].validate("purple") == "system"
    assert BY_KEY["appearance.font_size"].validate("14") == 14
    assert BY_KEY["appearance.font_size"].validate(500) == 32
    assert BY_KEY["appearance.font_size"].validate("big") == 11
    assert BY_KEY["library.folders"].validate("not a list") == []
    assert len({s.key for s in SETTINGS}) == len(SETTINGS)


def test_settings_dialog_is_generated_applies_and_persists(qtbot, make_window) -> None:
    window = make_window()
    dialog = SettingsDialog(window.settings, window)
    qtbot.addWidget(dialog)
    assert "library.folders" not in dialog.editors  # hidden state is not a preference
    theme = dialog.editors["appearance.theme"]
    theme.setCurrentIndex(theme.findData("dark"))
    dialog.editors["appearance.font_size"].setValue(15)
    dialog.editors["chat.default_system_prompt"].setText("Be concise.")
    dialog.apply()
    assert window.dark
    assert window.chat_pane.view.font().pointSize() == 15
    window.chat.new_conversation()
    assert window.store.conversation(window.chat.conversation_id).system_prompt == "Be concise."
    window.close()
    again = make_window()
    assert again.settings.get("appearance.theme") == "dark" and again.dark
    again.settings.set("appearance.theme", "light")


def test_conversation_settings_dialog_keeps_only_real_overrides(qtbot) -> None:
    dialog = ConversationSettingsDialog("sys", "precise", {"top_k": 40})
    qtbot.addWidget(dialog)
    assert dialog.fields["temperature"].value() == effective_sampling("precise")["temperature"]
    assert dialog.fields["top_k"].value() == 40
    dialog.fields["max_new_tokens"].setValue(64)
    prompt, preset, overrides = dialog.result_values()
    assert (prompt, preset, overrides) == ("sys", "precise", {"top_k": 40, "max_new_tokens": 64})
    dialog.preset.setCurrentIndex(dialog.preset.findData("creative"))  # a new preset starts clean
    assert dialog.result_values()[2] == {}


def test_the_sampling_editors_follow_the_engines_descriptions(qtbot) -> None:
    # Defaults, ranges, steps and labels come from engine.generation.sampling_settings: the app
    # restates none of them, and every preset is a value the engine accepts.
    from engine.generation.sampling import SamplingSettings
    from engine.generation.sampling_settings import SETTINGS

    dialog = ConversationSettingsDialog("", "greedy", {})
    qtbot.addWidget(dialog)
    for setting in SETTINGS:
        assert SAMPLING_DEFAULTS[setting.name] == setting.default
        if setting.editor is None:
            assert setting.name not in dialog.fields
            continue
        box = dialog.fields[setting.name]
        assert (box.minimum(), box.maximum(), box.singleStep()) == (*setting.editor, setting.step)
        assert box.accessibleName() == setting.label
    for name, values in PRESETS.items():
        sampler, _ = split_generation_limits(effective_sampling(name))
        SamplingSettings(**sampler).validate()
        for key, value in values.items():
            low, high = BY_NAME[key].editor
            assert low <= value <= high, (name, key)


def test_the_presets_import_no_torch() -> None:
    code = "import sys, app.chat.presets; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_effective_sampling_layers_defaults_preset_overrides() -> None:
    values = effective_sampling("creative", {"temperature": 0.5, "bogus": 1})
    assert values["temperature"] == 0.5 and values["presence_penalty"] == 0.3 and "bogus" not in values
    sampler, max_new = split_generation_limits(values)
    assert "max_new_tokens" not in sampler and max_new == 1024


def test_command_line_help() -> None:
    out = subprocess.run([sys.executable, "-m", "app", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--data-dir" in out.stdout
