import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_processors import hf_processor, write_processor_files  # noqa: E402
from tiny_vlms import build_tiny_vlm  # noqa: E402


@pytest.fixture(scope="session")
def tiny_vlm_factory(tmp_path_factory):
    """``factory(arch) -> (directory, transformers model, transformers processor)``, built once."""
    built = {}

    def factory(arch: str):
        if arch not in built:
            directory = tmp_path_factory.mktemp(arch)
            model = build_tiny_vlm(arch, directory)
            write_processor_files(arch, model.config, directory)
            built[arch] = (directory, model, hf_processor(arch, model.config, directory))
        return built[arch]

    return factory
