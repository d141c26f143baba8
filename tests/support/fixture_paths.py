"""Where the test data that does not ship with the repository lives.

One function per data set, shared by the pytest fixtures (``tests/conftest.py``) and the scripts
beside the tests (``tests/gui/screenshots.py``), so that no test hard-codes ``../shared/...``: a
clone that does not sit beside ``shared/`` skips those tests instead of failing them.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def exl3_fixture_dir() -> Path | None:
    """The EXL3 reference fixtures: ``$TRELLIS_SHARED/fixtures/exl3`` when that variable is set,
    else ``shared/fixtures/exl3`` beside the repository; None where neither holds them."""
    candidates = [REPO.parent / "shared"]
    if os.environ.get("TRELLIS_SHARED"):
        candidates.insert(0, Path(os.environ["TRELLIS_SHARED"]))
    for shared in candidates:
        d = shared / "fixtures" / "exl3"
        if (d / "reference" / "codebook_tables.safetensors").is_file():
            return d.resolve()
    return None
