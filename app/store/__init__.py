"""Persistence: one SQLite file in the platform data directory (see ``app.paths``).

``Store`` is the only way the app reads or writes it; ``export`` turns conversations into files
and back.
"""

from app.store.store import Conversation, ImageBlob, Message, SearchHit, Store, StoredImage

__all__ = ["Conversation", "ImageBlob", "Message", "SearchHit", "Store", "StoredImage"]
