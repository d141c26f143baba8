"""The user's Hugging Face token: where it is found, where it is kept, and how it is never shown.

Lookup order (``resolve_token``):

1. an explicit token passed by the caller;
2. the ``HF_TOKEN`` environment variable (what a CLI user expects to win);
3. the system keyring (service ``trellis-chat``), where the app stores the token the user typed;
4. whatever ``huggingface_hub.get_token()`` finds (its token file from ``hf auth login``).

The value travels inside :class:`Secret`, whose ``repr``/``str`` are masked, so a token that ends up
in a log line, an exception message or a debugger shows as ``Secret('hf_***')``. Only the HTTP layer
calls :meth:`Secret.reveal`.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

KEYRING_SERVICE = "trellis-chat"
KEYRING_USERNAME = "huggingface-token"


class Secret:
    """A string that does not print itself."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """The token itself: only for building an Authorization header."""
        return self._value

    def __repr__(self) -> str:
        prefix = self._value[:3] if self._value.startswith("hf_") else ""
        return f"Secret('{prefix}***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __bool__(self) -> bool:
        return bool(self._value)


def _keyring():
    """The keyring module when a usable backend exists, else None (headless Linux often has none)."""
    try:
        import keyring
        from keyring.backends import fail, null
    except Exception:  # not installed or broken install: no keyring
        return None
    try:
        backend = keyring.get_keyring()
    except Exception:
        return None
    if isinstance(backend, (fail.Keyring, null.Keyring)):
        return None
    return keyring


def keyring_available() -> bool:
    """True when the token can be kept in a system keyring on this machine."""
    return _keyring() is not None


def load_keyring_token() -> Secret | None:
    kr = _keyring()
    if kr is None:
        return None
    try:
        value = kr.get_password(KEYRING_SERVICE, KEYRING_USERNAME)
    except Exception as exc:  # a locked or broken keyring must not break downloads of public models
        log.warning("could not read the keyring: %s", type(exc).__name__)
        return None
    return Secret(value) if value else None


def save_token(token: str) -> bool:
    """Store the token in the system keyring. Returns False when no keyring exists here."""
    kr = _keyring()
    if kr is None:
        return False
    kr.set_password(KEYRING_SERVICE, KEYRING_USERNAME, token)
    return True


def delete_token() -> None:
    kr = _keyring()
    if kr is None:
        return
    try:
        kr.delete_password(KEYRING_SERVICE, KEYRING_USERNAME)
    except Exception:  # nothing stored: nothing to delete
        pass


def resolve_token(explicit: str | Secret | None = None) -> Secret | None:
    """The token to use for Hub requests, or None (anonymous). See the module docstring."""
    if explicit:
        return explicit if isinstance(explicit, Secret) else Secret(explicit)
    env = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if env:
        return Secret(env.strip())
    stored = load_keyring_token()
    if stored:
        return stored
    try:
        from huggingface_hub import get_token

        value = get_token()
    except Exception:
        value = None
    return Secret(value) if value else None
