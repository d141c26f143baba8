"""N-gram drafting (prompt lookup): guess that the text goes on as it did the last time the
same few tokens appeared, in the prompt or in the reply so far.

Replies that quote or edit the prompt (code changes, summaries, a rewritten paragraph) repeat long
runs of it, and those runs are then guessed whole. For each sequence an index maps every n-gram
(``n`` from ``max_n`` down to ``min_n``) to the position after its latest occurrence; a lookup of
the sequence's last ``n`` tokens finds where to copy from, the longest ``n`` that matches winning.
The index grows with the sequence (each step adds the few new tokens' n-grams), so a lookup costs
O(max_n) whatever the length; a sequence that got shorter (a banned string's rewind) is indexed
again from scratch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from engine.generation.speculative.drafter import Draft, Drafter, DraftRequest


class NgramIndex:
    """Where each n-gram of one sequence last ended: ``{ngram tuple: position after it}``."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.length = 0  # positions indexed: n-grams ending before this one
        self.tokens: list[int] = []

    def update(self, tokens: Sequence[int]) -> None:
        """Index ``tokens`` (the sequence so far; it extends what was indexed before). The
        n-gram that ends at the sequence's end is left out: it is the one looked up, and its own
        position has no continuation yet."""
        if (
            len(tokens) < self.length
            or list(tokens[max(0, self.length - self.max_n) : self.length])
            != (self.tokens[max(0, self.length - self.max_n) : self.length])
        ):
            self.__init__(self.min_n, self.max_n)  # not the sequence indexed so far: start over
        self.tokens[self.length :] = tokens[self.length :]
        seq = self.tokens
        # An n-gram ending at position `end` (exclusive) is continued by seq[end]: index every end
        # up to len - 1, so that each indexed n-gram has at least one token after it.
        for end in range(max(self.length, self.min_n), len(seq)):
            for n, table in self.tables.items():
                if end >= n:
                    table[tuple(seq[end - n : end])] = end
        self.length = max(self.length, len(seq))

    def lookup(self, max_tokens: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the sequence's longest
        matching suffix (of ``max_n`` down to ``min_n`` tokens), at most ``max_tokens``."""
        seq = self.tokens
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(seq) <= n:
                continue
            start = self.tables[n].get(tuple(seq[len(seq) - n :]))
            if start is not None:
                return _continuation(seq, start, max_tokens)
        return []


def _continuation(seq: list[int], start: int, count: int) -> list[int]:
    """``count`` tokens copied from ``seq[start:]``; past the sequence's end the copy reads its own
    output, so a match close to the end (a loop) repeats with its period instead of stopping."""
    out: list[int] = []
    for pos in range(start, start + count):
        out.append(seq[pos] if pos < len(seq) else out[pos - len(seq)])
    return out


class NgramDrafter(Drafter):
    """Prompt-lookup drafts: the continuation of the last ``min_n``..``max_n`` tokens' latest
    earlier occurrence. Deterministic: each draft is a point mass."""

    kind = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[Hashable, NgramIndex] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for request in requests:
            index = self._indexes.get(request.key)
            if index is None:
                index = self._indexes[request.key] = NgramIndex(self.min_n, self.max_n)
            index.update(request.tokens)
            drafts.append(Draft(index.lookup(request.max_tokens) if request.max_tokens > 0 else []))
        return drafts

    def forget(self, key: Hashable) -> None:
        self._indexes.pop(key, None)
