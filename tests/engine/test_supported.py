import subprocess
import sys

from engine.supported import SUPPORTED_ARCHITECTURES, registry_architectures


def test_torch_free_list_matches_registry():
    assert SUPPORTED_ARCHITECTURES == registry_architectures()


def test_supported_list_and_inspector_do_not_import_torch():
    code = "import sys, engine.supported, engine.inspect, engine.hub; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
