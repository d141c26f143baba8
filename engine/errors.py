"""Errors the engine raises for bad input. Each message names the problem and the file."""


class EngineError(Exception):
    """Base class of every error the engine reports to a user."""


class ModelLoadError(EngineError):
    """A model directory cannot be loaded (missing file, corrupt file, unknown architecture...)."""


class TokenizerError(ModelLoadError):
    """The model's tokenizer files are missing or unreadable."""


class UnsupportedArchitectureError(ModelLoadError):
    """config.json names an architecture the engine has no mapping for."""


class ContextOverflowError(EngineError):
    """A prompt (plus the tokens to generate) does not fit in the cache or the model's context."""


class GGUFImportError(EngineError):
    """A GGUF file is truncated, corrupt or uses something the importer cannot convert."""
