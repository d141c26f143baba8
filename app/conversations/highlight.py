"""Search matches, marked: in the conversation list's snippets and in the messages shown.

The store's search (SQLite FTS5) matches words by prefix, so a match here is any word that starts
with one of the query's words, case-insensitively. No Qt: the list's delegate and the message
view turn the spans into highlighting.
"""

from __future__ import annotations

import html
import re

HIGHLIGHT_BACKGROUND = ("#fde68a", "#7c5e10")  # (light theme, dark theme): marker yellow


def query_terms(query: str) -> list[str]:
    """The words of a search, as the store matches them (quotes and operators dropped)."""
    return [w for w in re.findall(r"\w+", query.lower()) if w not in ("and", "or", "not", "near")]


def match_spans(text: str, terms: list[str]) -> list[tuple[int, int]]:
    """(start, end) of every word of ``text`` that starts with one of ``terms``."""
    if not terms:
        return []
    pattern = re.compile(r"\b(?:" + "|".join(map(re.escape, terms)) + r")\w*", re.IGNORECASE)
    return [m.span() for m in pattern.finditer(text)]


def strip_snippet_marks(snippet: str, terms: list[str]) -> str:
    """The store's snippets bracket their matches ("[egg]"); drop those brackets (and only
    those: a bracket the text itself has stays)."""

    def unmark(m: re.Match[str]) -> str:
        inner = m.group(1)
        return inner if match_spans(inner, terms) else m.group(0)

    return re.sub(r"\[([^\[\]]*)\]", unmark, snippet)


def highlight_html(text: str, terms: list[str], background: str = HIGHLIGHT_BACKGROUND[0]) -> str:
    """``text`` as HTML with its matches marked (bold, on ``background``)."""
    out, last = [], 0
    for start, end in match_spans(text, terms):
        out.append(html.escape(text[last:start]))
        out.append(f'<b style="background-color:{background};">{html.escape(text[start:end])}</b>')
        last = end
    out.append(html.escape(text[last:]))
    return "".join(out)
