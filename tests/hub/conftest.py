"""Fixtures for the Hub tests: a fake Hub on 127.0.0.1 and an environment with no real credentials."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_hub import FakeHub


@pytest.fixture(autouse=True)
def hub_env(tmp_path, monkeypatch):
    """No token from this machine, no keyring, no HF cache outside tmp_path."""
    monkeypatch.setenv("PYTHON_KEYRING_BACKEND", "keyring.backends.null.Keyring")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("TRELLIS_MODELS_DIR", str(tmp_path / "models"))
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    try:
        import keyring
        from keyring.backends import null

        previous = keyring.get_keyring()
        keyring.set_keyring(null.Keyring())
        yield
        keyring.set_keyring(previous)
    except ImportError:
        yield


@pytest.fixture
def fake_hub(monkeypatch) -> Iterator[FakeHub]:
    hub = FakeHub()
    hub.start()
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    yield hub
    hub.stop()
