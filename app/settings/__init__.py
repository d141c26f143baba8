"""Preferences: declared in ``schema``, stored through ``settings``, edited in ``dialog``."""
