"""Rendering a model's Jinja chat template: in a sandbox, and within limits.

Chat templates come from the internet with the weights, so they are untrusted code. Jinja's
sandbox keeps a template away from Python's internals, but not from the machine's time and
memory: a nested loop runs for hours, a recursive macro overflows the stack, ``'x' * 10**10``
allocates 10 GB. Rendering here is therefore bounded on four counts (:class:`TemplateLimits`):

* **time**: wall time per render, checked on every loop iteration (even of a loop whose body
  does nothing the sandbox sees), call, filter and output chunk: all repetition in a template
  comes from loops and recursion, and no single step can take long once sizes are bounded;
* **size**: characters of output, counted while streaming (``Template.generate``) so the whole
  prompt is never built past the limit, and of every value built on the way (operators, string
  methods, filters, ``~`` and macro bodies), checked *before* allocating where the size can be
  known in advance;
* **depth**: nested macro calls and recursive loops, before Python's own stack runs out;
* **loop iterations**: in total, so a loop that appends to a buffer cannot grow it for the whole
  time limit.

A template that exceeds one raises :class:`ChatTemplateLimitError` naming the limit; nothing is
left behind, so the next render starts afresh. The checks run in the sandbox's hooks, on the
thread that renders: no watchdog thread, nothing to kill.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import TokenizerError

__all__ = [
    "ChatTemplateError",
    "ChatTemplateLimitError",
    "TemplateLimits",
    "compile_template",
    "render_template",
]


class ChatTemplateError(TokenizerError):
    """The chat template is missing, does not compile, fails while rendering, or tried to break
    out of the sandbox (then ``__cause__`` is the ``jinja2.sandbox.SecurityError``)."""


class ChatTemplateLimitError(ChatTemplateError):
    """The chat template went past one of its :class:`TemplateLimits`. ``limit`` names which:
    ``"time"``, ``"size"``, ``"depth"`` or ``"loop"``."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True)
class TemplateLimits:
    """Bounds on one render of a chat template.

    ``max_chars`` bounds the output and every value built while rendering. The default fits any
    real prompt (a million tokens at four characters each); :meth:`for_context` derives it from a
    model's context. The text handed in (messages, tools) always fits on top of it: a long
    conversation is the caller's to trim, not the template's fault.
    """

    seconds: float = 5.0
    max_chars: int = 4_000_000
    max_depth: int = 64
    max_loop_iterations: int = 1_000_000

    # Characters allowed per token of context: prompts average 3-4 per token, runs of spaces or
    # repeated punctuation more; a prompt past this many could never fit the context anyway.
    CHARS_PER_TOKEN = 8
    MIN_CHARS = 1_000_000

    def for_context(self, context_tokens: int) -> TemplateLimits:
        """These limits with ``max_chars`` sized for a model of ``context_tokens`` tokens."""
        return replace(self, max_chars=max(self.MIN_CHARS, self.CHARS_PER_TOKEN * int(context_tokens)))


# Jinja's sandbox allows range() up to 100000 items; loops multiply, which the time and
# iteration limits catch, so this only bounds a single list built from a range.
MAX_RANGE = 100_000
# Integers past this many bits make * and ** slow (and uninterruptible) and print as nothing a
# prompt needs.
MAX_INT_BITS = 1 << 16


# ---------------------------------------------------------------------------------------------
# The budget of the render in progress
# ---------------------------------------------------------------------------------------------


class _Budget:
    """What one render has used so far. Lives in a context variable, so the sandbox's hooks (which
    only see the shared environment) find the render they belong to, on whichever thread."""

    __slots__ = (
        "deadline",
        "seconds",
        "max_chars",
        "shown_chars",
        "max_depth",
        "max_iterations",
        "depth",
        "deepest",
        "iterations",
    )

    def __init__(self, limits: TemplateLimits, max_chars: int) -> None:
        self.seconds = limits.seconds
        self.deadline = time.monotonic() + limits.seconds
        self.max_chars = max_chars
        # Messages name the configured limit; the allowance for the conversation's own text is
        # not something a user set, nor the template's doing.
        self.shown_chars = limits.max_chars
        self.max_depth = limits.max_depth
        self.max_iterations = limits.max_loop_iterations
        self.depth = 0
        self.deepest = 0
        self.iterations = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateLimitError(
                f"the chat template ran for more than {self.seconds:g} s, the time limit for "
                "rendering a prompt (it may loop without end)",
                "time",
            )

    def check_size(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise _too_big(what, self.shown_chars)

    def iterate(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            self.iterations += 1
            if self.iterations > self.max_iterations:
                raise ChatTemplateLimitError(
                    f"the chat template ran more than {self.max_iterations:,} loop iterations, the "
                    "loop limit for rendering a prompt",
                    "loop",
                )
            self.tick()
            yield item


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)


def _cap() -> int:
    """The size limit of the render in progress (the default one outside a render: Jinja may
    evaluate constant expressions while compiling)."""
    budget = _BUDGET.get()
    return budget.max_chars if budget is not None else TemplateLimits.max_chars


def _refuse(size: int, what: str, cap: int) -> None:
    if size > cap:
        budget = _BUDGET.get()
        raise _too_big(what, budget.shown_chars if budget is not None else cap)


def _too_big(what: str, chars: int) -> ChatTemplateLimitError:
    return ChatTemplateLimitError(
        f"the chat template {what} of more than {chars:,} characters, the size limit for a prompt",
        "size",
    )


# ---------------------------------------------------------------------------------------------
# Sizes: how many characters a value stands for, known before building what it would print as
# ---------------------------------------------------------------------------------------------


def _size(value: Any, limit: int, indent: int = 0) -> int:
    """About how many characters ``value`` prints as (``str``, ``tojson``), counting a shared
    element as often as it is referred to; counting stops once past ``limit``. ``indent``: the
    indentation of ``tojson(indent=...)``, which every element repeats once per nesting level.
    Iterative: a value nested deeper than Python's stack is still measured."""
    if isinstance(value, str) and not indent:
        return len(value)  # the common case, on every operator and call
    total = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if indent:
            total += indent * level + 1
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(item)
            stack.extend((element, level + 1) for element in item)
        elif isinstance(item, Mapping):
            total += 2 + 4 * len(item)
            for key, element in item.items():
                stack.append((key, level + 1))
                stack.append((element, level + 1))
        elif isinstance(item, jinja2.utils.Namespace):
            attrs = object.__getattribute__(item, "_Namespace__attrs")
            total += 16 + 4 * len(attrs)
            stack.extend((element, level + 1) for element in attrs.values())
        elif isinstance(item, int) and not isinstance(item, bool):
            total += item.bit_length() // 3 + 1
        else:
            total += 8
        if total > limit:
            return total
    return total


def input_size(value: Any) -> int:
    """Characters of the data handed to a template (messages, tools...), measured in full."""
    return _size(value, 1 << 62)


def _number(digits: str) -> int:
    # A width of more than nine digits is past any limit; int() of thousands of digits would
    # itself be refused by Python.
    return int(digits) if len(digits) <= 9 else 1 << 40


_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")
_FORMAT_FIELD = re.compile(r"\{(?:[^{}]|\{[^{}]*\})*\}")
_DIGITS = re.compile(r"\d+")


def _argument_sizes(args: Any, cap: int) -> list[int]:
    if isinstance(args, tuple):
        return [_size(a, cap) for a in args]
    if isinstance(args, Mapping):
        return [_size(a, cap) for a in args.values()]
    return [_size(args, cap)]


def _ints(values: Iterable[Any]) -> int:
    return sum(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0)


def _printf_size(fmt: str, args: Any, cap: int) -> int:
    """An upper bound on ``len(fmt % args)``: each field prints at most its largest argument,
    padded to its width and precision (``*`` ones come from the arguments)."""
    sizes = _argument_sizes(args, cap)
    widest = max(sizes, default=0)
    total = len(fmt)
    star = False
    for match in _PRINTF_SPEC.finditer(fmt):
        total += widest
        for group in match.group(1, 2):
            if group == "*":
                star = True
            elif group:
                total += _number(group)
    if star:
        total += _ints(args if isinstance(args, tuple) else (args,))
    return total


def _format_size(fmt: str, args: tuple, kwargs: Mapping[str, Any], cap: int) -> int:
    """An upper bound on ``len(fmt.format(*args, **kwargs))``, as for ``%``."""
    values = [*args, *kwargs.values()]
    widest = max((_size(v, cap) for v in values), default=0)
    total = len(fmt)
    nested = False
    for match in _FORMAT_FIELD.finditer(fmt):
        field = match.group(0)
        total += widest + sum(_number(d) for d in _DIGITS.findall(field))
        nested = nested or "{" in field[1:-1]
    if nested:
        total += _ints(values)
    return total


def _replace_size(text: str, old: Any = None, new: Any = None, count: Any = -1) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(text)
    hits = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(0, len(new) - len(old))


def _join_size(separator: Any, items: list[Any], cap: int) -> int:
    total = max(0, len(items) - 1) * len(str(separator) if isinstance(separator, str) else "")
    for item in items:
        total += _size(item, cap)
        if total > cap:
            break
    return total


def _width(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return max(0, value)
    return len(value) if isinstance(value, str) else 0


def _str_method_size(text: str, name: str, args: tuple, kwargs: dict, cap: int) -> int:
    """An upper bound on the length of ``text.<name>(*args, **kwargs)`` for the methods whose
    result can be far longer than their inputs; 0 for the others."""
    first = args[0] if args else None
    if name in ("ljust", "rjust", "center", "zfill"):
        return max(len(text), _width(first))
    if name == "expandtabs":
        tabsize = first if first is not None else kwargs.get("tabsize", 8)
        return len(text) + text.count("\t") * _width(tabsize)
    if name == "replace":
        return _replace_size(text, *args[:3], **{k: v for k, v in kwargs.items() if k == "count"})
    if name == "translate" and isinstance(first, Mapping):
        longest = max((len(v) for v in first.values() if isinstance(v, str)), default=1)
        return len(text) * max(1, longest)
    if name in ("format", "format_map"):
        if name == "format_map":
            return _format_size(text, (), first if isinstance(first, Mapping) else {}, cap)
        return _format_size(text, args, kwargs, cap)
    return 0


# ---------------------------------------------------------------------------------------------
# Filters: each one checked before (the sizes it can be known to reach) and after
# ---------------------------------------------------------------------------------------------

# Filters that only look at a sequence's length or its top-level elements: measuring their input
# in depth on every call would make ordinary loops quadratic.
_SHALLOW_FILTERS = frozenset(
    """abs attr batch count d default dictsort first float groupby int items last length list
    map max min random reject rejectattr reverse round select selectattr slice sort sum unique
    wordcount""".split()
)
# Filters whose first argument counts what they create, and what it counts.
_COUNT_FILTERS = {"slice": "lists from |slice", "batch": "items per list from |batch"}


def _filter_size(name: str, value: Any, args: tuple, kwargs: dict, cap: int) -> int:
    """An upper bound (or a lower bound that already tells it is too big) on the length of
    ``value | name(*args, **kwargs)`` for filters that can grow their input."""
    if name in _SHALLOW_FILTERS:
        return 0
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, int) and not isinstance(arg, bool) and arg > cap:
            return arg  # a width or count past the limit, whatever the rest
    size = _size(value, cap)
    text = value if isinstance(value, str) else ""
    if name == "replace":
        return _replace_size(text, *args[:3], **{k: v for k, v in kwargs.items() if k == "count"})
    if name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        return size + (text.count("\n") + 1) * _width(width)
    if name == "wordwrap":
        width = args[0] if args else kwargs.get("width", 79)
        wrap = args[2] if len(args) > 2 else kwargs.get("wrapstring") or "\n"
        lines = size // max(1, _width(width)) + text.count("\n") + 1
        return size + lines * _width(wrap)
    if name == "center":
        return max(size, _width(args[0] if args else kwargs.get("width", 80)))
    if name == "format":
        return _printf_size(text, tuple(args) if args else kwargs, cap)
    if name == "tojson":
        indent = kwargs.get("indent", args[1] if len(args) > 1 else None)
        # Control characters print as \\uXXXX: six characters for one.
        return 6 * size + _size(value, cap, indent=_width(indent)) if indent else 6 * size
    return size


def _guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    # pass_context/pass_eval_context/pass_environment filters get that object first.
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(func)  # keeps jinja_pass_arg, which Jinja reads to know what to pass
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        cap = budget.max_chars if budget is not None else TemplateLimits.max_chars
        if budget is not None:
            budget.tick()
        value, rest = (args[skip], args[skip + 1 :]) if len(args) > skip else (None, ())
        if name in _COUNT_FILTERS:
            count = rest[0] if rest else kwargs.get("linecount", kwargs.get("slices", 0))
            if isinstance(count, int) and not isinstance(count, bool):
                _check_count(count, _COUNT_FILTERS[name])
        if name == "join" and value is not None:
            items = list(value)  # measured before joining, then joined as measured
            separator = rest[0] if rest else kwargs.get("d", "")
            _refuse(_join_size(separator, items, cap), f"joined a string (|{name})", cap)
            args = (*args[:skip], items, *rest)
        else:
            _refuse(_filter_size(name, value, rest, kwargs, cap), f"built a value with |{name}", cap)
        result = func(*args, **kwargs)
        # A shallow filter's result is no bigger than its input (measuring it in depth would
        # again make loops quadratic).
        if name not in _SHALLOW_FILTERS and isinstance(result, (str, list, tuple, dict)):
            _refuse(_size(result, cap), f"built a value with |{name}", cap)
        return result

    return guarded


# ---------------------------------------------------------------------------------------------
# The sandbox
# ---------------------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: HF templates mark assistant text with it (for
    training masks). We only render, so the block's body is output unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


class _SafeNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` for templates, refusing underscore names: a namespace is a mutable object
    in the template, and dunder attributes are the way out of a sandbox."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors Namespace's signature
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.sandbox.SecurityError(
                f"namespace attribute {name!r} is not allowed in a chat template"
            )


def _raise_exception(message: str) -> None:
    # Templates call this to reject a conversation they cannot format (e.g. roles out of order).
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, ') for embedding in web pages; chat templates
    # expect plain JSON with non-ASCII kept, as Hugging Face renders it.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _check_count(count: int, what: str) -> None:
    if count > MAX_RANGE:
        raise ChatTemplateLimitError(
            f"the chat template asked for {count:,} {what}; at most {MAX_RANGE:,} are allowed",
            "loop",
        )


def _range(*args: int) -> range:
    numbers = range(*args)
    _check_count(len(numbers), "numbers from range()")
    return numbers


@jinja2.pass_context
def _finalize(_context: jinja2.runtime.Context, value: Any) -> Any:
    # Every {{ expression }} passes here before str(): a list holding one long string many times
    # is small in memory and huge in print. (Taking the context also stops Jinja from evaluating
    # constant output while compiling, outside any budget.)
    if not isinstance(value, str):
        _refuse(_size(value, _cap()), "printed a value", _cap())
    return value


class _OutputBuffer(list):
    """The list a macro body, ``{% set %}`` block or recursive loop collects its output in, which
    counts what it holds: the parts are joined only at the end of the block, by then too late."""

    __slots__ = ("chars",)

    def __init__(self) -> None:
        super().__init__()
        self.chars = 0

    def append(self, part: str) -> None:
        self._count(len(part))
        super().append(part)

    def extend(self, parts: Iterable[str]) -> None:
        parts = tuple(parts)
        self._count(sum(map(len, parts)))
        super().extend(parts)

    def _count(self, chars: int) -> None:
        self.chars += chars
        budget = _BUDGET.get()
        if budget is not None:
            budget.check_size(self.chars, "built a block of text")


class _GuardedCodeGenerator(CodeGenerator):
    """Jinja's code generator with three additions: every ``{% for %}`` iterates through the
    budget (a loop's body may call nothing the sandbox sees, so the loop itself must check the
    clock), ``~`` joins through a size check, and block output is collected in a buffer that
    counts its size."""

    def buffer(self, frame: Frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.output_buffer()")

    def visit_For(self, node: jinja2.nodes.For, frame: Frame) -> None:
        guarded = copy.copy(node)
        guard = jinja2.nodes.EnvironmentAttribute("guard_loop", lineno=node.iter.lineno)
        guarded.iter = jinja2.nodes.Call(guard, [node.iter], [], None, None, lineno=node.iter.lineno)
        super().visit_For(guarded, frame)

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            super().visit_Concat(node, frame)  # Markup joining; our environment never escapes
            return
        self.write("environment.guard_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, strict about forbidden attributes and bounded by the budget of
    the render in progress (see the module's docstring)."""

    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "%", "**"})

    # Jinja's sandbox answers a forbidden attribute (``x.__class__``) with an Undefined that only
    # fails when used further, so ``{{ f.__globals__ }}`` quietly renders "". A template that
    # reaches for internals is hostile or broken either way: fail at once, loudly.
    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.sandbox.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__} object is unsafe"
        )

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        # No clock check here: repetition only comes from loops and calls, which check it.
        cap = _cap()
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*":
            if ints:
                if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise _int_too_big()
            elif isinstance(right, int) and not isinstance(left, (int, float)):
                _refuse(_size(left, cap) * max(0, right), "built a value with *", cap)
            elif isinstance(left, int) and not isinstance(right, (int, float)):
                _refuse(_size(right, cap) * max(0, left), "built a value with *", cap)
        elif operator == "**":
            if ints and right > 0 and abs(left) > 1 and left.bit_length() * right > MAX_INT_BITS:
                raise _int_too_big()
        elif operator == "+":
            if not ints and isinstance(left, (str, list, tuple)):
                _refuse(_size(left, cap) + _size(right, cap), "built a value with +", cap)
        elif operator == "%" and isinstance(left, str):
            _refuse(_printf_size(left, right, cap), "formatted a string with %", cap)
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, str):
            _refuse(len(result), f"built a value with {operator}", cap)
        return result

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's convention, so no keyword argument can clash
        budget = _BUDGET.get()
        if budget is None:
            return super().call(__context, __obj, *args, **kwargs)
        budget.tick()
        cap = budget.max_chars
        # str methods that can grow a string (str.format comes wrapped by the sandbox).
        method = getattr(__obj, "__wrapped__", __obj)
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            name = getattr(method, "__name__", "")
            if name == "join" and args:
                items = list(args[0])
                budget.check_size(_join_size(owner, items, cap), "joined a string")
                args = (items, *args[1:])
            else:
                budget.check_size(
                    _str_method_size(owner, name, args, kwargs, cap), f"built a string with .{name}()"
                )
        budget.depth += 1
        budget.deepest = max(budget.deepest, budget.depth)
        try:
            if budget.depth > budget.max_depth:
                raise _too_deep(budget.max_depth)
            result = super().call(__context, __obj, *args, **kwargs)
        finally:
            budget.depth -= 1
        if isinstance(result, (str, list, tuple, dict)):
            budget.check_size(_size(result, cap), "built a value")
        return result

    def output_buffer(self) -> list[str]:
        return _OutputBuffer()

    def guard_loop(self, iterable: Any) -> Any:
        budget = _BUDGET.get()
        return iterable if budget is None else budget.iterate(iterable)

    def guard_concat(self, values: Iterable[Any]) -> str:
        cap = _cap()
        parts, total = [], 0
        for value in values:
            if not isinstance(value, str):
                _refuse(_size(value, cap), "joined a string with ~", cap)
            part = str(value)
            total += len(part)
            _refuse(total, "joined a string with ~", cap)
            parts.append(part)
        return "".join(parts)

    def concat(self, parts: Iterable[str]) -> str:  # type: ignore[override]
        # Macro bodies, {% set %} blocks and call blocks collect their output in a list and join
        # it here; measure before joining.
        budget = _BUDGET.get()
        if budget is None:
            return "".join(parts)
        parts = list(parts)
        budget.check_size(sum(map(len, parts)), "built a block of text")
        return "".join(parts)


def _int_too_big() -> ChatTemplateLimitError:
    return ChatTemplateLimitError(
        f"the chat template computed an integer of more than {MAX_INT_BITS:,} bits, the size "
        "limit for numbers in a prompt",
        "size",
    )


def _too_deep(depth: int) -> ChatTemplateLimitError:
    return ChatTemplateLimitError(
        f"the chat template nested macro calls or recursive loops more than {depth} deep, the "
        "recursion limit (a macro that calls itself without end?)",
        "depth",
    )


def _make_environment() -> _Sandbox:
    env = _Sandbox(
        # trim_blocks/lstrip_blocks: HF renders with both on, and templates are written for that.
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        # No constant folding: it would run filters and operators while compiling, outside any
        # budget ({{ 'x' | center(10**10) }} is constant).
        optimized=False,
        finalize=_finalize,
    )
    env.filters["tojson"] = _tojson
    for name, func in list(env.filters.items()):
        env.filters[name] = _guard_filter(name, func)
    env.globals["range"] = _range
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    # lipsum(n) writes n paragraphs in one uninterruptible call; no chat template needs it.
    env.globals.pop("lipsum", None)
    return env


_ENVIRONMENT: _Sandbox | None = None


def _environment() -> _Sandbox:
    global _ENVIRONMENT
    if _ENVIRONMENT is None:
        _ENVIRONMENT = _make_environment()
    return _ENVIRONMENT


# ---------------------------------------------------------------------------------------------
# Compiling and rendering
# ---------------------------------------------------------------------------------------------


def compile_template(text: str, source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox; ``source`` (the model's directory) prefixes errors."""
    try:
        return _environment().from_string(text)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"{source}: the chat template does not compile: {exc}") from exc
    except RecursionError:
        raise ChatTemplateError(
            f"{source}: the chat template does not compile: it is nested too deeply"
        ) from None


def render_template(
    template: jinja2.Template,
    context: dict[str, Any],
    limits: TemplateLimits,
    source: str,
    input_chars: int = 0,
) -> str:
    """Render ``template`` with ``context`` within ``limits``; ``input_chars`` (the size of the
    messages and tools in ``context``) is allowed on top of ``limits.max_chars``.

    Raises :class:`ChatTemplateLimitError` past a limit and :class:`ChatTemplateError` for any
    other failure, each prefixed with ``source``.
    """
    budget = _Budget(limits, limits.max_chars + 2 * max(0, input_chars))
    token = _BUDGET.set(budget)
    stream = template.generate(**context)
    try:
        pieces: list[str] = []
        total = 0
        for piece in stream:
            total += len(piece)
            budget.check_size(total, "wrote a prompt")
            budget.tick()
            pieces.append(piece)
        return "".join(pieces)
    except ChatTemplateLimitError as exc:
        raise ChatTemplateLimitError(f"{source}: {exc}", exc.limit) from None
    except RecursionError:
        # Python's stack ran out before our depth count did (a deep stack to begin with).
        raise ChatTemplateLimitError(f"{source}: {_too_deep(budget.deepest - 1)}", "depth") from None
    except MemoryError:
        raise ChatTemplateLimitError(
            f"{source}: the chat template ran out of memory while rendering a prompt", "size"
        ) from None
    except jinja2.sandbox.SecurityError as exc:
        raise ChatTemplateError(f"{source}: the chat template tried an unsafe operation: {exc}") from exc
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"{source}: the chat template failed: {exc}") from exc
    except ChatTemplateError:
        raise
    except Exception as exc:  # TypeError, ZeroDivisionError...: the template's bug, not ours
        raise ChatTemplateError(f"{source}: the chat template failed: {type(exc).__name__}: {exc}") from exc
    finally:
        stream.close()
        _BUDGET.reset(token)
