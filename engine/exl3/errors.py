"""Errors raised while reading EXL3 models. All are ModelLoadErrors, so the CLI and the GUI
report them as "this model cannot be loaded" with the message naming what is wrong."""

from engine.errors import ModelLoadError


class QuantFormatError(ModelLoadError):
    """A quantized model is malformed or uses something this engine does not support."""


class UnsupportedQuantFormatError(QuantFormatError):
    """Unknown quantization method, or an EXL3 version newer than this engine understands."""


class MissingTensorError(QuantFormatError):
    """A tensor that a quantized layer needs is absent from the checkpoint."""


class TensorShapeError(QuantFormatError):
    """A stored tensor's shape or dtype does not fit the layer it belongs to."""
