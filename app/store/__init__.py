"""Persistence: one SQLite file in the platform data directory (see ``app.paths``).

``Store`` is the only way the app reads or writes it; ``export`` turns conversations into files
and back.
"""

from app.store.store import Conversation, Message, SearchHit, Store

__all__ = ["Conversation", "Message", "SearchHit", "Store"]
