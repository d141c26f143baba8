"""Every app setting, declared as data: key, default, what the user sees, allowed values.

The settings dialog is generated from this list and the store validates against it, so adding a
setting is one entry here. ``hidden`` settings are state the app remembers (folders, last model)
rather than preferences a user edits in the dialog.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.chat.presets import PRESET_LABELS
from app.library.context_memory import DEFAULT as DEFAULT_CONTEXT_MEMORY
from app.library.load_context import DEFAULT_CONTEXT
from engine.inspect import CACHE_BITS_CHOICES

# Key and value widths of the KV cache ("context memory", app.library.context_memory): 8-bit by
# default, half the memory of 16-bit at no loss a chat would notice. Chosen with the context
# length in the library's load options, next to the memory estimate they change, so both are
# hidden from the settings dialog. Every width the engine has stays valid (older settings).
_CACHE_BITS = tuple((bits, f"{bits}-bit") for bits in CACHE_BITS_CHOICES)


@dataclass(frozen=True)
class Setting:
    key: str
    default: Any
    label: str
    description: str = ""
    choices: tuple[tuple[Any, str], ...] | None = None  # (value, label)
    minimum: int | None = None
    maximum: int | None = None
    hidden: bool = False

    def validate(self, value: Any) -> Any:
        """The value coerced to the setting's type, or the default if it cannot be."""
        try:
            if self.choices is not None:
                return value if value in {v for v, _ in self.choices} else self.default
            if isinstance(self.default, bool):
                return bool(value)
            if isinstance(self.default, int):
                v = int(value)
                if self.minimum is not None:
                    v = max(self.minimum, v)
                if self.maximum is not None:
                    v = min(self.maximum, v)
                return v
            if isinstance(self.default, list):
                return [str(x) for x in value] if isinstance(value, list) else self.default
            if isinstance(self.default, str):
                return str(value)
        except (TypeError, ValueError):
            return self.default
        return value


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "appearance.theme",
        "system",
        "Theme",
        "Follow the system's light/dark setting, or force one.",
        choices=(("system", "Follow system"), ("light", "Light"), ("dark", "Dark")),
    ),
    Setting(
        "appearance.font_size", 11, "Chat font size", "Point size of message text.", minimum=7, maximum=32
    ),
    Setting(
        "engine.device",
        "auto",
        "Device",
        "Where models run: a CUDA GPU when present (auto), or always the CPU.",
        choices=(("auto", "Automatic"), ("cpu", "CPU"), ("cuda", "CUDA GPU")),
    ),
    Setting(
        "chat.default_preset",
        "balanced",
        "Sampling preset for new chats",
        choices=tuple(PRESET_LABELS.items()),
    ),
    Setting(
        "chat.default_system_prompt",
        "You are a helpful assistant.",
        "System prompt for new chats",
    ),
    Setting(
        "engine.context_length",
        DEFAULT_CONTEXT,
        "Context length",
        "Tokens of context a model is loaded with (at most the model's own); the library's "
        "memory estimate is for the same.",
        minimum=256,
        maximum=1_048_576,
        hidden=True,
    ),
    Setting(
        "engine.cache_bits_k",
        DEFAULT_CONTEXT_MEMORY.key_bits,
        "Context memory: key bits",
        "Bits per cached key number (16: full precision).",
        _CACHE_BITS,
        hidden=True,
    ),
    Setting(
        "engine.cache_bits_v",
        DEFAULT_CONTEXT_MEMORY.value_bits,
        "Context memory: value bits",
        "Bits per cached value number (16: full precision).",
        _CACHE_BITS,
        hidden=True,
    ),
    Setting("library.autoload", True, "Load the last used model at startup"),
    Setting("library.folders", [], "Extra model folders", hidden=True),
    Setting("library.last_model", "", "Last loaded model", hidden=True),
    Setting("library.starter_dismissed", False, "Starter model offer dismissed", hidden=True),
    # The offer to download the GPU runtime (app.runtime) when an NVIDIA GPU sits unused.
    Setting("runtime.offer_dismissed", False, "GPU runtime offer dismissed", hidden=True),
    Setting("export.last_folder", "", "Folder of the last export or import", hidden=True),
    # Remote engines (app.remote): base URLs; their API keys are in the system keyring.
    Setting("remote.endpoints", [], "Remote engines", hidden=True),
    # MCP servers (app.tools): one JSON object each, {"name", "command"} or {"name", "url"}.
    Setting("tools.mcp_servers", [], "MCP servers", hidden=True),
    Setting("tools.always_allowed", [], "Tools run without asking", hidden=True),
    Setting(
        "tools.max_rounds",
        8,
        "Tool rounds per reply",
        "How many times in a row the model may call tools before its reply is ended.",
        minimum=1,
        maximum=64,
    ),
    Setting(
        "serve.port",
        8000,
        "Local server port",
        "Port of Serve › Serve the loaded model (the server listens on 127.0.0.1 only).",
        minimum=1,
        maximum=65535,
    ),
)

BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}
