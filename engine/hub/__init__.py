"""Hugging Face Hub access for the engine: search, model pages, branches, memory estimates and the
download manager. No Qt here; the GUI wraps it (``app.downloads.qt_manager``, ``app.hub``).

Entry points:

* ``HubClient`` (``engine.hub.client``): ``search(SearchQuery)``, ``model_details(repo, revision)``,
  ``branches(repo)``, ``model_card(repo, revision)``, ``config(repo, revision)``.
* ``DownloadManager`` (``engine.hub.downloads``): ``enqueue``, ``pause``, ``resume``, ``cancel``,
  ``remove``, ``jobs``, ``wait``, ``add_listener``, ``shutdown``. Its docstring lists what
  ``huggingface_hub`` lacks and this package adds.
* ``installed_models`` / ``is_complete`` (``engine.hub.library``): complete model directories only.
* ``estimate_memory`` / ``machine_memory`` (``engine.hub.memory``).
* Which architectures the engine runs: ``engine.supported`` (one list for the Hub and the library).
* A local Hub-compatible HTTP server for tests and measurements: ``tests/support/fake_hub.py``.
"""

from engine.hub.client import Branch, HubClient, ModelDetails, ModelSummary, RepoFile, SearchQuery
from engine.hub.downloads import DownloadEvent, DownloadManager, JobSnapshot, JobState
from engine.hub.library import default_models_dir, installed_models, is_complete
from engine.hub.memory import estimate_memory, machine_memory

__all__ = [
    "Branch",
    "DownloadEvent",
    "DownloadManager",
    "HubClient",
    "JobSnapshot",
    "JobState",
    "ModelDetails",
    "ModelSummary",
    "RepoFile",
    "SearchQuery",
    "default_models_dir",
    "estimate_memory",
    "installed_models",
    "is_complete",
    "machine_memory",
]
