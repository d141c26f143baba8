"""Markdown -> Qt rich text, math -> Unicode: no Qt needed."""

from __future__ import annotations

import pytest

from app.chat.markdown import MarkdownRenderer, RenderTheme, plain_text_html
from app.chat.math_text import tex_to_unicode


@pytest.fixture(scope="module")
def renderer() -> MarkdownRenderer:
    return MarkdownRenderer()


@pytest.mark.parametrize(
    "tex, text",
    [
        (r"\frac{1}{2} \alpha^2", "1⁄2 α²"),
        (r"\sum_{i=1}^{n} x_i^2", "∑ᵢ₌₁ⁿ xᵢ²"),
        (r"\sqrt{x^2+y^2}", "√(x²+y²)"),
        (r"\frac{a+b}{2}", "(a+b)/2"),
        (r"x \in \mathbb{R}, a \leq b \Rightarrow f(a) \neq f(b)", "x ∈ ℝ, a ≤ b ⇒ f(a) ≠ f(b)"),
        (r"\hat{y} = \text{softmax}(Wx)", "ŷ = softmax(Wx)"),
        (r"\left( a + b \right)^{10}", "( a + b )¹⁰"),
        (r"\sqrt[3]{8} \cdot \infty", "∛8 · ∞"),
        (r"\unknowncommand{z}", "unknowncommandz"),
    ],
)
def test_tex_to_unicode(tex: str, text: str) -> None:
    assert tex_to_unicode(tex) == text


def test_code_blocks_are_highlighted_with_copy_links(renderer: MarkdownRenderer) -> None:
    out = renderer.render("Intro\n\n```python\ndef f():\n    return 1\n```\n\n```\nplain <b>\n```\n")
    assert out.code_blocks == ["def f():\n    return 1", "plain <b>"]
    assert 'href="copy:0"' in out.html and 'href="copy:1"' in out.html
    assert "font-weight: bold" in out.html  # Pygments inline styles on `def`
    assert "plain &lt;b&gt;" in out.html
    # Numbering continues across pieces of a long message.
    assert 'href="copy:5"' in renderer.render("```\nx\n```\n", code_index_offset=5).html


def test_unclosed_fence_while_streaming_shows_as_code(renderer: MarkdownRenderer) -> None:
    out = renderer.render("```python\nx = 1\ny = 'abc")
    assert out.code_blocks == ["x = 1\ny = 'abc"]
    assert "y = &#x27;abc" in out.html or "y = 'abc" in out.html or "y = &#39;abc" in out.html


def test_math_delimiters_and_prices(renderer: MarkdownRenderer) -> None:
    out = renderer.render(r"Costs $5 and $10. Inline $\alpha^2$ and \(x_1\).")
    assert "$5 and $10" in out.html
    assert "α²" in out.html and "x₁" in out.html
    display = renderer.render("Before\n\n$$\n\\frac{a}{b}\n$$\n\nAfter")
    assert (
        '<p align="center"><span style="font-family:serif; font-style:italic;">a⁄b</span></p>' in display.html
    )
    assert "\\[" not in renderer.render(r"\[ E = mc^2 \]").html


def test_model_html_is_escaped_and_images_are_links(renderer: MarkdownRenderer) -> None:
    out = renderer.render('<script>alert(1)</script> <img src="x"> ![cat](https://example.org/cat.png)')
    assert "<script>" not in out.html and "&lt;script&gt;" in out.html
    assert "<img" not in out.html
    assert '<a href="https://example.org/cat.png">[image: cat]</a>' in out.html


def test_tables_and_dark_theme_colours() -> None:
    dark = MarkdownRenderer(RenderTheme.dark())
    out = dark.render("| a | b |\n|---|---|\n| 1 | 2 |\n\n```python\nx = 1\n```")
    assert '<table border="1"' in out.html and "<td>1</td>" in out.html
    assert 'bgcolor="#1e1f22"' in out.html


def test_stable_prefix_is_everything_but_the_last_block(renderer: MarkdownRenderer) -> None:
    text = "# H\n\npara one\nmore\n\n- a\n- b\n\n```py\nx=1\n"
    k = renderer.stable_prefix_length(text)
    assert text[:k] == "# H\n\npara one\nmore\n\n- a\n- b\n\n"
    # A paragraph that may still become a setext heading or a table is not stable.
    text = "para\n\nTitle\n"
    assert text[: renderer.stable_prefix_length(text)] == "para\n\n"
    assert renderer.stable_prefix_length("just one paragraph") == 0
    # Rendering the stable part and the rest separately gives the same blocks as rendering it all.
    text = "Intro\n\n1. one\n2. two\n\n```c\nint x;\n```\n\nEnd"
    k = renderer.stable_prefix_length(text)
    assert renderer.render(text[:k]).html + renderer.render(text[k:]).html == renderer.render(text).html


def test_user_text_is_shown_as_typed() -> None:
    assert plain_text_html("a <b>\n*not bold*") == "<p>a &lt;b&gt;<br/>*not bold*</p>"


def test_line_breaks_are_kept_with_their_indentation(renderer: MarkdownRenderer) -> None:
    # A reply whose model did not fence its code nor blank-line its list (issue 40, defect 3).
    html = renderer.render("Steps:\nopen the file\nread it\nfor line in f:\n    print(line)\n").html
    assert html.count("<br />") == 4  # five lines, not one run-on paragraph
    assert "<br />\n&nbsp;&nbsp;&nbsp;&nbsp;print(line)" in html  # indentation kept
    # A list the model wrote without a blank line before it, with a lazy continuation line.
    listed = renderer.render("Do this:\n1. first\n2. second\nthen more\n").html
    assert "<ol>" in listed and "<li>second<br />\nthen more</li>" in listed
    # Markdown still works: fenced code stays code, emphasis, tables.
    out = renderer.render("**bold**\n\n```python\nif x:\n    y = 1\n```\n\n| a |\n|---|\n| 1 |\n")
    assert "<strong>bold</strong>" in out.html and out.code_blocks == ["if x:\n    y = 1"]
    assert "&nbsp;" not in out.html.split("<pre")[1].split("</pre>")[0]  # code keeps its own spaces
    assert "<th>a</th>" in out.html
