import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``factory(variant) -> (directory, transformers_model)``, each built once per session."""
    built = {}

    def factory(variant: str):
        if variant not in built:
            directory = tmp_path_factory.mktemp(variant.replace("/", "_"))
            built[variant] = (directory, build_tiny_model(variant, directory))
        return built[variant]

    return factory


@pytest.fixture
def tiny_model_copy(tiny_model_factory, tmp_path):
    """``copy(variant, name="model") -> directory``: a writable copy of a tiny model under this
    test's tmp_path, for tests that damage or rewrite its files."""

    def copy(variant: str, name: str = "model") -> Path:
        target = tmp_path / name
        shutil.copytree(tiny_model_factory(variant)[0], target)
        return target

    return copy


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    """The tiny random Llama loaded on the CPU (one load per test module)."""
    from engine.model import load_model

    directory, _ = tiny_model_factory("LlamaForCausalLM")
    return load_model(directory, device="cpu")
