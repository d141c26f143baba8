"""Stop strings, matched across token boundaries without ever showing a partial match.

Text that could still turn out to be the start of a stop string is held back; it is released
as soon as it cannot be, and dropped (with everything after it) when a stop string completes.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop_strings: Sequence[str]) -> None:
        self.stops = [s for s in stop_strings if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add newly decoded text; returns (text safe to show now, whether a stop string hit)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            index = min(i for i, _ in hits)
            out, self.pending = self.pending[:index], ""
            return out, True
        hold = self._held_suffix_length()
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        """At the end of generation nothing more can complete a stop string: release it all."""
        out, self.pending = self.pending, ""
        return out

    def _held_suffix_length(self) -> int:
        """Length of the longest suffix of the pending text that begins some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:n]):
                    best = n
                    break
        return best
