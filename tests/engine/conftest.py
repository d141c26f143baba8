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
