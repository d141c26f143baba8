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


class UsageError(EngineError, ValueError):
    """The caller asked for something out of range or self-contradictory (an option, a sampling
    setting, a token budget): changing the request fixes it, not the model or the machine. A
    ValueError too, so code that validates with ``except ValueError`` keeps working."""


class SamplingSettingError(UsageError):
    """One field of ``SamplingSettings`` is outside its range. ``field`` is the field's name and
    ``allowed`` its range in words, so a front end can name its own control (the CLI its option)."""

    def __init__(self, field: str, allowed: str, value: object) -> None:
        super().__init__(f"{field} must be {allowed}, got {value!r}")
        self.field, self.allowed, self.value = field, allowed, value


class InputNotFoundError(EngineError):
    """A file or folder the user named does not exist (the CLI exits with status 1 for it, where
    input it cannot use exits with 2)."""


class ModelNotFoundError(ModelLoadError, InputNotFoundError):
    """The model directory itself does not exist."""


class GGUFNotFoundError(GGUFImportError, InputNotFoundError):
    """The GGUF file to import does not exist."""
