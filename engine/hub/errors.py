"""User-facing errors of the Hub code. Each names the repository and says what to do next."""

from __future__ import annotations

from engine.errors import EngineError
from engine.safe_paths import UnsafePathError


class HubError(EngineError):
    """Base class: something about the Hub, a repository or a download went wrong."""


class RepoNotFoundError(HubError):
    """The repository does not exist, or is private and the token does not grant access."""


class RevisionNotFoundError(HubError):
    """The branch, tag or commit does not exist in the repository."""


class GatedRepoError(HubError):
    """The repository is gated: the user must accept its terms and use a token with access."""


class HubConnectionError(HubError):
    """The Hub (or the mirror in ``HF_ENDPOINT``) could not be reached after retries."""


class HubOfflineError(HubConnectionError):
    """Not even a connection to the Hub (or its proxy) opens: no network, or the host is down.
    Said within seconds (``engine.hub.reachability``) instead of after minutes of retries."""


class InsufficientSpaceError(HubError):
    """The destination volume has less free space than the download still needs."""

    def __init__(self, message: str, required: int, free: int) -> None:
        super().__init__(message)
        self.required = required
        self.free = free


class DiskFullError(HubError):
    """Writing failed because the disk filled up during the download. Partial data is kept."""


class VerificationError(HubError):
    """A downloaded file does not match the hash the Hub lists for it."""


class UnsafeRepoPathError(HubError, UnsafePathError):
    """A repository lists a file name that would be written outside its model folder (``../x``,
    an absolute path, a drive letter...) or over the download's own bookkeeping. The whole download
    is refused before anything is written; ``name`` is the offending file name."""


class DownloadError(HubError):
    """A download failed for a reason not covered by a more specific class."""
