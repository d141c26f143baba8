"""Chat templates are untrusted code: rendering one is bounded in time, output size, recursion
depth and loop iterations (engine.chat_template). A template past a limit fails that render with
one ChatTemplateLimitError naming the limit, quickly and without building anything huge, and the
tokenizer renders the next conversation as if nothing had happened. Templates within the limits
render exactly as before (here against transformers; the SmolLM2 and Gemma 3 templates are
compared in test_tokenizer.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from engine.cli import main as cli_main
from engine.tokenizer import ChatTemplateError, ChatTemplateLimitError, TemplateLimits, Tokenizer

REPO = Path(__file__).parents[2]
CHAT = [{"role": "user", "content": "Hi!"}]
GOOD = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"

NESTED_LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
NESTED_LOOP_SILENT = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
RECURSIVE_MACRO = "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}"


@pytest.fixture(scope="module")
def model(exl3_dir: Path) -> Path:
    """The fixtures' tiny Llama (4 MB, a real tokenizer; its config has no chat template)."""
    return exl3_dir / "tiny-llama-hf"


def with_template(model: Path, directory: Path, template: str, weights: bool = False) -> Path:
    """A copy of the tiny model's tokenizer (and, with ``weights``, the whole model) in
    ``directory``, with ``template`` as its chat template."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", *(["config.json", "model.safetensors"] if weights else [])):
        shutil.copyfile(model / name, directory / name)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return directory


@pytest.fixture
def tokenizer_with(model: Path, tmp_path: Path):
    def make(template: str, limits: TemplateLimits | None = None) -> Tokenizer:
        tok = Tokenizer.from_dir(with_template(model, tmp_path / "tok", template))
        if limits is not None:
            tok.template_limits = limits
        return tok

    return make


def render_in_thread(tok: Tokenizer, messages: list[dict], wait: float) -> tuple[BaseException | None, float]:
    """Render on a daemon thread and wait at most ``wait`` seconds, so a template that is not
    stopped fails the test instead of hanging it. Returns (exception raised, seconds taken)."""
    outcome: dict[str, object] = {}

    def work() -> None:
        started = time.monotonic()
        try:
            tok.apply_chat_template(messages)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test to judge
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(wait)
    assert not thread.is_alive(), f"the template was still rendering after {wait} s"
    return outcome.get("error"), float(outcome["seconds"])


# ---------------------------------------------------------------------------------------------
# Time and loops
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("template", [NESTED_LOOP, NESTED_LOOP_SILENT], ids=["output", "silent"])
def test_nested_loop_stops_at_the_time_limit(tokenizer_with, template: str) -> None:
    # The loop limit is lifted so the clock is what stops it (the silent loop calls nothing the
    # sandbox sees: only the loop itself can check the time).
    tok = tokenizer_with(template, TemplateLimits(seconds=1.0, max_loop_iterations=10**12))
    error, seconds = render_in_thread(tok, CHAT, wait=10)
    assert isinstance(error, ChatTemplateLimitError), repr(error)
    assert error.limit == "time"
    assert "more than 1 s" in str(error) and "time limit" in str(error) and tok.source in str(error)
    assert 0.9 <= seconds < 3.0


def test_nested_loop_stops_at_the_loop_limit_by_default(tokenizer_with) -> None:
    tok = tokenizer_with(NESTED_LOOP_SILENT)
    error, seconds = render_in_thread(tok, CHAT, wait=10)
    assert isinstance(error, ChatTemplateLimitError) and error.limit == "loop", repr(error)
    assert "1,000,000 loop iterations" in str(error)
    assert seconds < TemplateLimits().seconds


def test_loops_over_values_are_bounded_too(tokenizer_with) -> None:
    # Not range(): nested loops over a string. Nothing in the body is a call.
    template = (
        "{% set s = 'ab' * 500 %}"
        "{% for a in s %}{% for b in s %}{% for c in s %}{% endfor %}{% endfor %}{% endfor %}"
    )
    tok = tokenizer_with(template, TemplateLimits(seconds=1.0, max_loop_iterations=10**12))
    error, seconds = render_in_thread(tok, CHAT, wait=10)
    assert isinstance(error, ChatTemplateLimitError) and error.limit == "time", repr(error)


def test_range_is_capped(tokenizer_with) -> None:
    tok = tokenizer_with("{% for i in range(10**9) %}{% endfor %}")
    with pytest.raises(ChatTemplateLimitError, match="1,000,000,000 numbers from range") as info:
        tok.apply_chat_template(CHAT)
    assert info.value.limit == "loop"


# ---------------------------------------------------------------------------------------------
# Recursion
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template",
    [RECURSIVE_MACRO, "{% for x in [1] recursive %}{{ loop([x]) }}{% endfor %}"],
    ids=["macro", "recursive-loop"],
)
def test_recursion_is_a_depth_error(tokenizer_with, template: str) -> None:
    tok = tokenizer_with(template)
    with pytest.raises(ChatTemplateLimitError) as info:
        tok.apply_chat_template(CHAT)
    assert info.value.limit == "depth"
    assert "more than 64 deep" in str(info.value) and "recursion limit" in str(info.value)
    tok.chat_template = GOOD
    assert tok.apply_chat_template(CHAT) == "<|user|>Hi!\n<|assistant|>"  # nothing left over


def test_python_stack_running_out_is_the_same_depth_error(tokenizer_with) -> None:
    # With our count lifted, Python's own RecursionError is what fires: it becomes the same error.
    tok = tokenizer_with(RECURSIVE_MACRO, TemplateLimits(max_depth=10**6))
    with pytest.raises(ChatTemplateLimitError, match="recursion limit") as info:
        tok.apply_chat_template(CHAT)
    assert info.value.limit == "depth" and not isinstance(info.value.__cause__, RecursionError)


# ---------------------------------------------------------------------------------------------
# Size
# ---------------------------------------------------------------------------------------------

HUGE = {
    "repeat": "{{ 'x' * 2000000000 }}",
    "repeat-reversed": "{{ 2000000000 * 'x' }}",
    "center": "{{ 'x' | center(2000000000) }}",
    "ljust": "{{ 'x'.ljust(2000000000) }}",
    "format-width": "{{ '{:>2000000000}'.format(1) }}",
    "printf-width": "{{ '%2000000000s' % 'x' }}",
    "printf-fields": "{{ ('%999999s' * 1000) % (('x',) * 1000) }}",
    "replace": "{{ ('x' * 1000000).replace('x', 'y' * 2000) }}",
    "join-repeated": "{% set s = 'y' * 1000000 %}{{ ([s] * 1000) | join }}",
    "list-repeated": "{% set s = 'y' * 1000000 %}{{ [s] * 1000 }}",
    "nested-lists": "{% set a = ['y' * 1000000] %}{% set b = [a, a, a, a, a, a, a, a] %}"
    "{% set c = [b, b, b, b, b, b, b, b] %}{{ c }}",
    "concat-doubling": "{% set ns = namespace(s='y' * 1000) %}{% for i in range(21) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
    "plus-doubling": "{% set ns = namespace(s='y' * 1000) %}{% for i in range(21) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
    "list-appending": "{% set s = 'y' * 1000000 %}{% set ns = namespace(items=[]) %}"
    "{% for i in range(1500) %}{% set ns.items = ns.items + [s] %}{% endfor %}{{ ns.items | join }}",
    "macro-body": "{% macro m() %}{% for i in range(1000) %}{{ 'y' * 1000000 }}{% endfor %}{% endmacro %}"
    "{{ m() | length }}",
    "output": "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
}


@pytest.mark.parametrize("template", HUGE.values(), ids=HUGE.keys())
def test_huge_values_are_refused_before_they_are_built(tokenizer_with, template: str) -> None:
    tok = tokenizer_with(template)
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(ChatTemplateLimitError) as info:
            tok.apply_chat_template(CHAT)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.limit == "size"
    assert "more than 4,000,000 characters, the size limit" in str(info.value)
    assert time.monotonic() - started < 2.0
    assert peak < 64 * 2**20, f"peak {peak / 2**20:.0f} MiB while rendering"


def test_huge_integers_are_refused(tokenizer_with) -> None:
    tok = tokenizer_with("{{ 7 ** 1000000000 }}")
    with pytest.raises(ChatTemplateLimitError, match="integer of more than") as info:
        tok.apply_chat_template(CHAT)
    assert info.value.limit == "size"


def test_size_limit_follows_the_context_and_lets_the_conversation_through(tokenizer_with) -> None:
    assert TemplateLimits().for_context(4096).max_chars == TemplateLimits.MIN_CHARS
    assert TemplateLimits(seconds=2).for_context(1_000_000) == TemplateLimits(seconds=2, max_chars=8_000_000)
    limits = TemplateLimits(max_chars=10_000)
    # A long conversation is not the template's doing: its text fits on top of the limit (trimming
    # it to the context is the caller's business)...
    long_chat = [{"role": "user", "content": "word " * 20_000}]
    assert len(tokenizer_with(GOOD, limits).apply_chat_template(long_chat)) > 100_000
    # ...while what the template adds of its own does not.
    padded = "{{ 'pad' * 5000 }}" + GOOD
    with pytest.raises(ChatTemplateLimitError, match="10,000 characters"):
        tokenizer_with(padded, limits).apply_chat_template(CHAT)


# ---------------------------------------------------------------------------------------------
# Everything else stays as it was
# ---------------------------------------------------------------------------------------------

# Macros, namespaces, loop variables, filters, string methods, ~ and % as real templates use them.
RICH_TEMPLATE = """{%- macro render(m) -%}
<|{{ m['role'] }}|>{{ m['content'] | trim }}{% if m.get('name') %} ({{ m.name }}){% endif %}
{%- endmacro -%}
{{ bos_token }}
{%- set ns = namespace(system='', count=0) -%}
{%- for m in messages if m['role'] == 'system' -%}
{%- set ns.system = ns.system ~ m['content'] -%}
{%- endfor -%}
{%- if ns.system %}[SYS] {{ ns.system | upper }}{{ '\\n' }}{% endif -%}
{%- if tools -%}Tools: {{ tools | tojson(indent=2) }}{{ '\\n' }}
{%- for t in tools %}{{ '%-8s|%3d' % (t.name, loop.index) }}{% endfor %}
{%- endif -%}
{%- for m in messages -%}
{%- if m['role'] != 'system' -%}
{%- set ns.count = ns.count + 1 -%}
{{ render(m) }}{{ '{:>4}'.format(ns.count) }}{% if not loop.last %}{{ '\\n' }}{% endif %}
{%- endif -%}
{%- endfor -%}
{{ ', '.join(messages | map(attribute='role') | unique | list) }}
{%- for i in range(3) %}{{ i * 2 }}{% endfor -%}
{%- if add_generation_prompt %}<|assistant|>{% endif -%}"""


def test_templates_within_the_limits_render_as_transformers_does(model: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    directory = with_template(model, tmp_path / "rich", RICH_TEMPLATE)
    ours = Tokenizer.from_dir(directory)
    ref = transformers.AutoTokenizer.from_pretrained(str(directory))
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  Hello  ", "name": "ana"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "ça va ? 😀"},
    ]
    tools = [{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]
    for kwargs in ({}, {"tools": tools}):
        text = ours.apply_chat_template(chat, **kwargs)
        assert text == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kwargs)
        assert "[SYS] BE BRIEF." in text and "<|user|>Hello (ana)   1" in text


def test_other_template_errors_are_chat_template_errors(tokenizer_with) -> None:
    # A template's own bug (here a division by zero) is one readable error, not a bare Python one.
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError") as info:
        tokenizer_with("{{ 1 / 0 }}").apply_chat_template(CHAT)
    assert not isinstance(info.value, ChatTemplateLimitError)


def test_after_a_limit_the_next_render_is_unaffected(tokenizer_with) -> None:
    tok = tokenizer_with(NESTED_LOOP, TemplateLimits(seconds=0.5, max_loop_iterations=10**12))
    with pytest.raises(ChatTemplateLimitError):
        tok.apply_chat_template(CHAT)
    tok.chat_template = GOOD  # setting the template compiles it afresh
    started = time.monotonic()
    assert tok.apply_chat_template(CHAT) == "<|user|>Hi!\n<|assistant|>"
    assert time.monotonic() - started < 0.5  # a fresh clock, not the spent one


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------


def test_cli_generate_with_a_runaway_template_exits_with_one_line(model: Path, tmp_path: Path) -> None:
    directory = with_template(model, tmp_path / "model", NESTED_LOOP_SILENT, weights=True)
    argv = ["generate", "-m", str(directory), "--chat", "-p", "hi", "-n", "2", "--device", "cpu", "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "engine", *argv], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert done.returncode in (1, 2), done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert str(directory) in lines[0] and "loop limit" in lines[0]


@pytest.mark.parametrize(
    "template, fragment",
    [(RECURSIVE_MACRO, "recursion limit"), (HUGE["repeat"], "size limit")],
    ids=["recursion", "huge-string"],
)
def test_cli_generate_names_the_limit(
    model: Path, tmp_path: Path, capsys, template: str, fragment: str
) -> None:
    directory = with_template(model, tmp_path / "model", template, weights=True)
    code = cli_main(
        ["generate", "-m", str(directory), "--chat", "-p", "hi", "-n", "2", "--device", "cpu", "--json"]
    )
    out, err = capsys.readouterr()
    assert code in (1, 2) and out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err
