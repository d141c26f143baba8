"""The Hub browser pane against the fake Hub: search, open a model page, pick a branch, download."""

from __future__ import annotations

import json

import pytest
from fake_hub import FakeHub, PatternBlob, tiny_llama_config

from app.downloads.qt_manager import QtDownloadManager
from app.hub import create_hub_pane
from engine.hub import DownloadManager, HubClient, installed_models
from engine.hub.retry import RetryPolicy

FAST = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.02, jitter=0.0)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHON_KEYRING_BACKEND", "keyring.backends.null.Keyring")
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
        cfg = json.dumps(tiny_llama_config())
        fake.add_repo(
            "turbo/llama-8B-exl3",
            {
                "config.json": cfg,
                "README.md": "---\nlicense: llama3.1\n---\n# Llama EXL3\n\nPick a **branch**.",
            },
            branches={
                "2.0bpw": {"config.json": cfg, "model.safetensors": PatternBlob(200_000, seed=1)},
                "4.0bpw": {"config.json": cfg, "model.safetensors": PatternBlob(400_000, seed=2)},
            },
            tags=["exl3"],
            downloads=100,
            card_data={"license": "llama3.1"},
            params=8_000_000_000,
        )
        fake.add_repo(
            "meta/llama-8B", {"config.json": cfg, "model.safetensors": PatternBlob(1000, 3)}, downloads=999
        )
        fake.add_repo("odd/mamba", {"config.json": json.dumps({"architectures": ["MambaForCausalLM"]})})
        yield fake


@pytest.fixture
def manager(tmp_path, hub):
    m = DownloadManager(tmp_path / "models", client=HubClient(retry=FAST), retry=FAST)
    yield m
    m.shutdown()


def test_search_open_pick_branch_and_download(qtbot, hub, manager, tmp_path):
    pane = create_hub_pane(manager)
    qtbot.addWidget(pane)

    pane.search_edit.setText("llama")
    pane.search_button.click()
    qtbot.waitUntil(lambda: pane.results.rowCount() == 2, timeout=10_000)
    assert pane.results.index(0, 0).data() == "meta/llama-8B"  # most downloads first
    pane.supported_check.setChecked(False)
    pane.search_edit.setText("")
    pane.run_search()
    qtbot.waitUntil(lambda: pane.results.rowCount() == 3, timeout=10_000)
    pane.exl3_check.setChecked(True)
    qtbot.waitUntil(lambda: pane.results.rowCount() == 1, timeout=10_000)
    assert "EXL3" in pane.results.index(0, 5).data()

    pane.results_view.selectRow(0)
    qtbot.waitUntil(lambda: pane.page is not None, timeout=10_000)
    assert pane.page.details.repo_id == "turbo/llama-8B-exl3"
    assert "Licence: llama3.1" in pane.facts.text() and "Parameters: 8B" in pane.facts.text()
    assert "Llama EXL3" in pane.card.toPlainText() and "license" not in pane.card.toPlainText()
    assert [pane.branch_combo.itemText(i) for i in range(pane.branch_combo.count())] == [
        "main",
        "2.0bpw",
        "4.0bpw",
    ]
    assert "needs about" in pane.memory_label.text()
    before = pane.memory_label.text()
    pane.context_spin.setValue(1024)
    assert pane.memory_label.text() != before  # the KV cache part follows the context length

    pane.branch_combo.setCurrentIndex(2)
    pane.branch_combo.activated.emit(2)
    qtbot.waitUntil(lambda: pane.page.details.revision == "4.0bpw", timeout=10_000)
    assert [pane.files.index(r, 0).data() for r in range(pane.files.rowCount())] == [
        "config.json",
        "model.safetensors",
    ]
    assert pane.branch_combo.count() == 3 and pane.branch_combo.currentText() == "4.0bpw"

    qt_manager = QtDownloadManager.wrap(manager)
    with qtbot.waitSignal(qt_manager.modelInstalled, timeout=20_000) as installed:
        pane.download_button.click()
    assert installed.args[0].endswith("turbo__llama-8B-exl3@4.0bpw")
    assert [(m.repo_id, m.revision) for m in installed_models(tmp_path / "models")] == [
        ("turbo/llama-8B-exl3", "4.0bpw")
    ]


def test_errors_are_shown_not_raised(qtbot, hub, manager):
    pane = create_hub_pane(manager)
    qtbot.addWidget(pane)
    pane.open_model("nobody/nothing")
    qtbot.waitUntil(lambda: pane.status.text().startswith("Error"), timeout=10_000)
    assert "nobody/nothing not found" in pane.status.toolTip()
    assert not pane.download_button.isEnabled()
