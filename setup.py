"""Everything about the package is in pyproject.toml; this file adds one rule setuptools cannot
read from there: a wheel that carries the prebuilt CUDA extension
(``engine/kernels/prebuilt/trellis_ext-*.so``, written by ``packaging/build_prebuilt_ext.py
--into-package``) holds machine code for one Python, ABI and platform, so it must be tagged
with them (``cp312-cp312-linux_x86_64``), not as pure Python (``py3-none-any``), or pip would
install it on any machine. Without the module the wheel stays pure."""

from pathlib import Path

from setuptools import setup
from setuptools.dist import Distribution

PREBUILT = Path(__file__).resolve().parent / "engine" / "kernels" / "prebuilt"


class PlatformWhenPrebuilt(Distribution):
    """setuptools tags a wheel for the building Python and platform when this says the package
    has compiled modules."""

    def has_ext_modules(self) -> bool:
        return any(PREBUILT.glob("trellis_ext-*.so"))


setup(distclass=PlatformWhenPrebuilt)
