"""Trellis engine: loads Hugging Face model directories and generates text.

The engine never imports Qt. Everything the GUI can do with a model is available here,
from Python and from the command line (``python -m engine``).
"""

__version__ = "0.1.0"
