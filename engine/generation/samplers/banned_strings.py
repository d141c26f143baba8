"""Banned strings: text the reply must never contain, matched across token boundaries.

A string can be spelt by many token sequences ("Paris", "Par" + "is", "P" + "aris"), so banning
tokens is not enough. Instead the reply's text is watched as it is decoded: text that could still
be the start of a banned string is held back (not shown, its tokens not reported), and when a
banned string completes, generation goes back to the token where it started, bans that token at
that position and draws it again (``engine.generation.samplers.token_bans``). What the user sees
never contains a banned string, and nothing shown is ever taken back.

The guard works at token granularity: a token's text is released only when no banned string can
start inside it or after it, so a rewind only ever drops tokens that were held. It holds at most
``window`` tokens (a partial match longer than that is released): that bounds how far back a
rewind goes, which the caller relies on (pages of the prefix cache are named only behind it, and
a recurrent model's state has a checkpoint within it).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.generation.sampling_settings import BANNED_STRING_MAX_CHARS

# Tokens a partial match may span: a banned string of c characters starts at most c + a few
# tokens back (tokens of no text, e.g. a byte of a longer character, hold no character).
WINDOW = BANNED_STRING_MAX_CHARS + 8


class _Unit:
    """Consecutive reply tokens that together decoded to ``text`` (tokens of no text, such as a
    byte of a longer character, join the token that completes it), from reply index ``first``."""

    __slots__ = ("first", "ids", "text")

    def __init__(self, first: int) -> None:
        self.first, self.ids, self.text = first, [], ""


class BannedStringGuard:
    """Holds back the reply's text while it may be the start of one of ``banned``."""

    def __init__(self, banned: Sequence[str], window: int = WINDOW) -> None:
        self.banned = [s for s in banned if s]
        self.window = window
        self.count = 0  # reply tokens fed so far
        self._held: list[_Unit] = []  # complete units, oldest first
        self._open: _Unit | None = None  # tokens that gave no text yet

    @property
    def held_tokens(self) -> int:
        return sum(len(u.ids) for u in self._held) + (len(self._open.ids) if self._open else 0)

    def feed(self, token: int, piece: str) -> tuple[str, list[int], int | None]:
        """Add the reply's next ``token`` and the text it decoded to. Returns the text and token
        ids now safe to show, and None; or, when a banned string completed, ``("", [], k)``: keep
        the first ``k`` reply tokens and draw token ``k`` again (the held tokens from ``k`` on are
        dropped here)."""
        if self._open is None:
            self._open = _Unit(self.count)
        self.count += 1
        self._open.ids.append(token)
        if not piece:
            return self._release(self._safe_length())  # the window may still force a release
        self._open.text = piece
        self._held.append(self._open)
        self._open = None
        text = "".join(u.text for u in self._held)
        hits = [text.find(s) for s in self.banned if s in text]
        if hits:
            return "", [], self._rewind_to(min(hits))
        return self._release(self._safe_length(text))

    def finish(self) -> tuple[str, list[int]]:
        """Generation ended: release everything held."""
        units = self._held + ([self._open] if self._open else [])
        self._held, self._open = [], None
        return "".join(u.text for u in units), [t for u in units for t in u.ids]

    def _rewind_to(self, char: int) -> int:
        """The reply index of the first token of the unit whose text holds character ``char`` of
        the held text; that unit and the ones after it are dropped."""
        seen = 0
        for i, unit in enumerate(self._held):
            seen += len(unit.text)
            if seen > char:
                del self._held[i:]
                self.count = unit.first
                return unit.first
        raise AssertionError("a banned string's start lies inside the held text")

    def _safe_length(self, text: str | None = None) -> int:
        """How many leading characters of the held text can be shown: the longest run of whole
        units that does not end with the start of a banned string. (Not just "up to the longest
        suffix that starts one": a rewind may later change what follows, so text that ends with
        the start of a banned string, "...a" for "ab", must stay held whatever follows it now.)"""
        if text is None:
            text = "".join(u.text for u in self._held)
        ends = [0]
        for unit in self._held:
            ends.append(ends[-1] + len(unit.text))
        for k in reversed(ends):
            if not any(text[:k].endswith(s[:n]) for s in self.banned for n in range(1, len(s))):
                return k
        return 0

    def _release(self, safe: int) -> tuple[str, list[int], None]:
        """Release the oldest complete units whose text lies within the first ``safe`` characters,
        and any beyond the ``window`` of held tokens."""
        cut, seen, held = 0, 0, self.held_tokens
        for unit in self._held:
            inside = seen + len(unit.text) <= safe
            if not inside and held <= self.window:
                break
            seen += len(unit.text)
            held -= len(unit.ids)
            cut += 1
        out, self._held = self._held[:cut], self._held[cut:]
        return "".join(u.text for u in out), [t for u in out for t in u.ids], None
