"""API keys of remote endpoints, in the system keyring (Secret Service, Keychain, Credential
Manager), under the endpoint's base URL. Never written to the database, the settings or a log.

Where no keyring is available every call says so (``KeyringUnavailable``) rather than failing
silently; reading returns None then, so an endpoint without a key still works.
"""

from __future__ import annotations

import logging

import keyring
from keyring.errors import KeyringError, NoKeyringError, PasswordDeleteError

log = logging.getLogger(__name__)

SERVICE = "trellis-chat"


class KeyringUnavailable(RuntimeError):
    """The system has no keyring this process can use."""


def _service_for(base_url: str) -> tuple[str, str]:
    return SERVICE, f"remote-engine:{base_url}"


def get_key(base_url: str) -> str | None:
    try:
        return keyring.get_password(*_service_for(base_url))
    except (NoKeyringError, KeyringError) as exc:
        log.info("no keyring to read the API key from: %s", type(exc).__name__)
        return None


def set_key(base_url: str, key: str) -> None:
    """Store ``key`` (an empty key deletes it)."""
    if not key:
        delete_key(base_url)
        return
    try:
        keyring.set_password(*_service_for(base_url), key)
    except NoKeyringError as exc:
        raise KeyringUnavailable(
            "no system keyring is available, so the API key cannot be saved (install and unlock "
            "one, e.g. GNOME Keyring or KWallet)"
        ) from exc
    except KeyringError as exc:
        raise KeyringUnavailable(f"the system keyring refused the API key: {type(exc).__name__}") from exc


def delete_key(base_url: str) -> None:
    try:
        keyring.delete_password(*_service_for(base_url))
    except (PasswordDeleteError, NoKeyringError):
        pass  # nothing stored (or nowhere to store it): nothing to delete
    except KeyringError as exc:
        log.info("could not delete an API key: %s", type(exc).__name__)
