"""The app's one view of a session is engine.api.SessionProtocol: the real ChatSession and the GUI
tests' FakeSession must both satisfy it, member by member, so a test that passes with the fake
exercises the same calls the real engine answers."""

from __future__ import annotations

import inspect

from fake_engine import FakeEngine, FakeSession

from engine.api import SessionProtocol

MEMBERS = sorted(name for name in vars(SessionProtocol) if not name.startswith("_"))


def shape(function) -> list[tuple[str, inspect._ParameterKind, object]]:
    """A callable's parameters by name, kind and default: what callers depend on (annotations are
    for readers and type checkers, and may be spelt differently)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def check(kind: type, instance: object | None = None) -> None:
    for name in MEMBERS:
        declared = inspect.getattr_static(SessionProtocol, name)
        if isinstance(declared, property):
            # A property or a plain attribute will do; a method will not.
            found = inspect.getattr_static(kind, name, None)
            if found is None:
                assert instance is not None and name in vars(instance), f"{kind.__name__} lacks {name}"
                found = getattr(instance, name)
            assert not callable(found) or isinstance(found, property), f"{kind.__name__}.{name} is a method"
        else:
            found = inspect.getattr_static(kind, name, None)
            assert callable(found), f"{kind.__name__} lacks the method {name}"
            assert shape(found) == shape(declared), f"{kind.__name__}.{name}{inspect.signature(found)}"
    # The worker closes a stream it stops reading, which a generator allows.
    assert inspect.isgeneratorfunction(kind.stream), f"{kind.__name__}.stream is not a generator function"


def test_the_protocol_names_what_the_worker_uses() -> None:
    assert MEMBERS == [
        "context_length",
        "count_tokens",
        "device",
        "has_chat_template",
        "memory_bytes",
        "model_name",
        "sees_images",
        "stream",
        "unload",
        "warm_up",
    ]


def test_the_fake_session_conforms() -> None:
    session = FakeEngine().factory("/models/tiny", "cpu", lambda _f, _m: None)
    assert isinstance(session, FakeSession) and isinstance(session, SessionProtocol)
    check(FakeSession, session)


def test_the_real_session_conforms() -> None:
    from engine.session import ChatSession

    check(ChatSession)
