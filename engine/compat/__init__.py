"""Compatibility shims for third-party libraries, kept apart so each can be deleted on its own.

Each module here names the library and release it works around, why, and how to tell when the
shim is no longer needed. Nothing outside ``engine`` should import from this package.
"""
