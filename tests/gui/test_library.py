"""The model library in the window: folders, what each model is, and why a bad one cannot load."""

from __future__ import annotations

from fake_engine import make_model_dir
from PySide6.QtCore import Qt

from app.library.scanner import model_dirs, scan


def test_scanner_finds_models_and_broken_models(tmp_path) -> None:
    make_model_dir(tmp_path / "lib" / "good")
    (tmp_path / "lib" / "broken").mkdir()
    (tmp_path / "lib" / "broken" / "model.safetensors").write_bytes(b"\x01")
    (tmp_path / "lib" / "notes").mkdir()  # not a model: ignored
    assert [p.name for p in model_dirs(tmp_path / "lib")] == ["broken", "good"]
    assert model_dirs(tmp_path / "lib" / "good") == [tmp_path / "lib" / "good"]  # a model folder itself
    infos = {i.name: i for i in scan([tmp_path / "lib", tmp_path / "lib" / "good"])}  # no duplicates
    assert set(infos) == {"good", "broken"}
    assert infos["good"].ok and not infos["broken"].ok


def test_scanner_hides_downloads_in_progress(tmp_path) -> None:
    import json

    from engine.hub.library import COMPLETE_MARKER, PARTIAL_DIR

    downloading = make_model_dir(tmp_path / "downloading")
    (downloading / PARTIAL_DIR).mkdir()
    finished = make_model_dir(tmp_path / "finished")
    (finished / PARTIAL_DIR).mkdir()  # leftovers, but the download was verified complete
    (finished / COMPLETE_MARKER).write_text(json.dumps({"complete": True}))
    assert model_dirs(tmp_path) == [finished]
    assert model_dirs(downloading) == []


def test_library_lists_app_models_with_their_facts(qtbot, window) -> None:
    make_model_dir(window.models_dir / "llama-tiny")
    qtbot.mouseClick(window.library_pane.refresh_button, Qt.MouseButton.LeftButton)
    model = window.library_model
    assert model.rowCount() == 1
    row = {
        model.headerData(c, Qt.Orientation.Horizontal): model.index(0, c).data()
        for c in range(model.columnCount())
    }
    assert row["Name"] == "llama-tiny" and row["Architecture"] == "LlamaForCausalLM"
    assert row["Parameters"] == "64" and row["Quantization"] == "F16" and row["Status"] == "ready"
    assert row["Memory"].endswith(("(fits)", "(tight)", "(too big)"))
    window.library_pane.select_path(str(window.models_dir / "llama-tiny"))
    details = window.library_pane.details.toPlainText()
    assert "LlamaForCausalLM" in details and "Memory at 2048 tokens (CPU)" in details  # loads at its own 2048
    assert window.library_pane.load_button.isEnabled()
    with qtbot.waitSignal(window.engine.loaded, timeout=5000):
        qtbot.mouseClick(window.library_pane.load_button, Qt.MouseButton.LeftButton)
    assert window.model_bar.unload_button.isEnabled()
    with qtbot.waitSignal(window.engine.unloaded, timeout=5000):
        qtbot.mouseClick(window.model_bar.unload_button, Qt.MouseButton.LeftButton)
    assert window.model_bar.status.text() == "No model loaded"


def test_opening_a_bad_model_folder_says_why(qtbot, window, tmp_path) -> None:
    bad = make_model_dir(tmp_path / "mamba", architecture="MambaForCausalLM")
    (bad / "tokenizer.json").unlink()
    window.add_model_folder(str(bad))
    assert window.nav.current() == "models" and window.pages.currentWidget().isAncestorOf(window.library_pane)
    assert str(bad) in [
        window.library_pane.folders.item(i).text() for i in range(window.library_pane.folders.count())
    ]
    details = window.library_pane.details.toPlainText()
    assert "This model cannot be loaded" in details
    assert "architecture MambaForCausalLM is not supported" in details
    assert "tokenizer.json is missing" in details
    assert not window.library_pane.load_button.isEnabled()
    assert "cannot be loaded" in window.statusBar().currentMessage()
    # Asking to load it anyway (e.g. from the model bar) refuses with the reason, nothing crashes.
    window.request_load(str(bad))
    assert "MambaForCausalLM" in window.chat_pane.error_label.text()
    assert not window.engine.loading


def test_user_folders_persist_and_can_be_removed(qtbot, make_window, tmp_path) -> None:
    make_model_dir(tmp_path / "extra" / "m1")
    window = make_window()
    window.add_model_folder(str(tmp_path / "extra"))
    assert window.library_model.rowCount() == 1
    window.close()
    window = make_window()
    assert window.library_model.rowCount() == 1
    window.library_pane.folders.setCurrentRow(1)
    qtbot.mouseClick(window.library_pane.remove_button, Qt.MouseButton.LeftButton)
    assert window.library_model.rowCount() == 0
    assert window.library_pane.folders.count() == 1  # the app's own folder stays


def test_load_failure_is_shown_and_the_app_survives(qtbot, window, fake_engine) -> None:
    from engine.errors import ModelLoadError

    fake_engine.load_error = ModelLoadError("model.safetensors: tensor model.norm.weight is truncated")
    path = make_model_dir(window.models_dir / "looks-fine")
    window.library.refresh()
    with qtbot.waitSignal(window.engine.loadFailed, timeout=5000):
        window.request_load(str(path))
    assert window.model_bar.status.text() == "Load failed"
    assert "truncated" in window.chat_pane.error_label.text()
    fake_engine.load_error = None
    with qtbot.waitSignal(window.engine.loaded, timeout=5000):
        window.request_load(str(path))
