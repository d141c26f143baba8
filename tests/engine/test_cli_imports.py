"""The inference commands start where only the inference dependencies exist (e.g. a GPU host).

The Hub stack (huggingface_hub 2.x, httpx2), platformdirs and gguf are imported by the commands
that use them, when they run: a machine without them can still `python -m engine generate`.
"""

from __future__ import annotations

import subprocess
import sys

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('httpx2', 'huggingface_hub', 'platformdirs', 'gguf'):
            raise ImportError('not installed here: ' + name)
sys.meta_path.insert(0, Block())
from engine.cli import build_parser
args = build_parser().parse_args(['generate', '-m', 'x', '--prompt', 'hi'])
print(args.command)
"""


def test_cli_starts_without_hub_gguf_or_platformdirs() -> None:
    done = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "generate"


def test_blocker_really_blocks() -> None:
    # The check above means something only if the blocked imports do fail under the blocker.
    code = BLOCKER.split("from engine.cli")[0] + "import httpx2\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "not installed here: httpx2" in done.stderr
