"""The architectures the Hub browser filters on: the engine's own list (``engine.supported``)."""

from engine.supported import SUPPORTED_ARCHITECTURES, is_supported

__all__ = ["SUPPORTED_ARCHITECTURES", "is_supported"]
