"""Import formatron 0.5 under pydantic >= 2.12.

Why this exists
---------------
formatron 0.5.0 (the latest release) declares ``pydantic>=2,<3``, but two of its modules,
``formatron/schemas/json_schema.py`` and ``formatron/schemas/dict_inference.py``, do::

    from pydantic import typing
    ...
    def __init__(self, annotation: typing.Type, ...)

i.e. they use ``pydantic.typing`` - pydantic 1's helper module, kept in pydantic 2 only as a
migration stub - as if it were the standard ``typing`` module. Up to pydantic 2.11 the stub
answered those attribute look-ups; from 2.12 on it raises ``AttributeError: module
'pydantic.typing' has no attribute 'Type'``, and since ``formatron.formatter`` imports those
modules, *nothing* in formatron can be imported (upstream: Dan-wanna-M/formatron issue #35).

Pinning pydantic below 2.12 would hold the whole application back for two import lines, so we
instead import formatron with ``pydantic.typing`` pointing at the standard ``typing`` module
*for the duration of that import only*: formatron's modules bind the name ``typing`` once, at
import time, so they keep the standard module afterwards, and pydantic is restored untouched
(``pydantic.typing`` is again pydantic's own stub for everybody else). formatron's own pydantic
integration (``formatron.schemas.pydantic``) uses only public pydantic 2 API and needs nothing.

When to delete it
-----------------
When a formatron release imports ``typing`` itself: :func:`needs_shim` then returns ``False``
and ``tests/engine/test_constraints.py`` says so.
"""

from __future__ import annotations

import importlib
import sys
import threading
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

# formatron's modules that do ``from pydantic import typing``; importing ``formatron.formatter``
# pulls them in, so loading that one module under the shim is enough.
_AFFECTED = ("formatron.schemas.json_schema", "formatron.schemas.dict_inference")
_lock = threading.Lock()
_MISSING = object()


def needs_shim() -> bool:
    """Whether the installed pydantic lacks what formatron expects of ``pydantic.typing``."""
    import pydantic.typing as stub

    try:
        getattr(stub, "Type")  # noqa: B009 - the stub answers through a module __getattr__
    except AttributeError:
        return True
    return False


@contextmanager
def _pydantic_typing_is_stdlib() -> Iterator[None]:
    """``from pydantic import typing`` yields the standard module inside the block, and only there."""
    import pydantic

    saved = pydantic.__dict__.get("typing", _MISSING)
    pydantic.typing = typing  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if saved is _MISSING:
            del pydantic.typing  # type: ignore[attr-defined]
        else:
            pydantic.typing = saved  # type: ignore[attr-defined]


def import_formatron() -> ModuleType:
    """``formatron.formatter``, imported with the shim when (and only when) it is needed."""
    with _lock:
        if "formatron.formatter" in sys.modules:
            return sys.modules["formatron.formatter"]
        if not needs_shim():
            return importlib.import_module("formatron.formatter")
        with _pydantic_typing_is_stdlib():
            module = importlib.import_module("formatron.formatter")
            for name in _AFFECTED:  # they are imported by formatron.formatter; make sure anyway
                importlib.import_module(name)
        return module
