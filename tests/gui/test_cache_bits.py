"""The KV-cache bit widths in the model bar: the memory estimate follows them, they persist, and
a load passes them to the engine."""

from __future__ import annotations

from fake_engine import make_model_dir
from gui_helpers import load_model
from PySide6.QtCore import Qt

from app.library.model import COLUMNS


def choose(combo, bits: int) -> None:
    """Pick ``bits`` as a user does (``activated`` is only emitted by user interaction)."""
    index = combo.findData(bits)
    combo.setCurrentIndex(index)
    combo.activated.emit(index)


def test_cache_bits_change_the_estimate_persist_and_reach_the_load(qtbot, make_window, fake_engine) -> None:
    window = make_window()
    bar = window.model_bar
    assert bar.cache_bits() == (16, 16)  # the default: unquantized
    assert [bar.key_bits.itemData(i) for i in range(bar.key_bits.count())] == [16, 8, 6, 5, 4, 3, 2]
    # A bigger model than the fake's default, so the cache is a visible part of the estimate.
    path = make_model_dir(window.models_dir / "roomy")
    window.settings.set("library.estimate_context", 65536)
    window.library.refresh()
    bar.select_path(str(path))
    row = window.library_model.row_of(str(path))
    memory = window.library_model.index(row, COLUMNS.index("Memory"))

    def needed() -> int:
        return window.library_model.verdict(row).needed_bytes

    full, full_text, full_column = needed(), bar.estimate.text(), memory.data()
    assert full_text.startswith("≈ ") and "16/16 bits" in bar.estimate.toolTip()

    choose(bar.key_bits, 4)
    four_sixteen = needed()
    assert four_sixteen < full and bar.estimate.text() != full_text and memory.data() != full_column
    assert "4/16 bits" in bar.estimate.toolTip()
    choose(bar.value_bits, 2)
    assert needed() < four_sixteen
    # Exactly the engine's layout: head_dim 16 -> 4-bit keys take 8 bytes of codes + one 2-byte scale.
    info = window.library_model.infos()[row]
    assert info.kv_cache_bytes(65536, 4, (4, 2)) == 2 * 65536 * 2 * ((8 + 2) + (4 + 2))
    assert window.store.get_setting("engine.cache_bits_k") == 4
    assert window.store.get_setting("engine.cache_bits_v") == 2

    with qtbot.waitSignal(window.engine.loaded, timeout=5000):
        qtbot.mouseClick(bar.load_button, Qt.MouseButton.LeftButton)
    assert fake_engine.load_options[-1]["cache_bits"] == (4, 2)
    assert "KV cache 4/2 bit" in bar.status.text()
    window.close()

    # A restart shows (and uses) the same widths.
    again = make_window()
    assert again.model_bar.cache_bits() == (4, 2)
    load_model(qtbot, again)
    assert fake_engine.load_options[-1]["cache_bits"] == (4, 2)
