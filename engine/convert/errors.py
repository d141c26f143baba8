"""The converter's one error: what the CLI and the GUI report as "this model cannot be converted"."""

from engine.errors import EngineError


class ConvertError(EngineError):
    """The conversion cannot proceed (unsupported model, mismatched resume, bad options)."""
