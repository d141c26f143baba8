"""Markdown -> the HTML subset that ``QTextDocument`` renders well.

No Qt here (the renderer is tested without a display). The output is tuned for Qt's rich-text
engine, not for browsers:

- Code blocks become a one-cell-wide table with a background colour and a header row holding the
  language and a ``copy:N`` link (QTextDocument ignores CSS backgrounds on ``<pre>`` but honours
  ``bgcolor`` on tables). ``RenderedMarkdown.code_blocks[N]`` is the raw text to copy.
- Syntax colours are inline ``style`` attributes from Pygments (``noclasses``), because Qt's
  rich text has no stylesheet cascade for class names.
- Math (``$..$``, ``$$..$$``, ``\\(..\\)``, ``\\[..\\]``) becomes readable Unicode
  (``app.chat.math_text``) in a serif italic span; a paragraph that is only display math is
  centred.
- Raw HTML from the model is escaped, and images are shown as links: a reply must not make the
  app load local files or remote resources.
- A line break is a line break (markdown-it's ``breaks``): models often write lists, steps or code
  without the blank lines or fences Markdown wants, and joining those lines into one paragraph
  loses their meaning. A line's leading spaces are kept too (as non-breaking spaces), so code the
  model did not fence keeps its indentation. Fenced code, lists, tables... render as Markdown.

A streaming reply is re-rendered from its full text on every update: Markdown's meaning of the
start of a message can change with what comes later (a fence that closes, a table that forms),
and the coalescing timer keeps this to at most ~30 renders a second of one message.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from functools import lru_cache

from markdown_it import MarkdownIt
from markdown_it.rules_inline import StateInline
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound

from app.chat.math_text import tex_to_unicode


@dataclass(frozen=True)
class RenderTheme:
    """Colours the renderer needs; the GUI builds one from its palette (light or dark)."""

    code_background: str = "#f3f4f6"
    code_header: str = "#e5e7eb"
    code_foreground: str = "#1f2328"
    muted: str = "#6b7280"
    link: str = "#2563eb"
    table_border: str = "#d0d7de"
    pygments_style: str = "default"
    monospace: str = "monospace"

    @staticmethod
    def dark() -> RenderTheme:
        return RenderTheme(
            code_background="#1e1f22",
            code_header="#2b2d31",
            code_foreground="#e6e6e6",
            muted="#9ca3af",
            link="#7aa2f7",
            table_border="#4b5563",
            pygments_style="monokai",
        )


@dataclass
class RenderedMarkdown:
    html: str
    code_blocks: list[str] = field(default_factory=list)


_MATH_DELIMITERS = (("$$", "$$", True), ("\\[", "\\]", True), ("\\(", "\\)", False), ("$", "$", False))


def _math_rule(state: StateInline, silent: bool) -> bool:
    src, pos = state.src, state.pos
    if src[pos] not in "$\\":
        return False
    for opening, closing, display in _MATH_DELIMITERS:
        if not src.startswith(opening, pos):
            continue
        start = pos + len(opening)
        end = src.find(closing, start)
        while end != -1 and src[end - 1] == "\\" and closing == "$":
            end = src.find(closing, end + 1)
        if end == -1 or end == start:
            return False
        content = src[start:end]
        if opening == "$":
            # Pandoc's rule, so prices ("$5 and $10") stay text: no space just inside the
            # delimiters and no digit right after the closing one.
            after = src[end + 1 : end + 2]
            if content[0].isspace() or content[-1].isspace() or after.isdigit():
                return False
        if not silent:
            token = state.push("math_display" if display else "math_inline", "", 0)
            token.content = content
            token.markup = opening
        state.pos = end + len(closing)
        return True
    return False


def _indent_of(line: str) -> int:
    return len(line.expandtabs(4)) - len(line.expandtabs(4).lstrip(" "))


def _keep_line_indentation(state) -> None:
    """Give each line break of a paragraph the indentation of the source line after it
    (``meta["indent"]``, in spaces), which Markdown would strip. Inside a list item the indent is
    counted from the item's least indented line; paragraphs in block quotes are left alone, and
    so is a paragraph whose breaks do not map one-to-one onto its lines (a code span across a
    line break)."""
    lines = state.src.split("\n")
    quoted = 0
    nested = 0
    tokens = state.tokens
    for i, token in enumerate(tokens):
        if token.type == "blockquote_open":
            quoted += 1
        elif token.type == "blockquote_close":
            quoted -= 1
        elif token.type in ("bullet_list_open", "ordered_list_open"):
            nested += 1
        elif token.type in ("bullet_list_close", "ordered_list_close"):
            nested -= 1
        if token.type != "inline" or quoted or i == 0 or tokens[i - 1].type != "paragraph_open":
            continue
        start, end = tokens[i - 1].map or (0, 0)
        following = lines[start + 1 : end]
        breaks = [c for c in token.children or [] if c.type in ("softbreak", "hardbreak")]
        if not following or len(breaks) != len(following):
            continue
        base = min(map(_indent_of, following)) if nested else 0
        for brk, line in zip(breaks, following):
            brk.meta["indent"] = max(0, _indent_of(line) - base)


def _center_display_math(state) -> None:
    """A paragraph holding only display math is centred (set on its paragraph_open)."""
    tokens = state.tokens
    for i in range(1, len(tokens) - 1):
        inline = tokens[i]
        if inline.type != "inline" or tokens[i - 1].type != "paragraph_open":
            continue
        kids = [
            c
            for c in (inline.children or [])
            if not (c.type == "softbreak" or (c.type == "text" and not c.content.strip()))
        ]
        if len(kids) == 1 and kids[0].type == "math_display":
            tokens[i - 1].attrSet("align", "center")
            kids[0].meta["alone"] = True


@lru_cache(maxsize=64)
def _lexer(lang: str):
    try:
        return get_lexer_by_name(lang, stripnl=False)
    except ClassNotFound:
        return None


@lru_cache(maxsize=4)
def _formatter(style: str) -> HtmlFormatter:
    return HtmlFormatter(nowrap=True, noclasses=True, style=style)


@lru_cache(maxsize=256)
def _highlighted(code: str, lang: str, style: str) -> str | None:
    """Highlighting is most of the render cost; a streaming reply re-renders the same finished
    code blocks many times, so results are cached by content."""
    lexer = _lexer(lang) if lang else None
    if lexer is None:
        return None
    return highlight(code, lexer, _formatter(style)).rstrip("\n")


def _highlight_streaming(code: str, lang: str, style: str) -> str:
    """Highlight complete lines (cached as they stop changing) and escape the line still being
    typed, so a growing block costs one highlight per new line instead of one per token."""
    head, sep, tail = code.rpartition("\n")
    done = _highlighted(head + sep, lang, style) if sep else ""
    if done is None:
        return html.escape(code.rstrip("\n"))
    return done + ("\n" if sep and done else "") + html.escape(tail)


def _rule(method):
    """markdown-it binds a render rule to its renderer (the rule gets it as first argument); ours
    are methods of MarkdownRenderer, so wrap them in a plain function that drops it."""

    def rule(_renderer, tokens, idx, options, env):
        return method(tokens, idx, options, env)

    return rule


class MarkdownRenderer:
    """Stateless apart from the theme; one instance is shared by every message view."""

    def __init__(self, theme: RenderTheme | None = None) -> None:
        self.theme = theme or RenderTheme()
        md = MarkdownIt("commonmark", {"html": False, "breaks": True, "linkify": False})
        md.enable(["table", "strikethrough"])
        md.inline.ruler.before("escape", "math", _math_rule)
        md.core.ruler.push("center_display_math", _center_display_math)
        md.core.ruler.push("keep_line_indentation", _keep_line_indentation)
        md.add_render_rule("softbreak", _rule(self._line_break))
        md.add_render_rule("hardbreak", _rule(self._line_break))
        md.add_render_rule("fence", _rule(self._fence))
        md.add_render_rule("code_block", _rule(self._fence))
        md.add_render_rule("math_inline", _rule(self._math))
        md.add_render_rule("math_display", _rule(self._math))
        md.add_render_rule("image", _rule(self._image))
        md.add_render_rule("table_open", _rule(self._table_open))
        md.add_render_rule("code_inline", _rule(self._code_inline))
        self._md = md

    def render(self, text: str, code_index_offset: int = 0) -> RenderedMarkdown:
        """HTML for ``text``; Copy links are numbered from ``code_index_offset`` (a message shown
        in several pieces numbers its code blocks across all of them)."""
        env: dict = {"code_blocks": [], "code_offset": code_index_offset}
        body = self._md.render(text, env)
        return RenderedMarkdown(body, env["code_blocks"])

    def warm_up_steps(self) -> list:
        """Callables that each pay one first-use cost (importing a Pygments lexer module takes
        10-100 ms) so the first code block of a streaming reply does not stall the GUI. The
        window runs them one per event-loop turn after it shows."""
        samples = ["python", "javascript", "bash", "json", "c", "cpp", "rust", "go", "java", "html", "sql"]
        steps = [
            lambda lang=lang: _highlighted("x = 1\n", lang, self.theme.pygments_style) for lang in samples
        ]
        steps.append(lambda: self.render("# h\n\n*a* `b` $x^2$\n\n| a |\n|---|\n| 1 |\n"))
        return steps

    def stable_prefix_length(self, text: str) -> int:
        """Length of the part of ``text`` that more text appended at the end cannot change: all
        top-level blocks but the last. (The last block can still turn into something else: a
        paragraph into a setext heading or a table, a list can grow; earlier blocks cannot.)"""
        starts = [
            t.map[0]
            for t in self._md.parse(text)
            if t.level == 0 and t.map is not None and t.nesting >= 0 and t.type != "inline"
        ]
        if len(starts) < 2:
            return 0
        last_line = starts[-1]
        offset = 0
        for i, line in enumerate(text.splitlines(keepends=True)):
            if i == last_line:
                return offset
            offset += len(line)
        return 0

    # -- render rules (bound methods: markdown-it calls them with tokens, idx, options, env) ----

    def _fence(self, tokens, idx, options, env) -> str:
        token = tokens[idx]
        code = token.content
        lang = (token.info or "").strip().split(" ")[0] if token.type == "fence" else ""
        index = env["code_offset"] + len(env["code_blocks"])
        env["code_blocks"].append(code.rstrip("\n"))
        t = self.theme
        body = _highlight_streaming(code, lang, t.pygments_style)
        label = html.escape(lang) if lang else "code"
        return (
            f'<table width="100%" cellspacing="0" cellpadding="6" border="0" bgcolor="{t.code_background}">'
            f'<tr><td bgcolor="{t.code_header}"><span style="color:{t.muted};">{label}</span>'
            f'&nbsp;&nbsp;<a href="copy:{index}" style="color:{t.link};">Copy</a></td></tr>'
            f'<tr><td><pre style="font-family:{t.monospace}; color:{t.code_foreground};">{body}</pre>'
            "</td></tr></table>\n"
        )

    def _line_break(self, tokens, idx, options, env) -> str:
        return "<br />\n" + "&nbsp;" * tokens[idx].meta.get("indent", 0)

    def _code_inline(self, tokens, idx, options, env) -> str:
        t = self.theme
        return (
            f'<code style="font-family:{t.monospace}; background-color:{t.code_background};">'
            f"{html.escape(tokens[idx].content)}</code>"
        )

    def _math(self, tokens, idx, options, env) -> str:
        token = tokens[idx]
        text = html.escape(tex_to_unicode(token.content)).replace("\n", "<br/>")
        span = f'<span style="font-family:serif; font-style:italic;">{text}</span>'
        if token.type == "math_display" and not token.meta.get("alone"):
            return f"<br/>{span}<br/>"
        return span

    def _image(self, tokens, idx, options, env) -> str:
        token = tokens[idx]
        src = html.escape(str(token.attrGet("src") or ""), quote=True)
        alt = html.escape(token.content or "image")
        return f'<a href="{src}">[image: {alt}]</a>'

    def _table_open(self, tokens, idx, options, env) -> str:
        border = self.theme.table_border
        return f'<table border="1" cellspacing="0" cellpadding="4" style="border-color:{border};">\n'


def plain_text_html(text: str) -> str:
    """User messages are shown as typed (no Markdown), keeping line breaks."""
    return "<p>" + html.escape(text).replace("\n", "<br/>") + "</p>"
