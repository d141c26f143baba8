"""JSON Schema -> KBNF grammar (the grammar language of formatron's engine, kbnf).

Why our own compiler rather than formatron's ``json_schema.create_schema``: in formatron 0.5.0 an
optional property still emits its key (``{"a": 1, "b": }`` is what the grammar allows when "b"
is left out), numeric bounds other than 0 are rejected, and keywords it does not know are
silently ignored - so output may not validate. Here every keyword either shapes the grammar or
is refused with a :class:`SchemaError` naming it; the grammar then only admits documents that
validate (a *subset* of the valid documents: see "Deliberate narrowing" below).

Supported: ``type`` (one or a list), ``enum``, ``const``, ``properties`` + ``required`` (fixed
property order, optional properties really optional), ``additionalProperties`` (an object
without ``properties`` gets arbitrary keys whose values follow it), ``items``, ``prefixItems``,
``minItems``, ``maxItems``, ``minLength``, ``maxLength``, ``pattern`` (simple patterns, see
:func:`_json_string_pattern`), ``minimum``, ``maximum``, ``exclusiveMinimum``,
``exclusiveMaximum``, ``anyOf``, ``oneOf`` (as alternatives: its branches should be disjoint,
which pydantic's unions and discriminated unions are), a one-element ``allOf``, local ``$ref``
(``#/$defs/...``, ``#/definitions/...``, recursion allowed). Annotations (``title``,
``description``, ``default``, ``examples``, ``format`` ...) are ignored, as validators do.

Deliberate narrowing (every output is still valid, some valid documents cannot be produced):
compact layout with at most one space after ``{ [ , :`` and before ``} ]``; properties in schema
order; no ``\\u`` escapes in strings; numbers without exponents; no extra properties.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any


class SchemaError(ValueError):
    """The JSON schema is invalid, or uses a keyword the grammar compiler cannot honour.

    (A plain ValueError: :mod:`engine.generation.constraints` reports it as a ConstraintError.)
    """


# Keywords that do not restrict which documents are valid (annotations), or that we handle
# by the way we generate (``additionalProperties`` beyond the listed properties).
_ANNOTATIONS = {
    "title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
    "$schema", "$id", "$anchor", "format", "contentMediaType", "contentEncoding", "discriminator",
}  # fmt: skip
_HANDLED = {
    "type", "enum", "const", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
}  # fmt: skip

# One JSON string character: anything but a quote, backslash or control character, or a short
# escape. jsonschema counts code points after decoding, so each of these counts as one.
_CHAR = r'([^"\\\x00-\x1f]|\\["\\/bfnrt])'
_TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")


# ---------------------------------------------------------------------------------------------
# KBNF quoting
# ---------------------------------------------------------------------------------------------


def _quote(text: str) -> str:
    """``text`` as a KBNF quoted string: kbnf unescapes ``\\\\ \\" \\u{..}`` inside quotes."""
    out = []
    for ch in text:
        if ch in '\\"':
            out.append("\\" + ch)
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            out.append(f"\\u{{{ord(ch):x}}}")
    return '"' + "".join(out) + '"'


def kbnf_literal(text: str) -> str:
    return _quote(text)


def kbnf_regex(pattern: str) -> str:
    """A KBNF regex terminal matching ``pattern`` (Rust ``regex`` syntax)."""
    return "#" + _quote(pattern)


# ---------------------------------------------------------------------------------------------
# Numbers: regular expressions for decimal numbers within bounds
# ---------------------------------------------------------------------------------------------


def _alt(parts: list[str]) -> str:
    parts = [p for p in dict.fromkeys(parts)]
    return parts[0] if len(parts) == 1 else "(" + "|".join(parts) + ")"


def _digit_class(lo: int, hi: int) -> str:
    if lo == hi:
        return str(lo)
    return "[0-9]" if (lo, hi) == (0, 9) else f"[{lo}-{hi}]"


def _same_length(x: str, y: str) -> list[str]:
    """Alternatives matching the digit strings of length ``len(x)`` in ``[x, y]`` (``x <= y``)."""
    if not x:
        return [""]
    if x[0] == y[0]:
        return [x[0] + _alt(_same_length(x[1:], y[1:]))]
    rest = len(x) - 1
    any_rest = f"[0-9]{{{rest}}}" if rest > 1 else ("[0-9]" if rest == 1 else "")
    lo_rest, hi_rest = x[1:], y[1:]
    out = []
    if lo_rest == "0" * rest and hi_rest == "9" * rest:
        return [_digit_class(int(x[0]), int(y[0])) + any_rest]
    first, last = int(x[0]), int(y[0])
    if lo_rest == "0" * rest:
        out.append(_digit_class(first, first) + any_rest)
    else:
        out.append(x[0] + _alt(_same_length(lo_rest, "9" * rest)))
    if last - first >= 2:
        out.append(_digit_class(first + 1, last - 1) + any_rest)
    if hi_rest == "9" * rest:
        out.append(_digit_class(last, last) + any_rest)
    else:
        out.append(y[0] + _alt(_same_length("0" * rest, hi_rest)))
    return out


def nonneg_int_regex(lo: int, hi: int | None) -> str | None:
    """Regex for the integers ``lo <= n <= hi`` (``hi=None``: unbounded), ``lo >= 0``, written
    without leading zeros; ``None`` when the range is empty."""
    if hi is not None and hi < lo:
        return None
    out = []
    length = len(str(lo))
    while hi is None or length <= len(str(hi)):
        start = max(lo, 10 ** (length - 1) if length > 1 else 0)
        if hi is None and start == 10 ** (length - 1) and length > 1:
            out.append(f"[1-9][0-9]{{{length - 1},}}")  # this length and every longer one
            break
        if hi is None and length == 1 and start == 0:
            out.append("(0|[1-9][0-9]*)")
            break
        end = 10**length - 1 if hi is None else min(hi, 10**length - 1)
        out.extend(_same_length(str(start), str(end)))
        length += 1
    return _alt(out)


def _split(value: Decimal) -> tuple[int, str]:
    """A non-negative decimal as (integer part, fraction digits without trailing zeros)."""
    text = format(value, "f")
    whole, _, frac = text.partition(".")
    return int(whole), frac.rstrip("0")


def _fraction(lo: str | None, lo_incl: bool, hi: str | None, hi_incl: bool) -> str | None:
    """Regex for an optional fraction ``(\\.digits)?`` whose value ``0.d`` lies within the bounds.

    ``lo``/``hi`` are fraction digit strings (``None``: no bound on that side; ``hi`` is then
    below 1). Built digit by digit: while the digits so far equal the bound's, the next digit is
    limited by the bound's next digit; once below (or above) it, anything may follow.
    """

    def can_end(i: int, tl: bool, th: bool) -> bool:
        # Ending here gives value = the prefix, which equals lo[:i] (if tl) / hi[:i] (if th).
        if tl and lo is not None and (lo[i:].strip("0") or not lo_incl):
            return False  # prefix < lo, or == lo but lo excluded
        if th and hi is not None and not hi[i:].strip("0") and not hi_incl:
            return False  # prefix == hi but hi excluded
        return True

    def digits(i: int, tl: bool, th: bool, depth: int) -> str | None:
        """Regex for the remaining digits (possibly none) from position ``i``."""
        tl, th = tl and lo is not None, th and hi is not None
        if not tl and not th:
            return "[0-9]*"
        end = max(len(lo or ""), len(hi or ""))
        if i >= end:  # past every bound digit: the bounds continue with zeros
            if tl and th:
                return "0*" if lo_incl and hi_incl else None
            if tl:  # anything, but all zeros means == lo
                return "[0-9]*" if lo_incl else "0*[1-9][0-9]*"
            return "0*" if hi_incl else None
        alts = ["" if can_end(i, tl, th) else None]
        lo_d = int(lo[i]) if tl and i < len(lo) else 0
        hi_d = (int(hi[i]) if i < len(hi) else 0) if th else 9  # past hi's digits: zeros
        groups: dict[tuple[bool, bool], list[int]] = {}
        for c in range(lo_d, hi_d + 1):
            groups.setdefault((tl and c == lo_d, th and c == hi_d), []).append(c)
        for (ntl, nth), cs in groups.items():
            rest = digits(i + 1, ntl, nth, depth + 1)
            if rest is not None:
                alts.append(_digit_class(cs[0], cs[-1]) + (rest if rest == "" else _group(rest)))
        alts = [a for a in alts if a is not None]
        if not alts:
            return None
        return _alt(alts) if len(alts) > 1 else alts[0]

    def _group(r: str) -> str:
        return r if r.startswith("(") and r.endswith(")") or r in ("[0-9]*", "0*") else "(" + r + ")"

    # First fraction digit is required after ".", so "ending" at i=0 means "no fraction".
    nonempty = []
    tl, th = lo is not None, hi is not None
    lo_d = int(lo[0]) if tl and lo else 0
    hi_d = int(hi[0]) if th and hi else (0 if th else 9)
    first: dict[tuple[bool, bool], list[int]] = {}
    for c in range(lo_d, hi_d + 1):
        first.setdefault((tl and c == lo_d, th and c == hi_d), []).append(c)
    for (ntl, nth), cs in first.items():
        rest = digits(1, ntl, nth, 1)
        if rest is not None:
            nonempty.append(_digit_class(cs[0], cs[-1]) + ("" if rest == "" else _group(rest)))
    frac = "\\." + _alt(nonempty) if nonempty else None
    if can_end(0, tl, th):
        return "" if frac is None else f"({frac})?"
    return frac


def _nonneg_number(lo: Decimal, lo_incl: bool, hi: Decimal | None, hi_incl: bool) -> list[str]:
    """Alternatives for decimals ``x >= 0`` within the bounds (lo >= 0)."""
    lo_int, lo_frac = _split(lo)
    out = []
    if hi is not None:
        hi_int, hi_frac = _split(hi)
        if hi < lo or (hi == lo and not (lo_incl and hi_incl)):
            return []
        if lo_int == hi_int:
            f = _fraction(lo_frac, lo_incl, hi_frac, hi_incl)
            return [] if f is None else [str(lo_int) + f]
    f = _fraction(lo_frac, lo_incl, None, True)
    if f is not None:
        out.append(str(lo_int) + f)
    middle_hi = None if hi is None else hi_int - 1
    middle = nonneg_int_regex(lo_int + 1, middle_hi)
    if middle is not None:
        out.append(middle + "(\\.[0-9]+)?")
    if hi is not None:
        f = _fraction(None, True, hi_frac, hi_incl)
        if f is not None:
            out.append(str(hi_int) + f)
    return out


def number_regex(
    minimum: Decimal | None = None,
    maximum: Decimal | None = None,
    *,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
    integer: bool = False,
) -> str:
    """A regex for JSON numbers (no exponent) within the bounds; raises SchemaError if none."""
    zero = Decimal(0)
    if integer:
        # Integers only: turn the bounds into inclusive integer bounds.
        if minimum is not None:
            m = int(minimum.to_integral_value(rounding="ROUND_CEILING"))
            minimum, exclusive_minimum = Decimal(m + (1 if exclusive_minimum and m == minimum else 0)), False
        if maximum is not None:
            m = int(maximum.to_integral_value(rounding="ROUND_FLOOR"))
            maximum, exclusive_maximum = Decimal(m - (1 if exclusive_maximum and m == maximum else 0)), False
    alts: list[str] = []
    # x >= 0
    if maximum is None or maximum > zero or (maximum == zero and not exclusive_maximum):
        lo, lo_incl = (
            (minimum, not exclusive_minimum) if minimum is not None and minimum >= zero else (zero, True)
        )
        if integer:
            r = nonneg_int_regex(int(lo), None if maximum is None else int(maximum))
            alts += [r] if r else []
        else:
            alts += _nonneg_number(lo, lo_incl, maximum, not exclusive_maximum)
    # x < 0: write "-" and the magnitude, which lies in (max(0, -maximum), -minimum]
    if minimum is None or minimum < zero:
        if maximum is not None and maximum < zero:
            m_lo, m_lo_incl = -maximum, not exclusive_maximum
        else:
            m_lo, m_lo_incl = zero, False  # "-0" is 0 and already covered
        m_hi, m_hi_incl = (None, True) if minimum is None else (-minimum, not exclusive_minimum)
        if integer:
            start = int(m_lo) + (0 if m_lo_incl else 1)
            r = nonneg_int_regex(start, None if m_hi is None else int(m_hi))
            if r:
                alts.append("-" + r)
        else:
            alts += ["-" + a for a in _nonneg_number(m_lo, m_lo_incl, m_hi, m_hi_incl)]
    if not alts:
        raise SchemaError(f"no number satisfies minimum {minimum} / maximum {maximum}")
    return _alt(alts)


# ---------------------------------------------------------------------------------------------
# Strings with a pattern
# ---------------------------------------------------------------------------------------------

_PATTERN_OK = re.compile(r"^[\w\s\-\[\]{}()|?*+.^$\\,:@#%&!~=<>/;']*$")


def _json_string_pattern(pattern: str) -> str:
    """The regex for a JSON string's *content* under ``pattern``, anchored at both ends.

    JSON Schema's ``pattern`` is unanchored ("contains a match"); we generate strings that match
    in full, which is a subset. A pattern must not let a raw quote, backslash or control
    character into the JSON text, so only patterns without quote characters and whose ``.``,
    negated classes and ``\\S \\W \\D`` are narrowed to JSON-safe characters are accepted.
    """
    try:
        re.compile(pattern)
    except re.error as exc:
        raise SchemaError(f"pattern {pattern!r} is not a valid regular expression: {exc}") from None
    if not _PATTERN_OK.match(pattern) or "(?" in pattern or re.search(r"\\[1-9pPbBAZzuxU]", pattern):
        raise SchemaError(
            f"pattern {pattern!r} uses a construct the grammar compiler does not support (quotes, "
            "lookaround, backreferences, \\p, \\x or \\u escapes, word boundaries)"
        )
    body = pattern
    if body.startswith("^"):
        body = body[1:]
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    if "^" in body.replace("[^", "").replace("\\^", "") or re.search(r"(?<!\\)\$", body):
        raise SchemaError(f"pattern {pattern!r}: anchors are only supported at the very start and end")
    safe = '^"\\\\\\x00-\\x1f'  # what a JSON string may not contain raw (class-body syntax)
    out, i, in_class = [], 0, False
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            esc = body[i : i + 2]
            repl = {"\\S": f"[{safe}\\s]", "\\W": f"[{safe}\\w]", "\\D": f"[{safe}0-9]"}.get(esc)
            if repl and in_class:
                raise SchemaError(f"pattern {pattern!r}: \\S, \\W and \\D inside [...] are not supported")
            out.append(repl or esc)
            i += 2
            continue
        if not in_class and ch == ".":
            out.append(f"[{safe}]")
        elif not in_class and ch == "[":
            in_class = True
            if body.startswith("[^", i):
                out.append("[" + safe)  # [^...] -> also exclude what JSON forbids raw
                i += 2
                continue
            out.append(ch)
        elif in_class and ch == "]":
            in_class = False
            out.append(ch)
        else:
            out.append(ch)
        i += 1
    # Rust's \d, \w, \s are Unicode-aware like Python's; \s would include control characters.
    return "".join(out).replace("\\s", "[ \\u{a0}\\u{2000}-\\u{200a}\\u{3000}]")


# ---------------------------------------------------------------------------------------------
# The compiler
# ---------------------------------------------------------------------------------------------

_STRING_RE = '"' + _CHAR + '*"'
_NUMBER_RE = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?"
_INTEGER_RE = r"-?(0|[1-9][0-9]*)"
_HEADER = {
    "__ws": '__ws ::= " "?;',
    "__string": f"__string ::= {kbnf_regex(_STRING_RE)};",
    "__number": f"__number ::= {kbnf_regex(_NUMBER_RE)};",
    "__integer": f"__integer ::= {kbnf_regex(_INTEGER_RE)};",
    "__boolean": '__boolean ::= "true" | "false";',
    "__null": '__null ::= "null";',
    "__value": "__value ::= __object | __array | __string | __number | __boolean | __null;",
    "__object": '__object ::= "{" __ws (__string __ws ":" __ws __value (__ws "," __ws __string __ws ":" __ws '
    '__value)*)? __ws "}";',
    "__array": '__array ::= "[" __ws (__value (__ws "," __ws __value)*)? __ws "]";',
}
_DEPENDS = {
    "__value": ["__object", "__array", "__string", "__number", "__boolean", "__null"],
    "__object": ["__string", "__ws", "__value"],
    "__array": ["__ws", "__value"],
}


class _Compiler:
    def __init__(self, root: Any, prefix: str) -> None:
        self.root, self.prefix = root, prefix
        self.rules: list[str] = []
        self.used: set[str] = set()
        self.refs: dict[str, str] = {}
        self.count = 0

    def use(self, name: str) -> str:
        """A shared rule (``__ws``, ``__string`` ...), defined on first use, under our prefix."""
        if name not in self.used:
            self.used.add(name)
            self.rules.append(_HEADER[name].replace("__", self.prefix))  # only names contain "__"
            for dep in _DEPENDS.get(name, ()):
                self.use(dep)
        return self.prefix + name[2:]

    def new(self, hint: str) -> str:
        self.count += 1
        return f"{self.prefix}s{self.count}_{re.sub(r'[^A-Za-z0-9]', '', hint)[:24]}"

    def define(self, name: str, expr: str) -> str:
        self.rules.append(f"{name} ::= {expr};")
        return name

    # -- schema dispatch --------------------------------------------------------------------

    def schema(self, s: Any, hint: str, where: str) -> str:
        """An expression (a nonterminal name or a short sequence) for documents valid under ``s``."""
        if s is True or s == {}:
            return self.use("__value")
        if s is False:
            raise SchemaError(f"{where}: the schema 'false' admits no value")
        if not isinstance(s, Mapping):
            raise SchemaError(f"{where}: a schema must be an object or a boolean, got {type(s).__name__}")
        unknown = sorted(k for k in s if k not in _HANDLED and k not in _ANNOTATIONS)
        if unknown:
            raise SchemaError(f"{where}: unsupported JSON Schema keyword(s): {', '.join(unknown)}")
        s = dict(s)
        if "$ref" in s:
            ref = s.pop("$ref")
            if any(k in s for k in _HANDLED - {"$defs", "definitions"}):
                target = self.resolve(ref, where)
                merged = self.merge(dict(target), s, where)
                return self.schema(merged, hint, where)
            return self.ref(ref, where)
        if "allOf" in s:
            parts = s.pop("allOf")
            for part in parts:
                if isinstance(part, Mapping) and "$ref" in part and len(part) == 1:
                    part = self.resolve(part["$ref"], where)
                s = self.merge(s, part, where)
            return self.schema(s, hint, where)
        for key in ("anyOf", "oneOf"):
            if key in s:
                branches = s.pop(key)
                if not isinstance(branches, list) or not branches:
                    raise SchemaError(f"{where}: {key} must be a non-empty array")
                alts = [
                    self.schema(
                        self.merge(dict(s), b, where) if isinstance(b, Mapping) else b,
                        hint,
                        f"{where}/{key}/{i}",
                    )
                    for i, b in enumerate(branches)
                ]
                return self.define(self.new(hint), " | ".join(alts))
        if "const" in s or "enum" in s:
            values = [s["const"]] if "const" in s else s["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"{where}: enum must be a non-empty array")
            texts = [
                json.dumps(v, ensure_ascii=False, separators=(",", ":")) for v in values if self.fits(v, s)
            ]
            if not texts:
                raise SchemaError(f"{where}: no value of enum/const matches the other keywords")
            return self.define(self.new(hint), " | ".join(kbnf_literal(t) for t in dict.fromkeys(texts)))
        types = s.get("type")
        if types is None:
            types = self.implied_types(s)
        if isinstance(types, str):
            types = [types]
        bad = [t for t in types if t not in _TYPES]
        if bad:
            raise SchemaError(f"{where}: unknown type(s) {bad}")
        if "integer" in types and "number" in types:
            types = [t for t in types if t != "integer"]
        alts = [self.typed(t, s, hint, where) for t in dict.fromkeys(types)]
        return alts[0] if len(alts) == 1 else self.define(self.new(hint), " | ".join(alts))

    def implied_types(self, s: Mapping) -> list[str]:
        keys = set(s)
        if keys & {"properties", "additionalProperties", "required"}:
            return ["object"]
        if keys & {"items", "prefixItems", "minItems", "maxItems"}:
            return ["array"]
        if keys & {"minLength", "maxLength", "pattern"}:
            return ["string"]
        if keys & {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}:
            return ["number"]
        return list(_TYPES)

    def fits(self, value: Any, s: Mapping) -> bool:
        """Whether an enum value is allowed by ``type`` next to the enum (jsonschema checks both)."""
        t = s.get("type")
        if t is None:
            return True
        kinds = {t} if isinstance(t, str) else set(t)
        py = {
            "null": value is None,
            "boolean": isinstance(value, bool),
            "integer": (isinstance(value, int) and not isinstance(value, bool))
            or (isinstance(value, float) and value.is_integer()),
            "number": isinstance(value, int | float) and not isinstance(value, bool),
            "string": isinstance(value, str),
            "array": isinstance(value, list),
            "object": isinstance(value, dict),
        }
        return any(py.get(k, False) for k in kinds)

    def merge(self, a: dict, b: Any, where: str) -> dict:
        if not isinstance(b, Mapping):
            raise SchemaError(f"{where}: allOf/anyOf entries must be objects")
        out = dict(a)
        for k, v in b.items():
            if k in out and out[k] != v and k not in _ANNOTATIONS:
                raise SchemaError(f"{where}: cannot combine two different '{k}' constraints")
            out[k] = v
        return out

    def resolve(self, ref: str, where: str) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"{where}: only local references ('#/...') are supported, got {ref!r}")
        node = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, Mapping) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise SchemaError(f"{where}: reference {ref!r} does not resolve")
        return node

    def ref(self, ref: str, where: str) -> str:
        if ref not in self.refs:
            name = self.new("ref_" + ref.rsplit("/", 1)[-1])
            self.refs[ref] = name  # registered before compiling: recursive schemas refer back
            self.define(name, self.schema(self.resolve(ref, where), name, ref))
        return self.refs[ref]

    # -- one type ---------------------------------------------------------------------------

    def typed(self, t: str, s: Mapping, hint: str, where: str) -> str:
        if t == "null":
            return self.use("__null")
        if t == "boolean":
            return self.use("__boolean")
        if t in ("number", "integer"):
            return self.number(s, t == "integer", hint, where)
        if t == "string":
            return self.string(s, hint, where)
        if t == "array":
            return self.array(s, hint, where)
        return self.object(s, hint, where)

    def number(self, s: Mapping, integer: bool, hint: str, where: str) -> str:
        bounds = {}
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if key in s:
                v = s[key]
                if isinstance(v, bool) or not isinstance(v, int | float):
                    raise SchemaError(f"{where}: {key} must be a number")
                bounds[key] = Decimal(repr(v)) if isinstance(v, float) else Decimal(v)
        if not bounds:
            return self.use("__integer" if integer else "__number")
        lo, lo_excl = bounds.get("minimum"), False
        if "exclusiveMinimum" in bounds and (lo is None or bounds["exclusiveMinimum"] >= lo):
            lo, lo_excl = bounds["exclusiveMinimum"], True
        hi, hi_excl = bounds.get("maximum"), False
        if "exclusiveMaximum" in bounds and (hi is None or bounds["exclusiveMaximum"] <= hi):
            hi, hi_excl = bounds["exclusiveMaximum"], True
        try:
            pattern = number_regex(
                lo, hi, exclusive_minimum=lo_excl, exclusive_maximum=hi_excl, integer=integer
            )
        except SchemaError as exc:
            raise SchemaError(f"{where}: {exc}") from None
        return self.define(self.new(hint + "_num"), kbnf_regex(pattern))

    def string(self, s: Mapping, hint: str, where: str) -> str:
        lo, hi, pattern = s.get("minLength"), s.get("maxLength"), s.get("pattern")
        if pattern is not None:
            if lo is not None or hi is not None:
                raise SchemaError(f"{where}: pattern together with minLength/maxLength is not supported")
            return self.define(self.new(hint + "_str"), kbnf_regex('"' + _json_string_pattern(pattern) + '"'))
        if lo is None and hi is None:
            return self.use("__string")
        lo = int(lo or 0)
        if hi is not None and int(hi) < lo:
            raise SchemaError(f"{where}: maxLength {hi} < minLength {lo}")
        rep = f"{{{lo},}}" if hi is None else f"{{{lo},{int(hi)}}}"
        return self.define(self.new(hint + "_str"), kbnf_regex('"' + _CHAR + rep + '"'))

    def array(self, s: Mapping, hint: str, where: str) -> str:
        ws = self.use("__ws")
        prefix = s.get("prefixItems") or []
        items = s.get("items", True)
        lo, hi = int(s.get("minItems", 0)), s.get("maxItems")
        hi = None if hi is None else int(hi)
        if items is False:
            hi = len(prefix) if hi is None else min(hi, len(prefix))
        if hi is not None and hi < lo:
            raise SchemaError(f"{where}: maxItems {hi} < minItems {lo}")
        slots = [self.schema(p, hint + f"_{i}", f"{where}/prefixItems/{i}") for i, p in enumerate(prefix)]
        item = self.schema(items, hint + "_item", f"{where}/items") if items is not False else None
        if item is None and lo > len(prefix):
            raise SchemaError(f"{where}: minItems {lo} needs more items than prefixItems allows")

        def slot(i: int) -> str:
            return slots[i] if i < len(slots) else item  # type: ignore[return-value]

        # Elements 0..lo-1 are required; then optional ones nested so commas stay right.
        required = [slot(i) for i in range(lo)]
        tail = ""
        if hi is None:
            if len(slots) > lo:
                tail = self.optional_chain([slot(i) for i in range(lo, len(slots))], item, ws)
            else:
                tail = f'({ws} "," {ws} {item})*' if item else ""
        else:
            tail = self.optional_chain([slot(i) for i in range(lo, hi)], None, ws)
        if required:
            body = f' {ws} "," {ws} '.join(required) + (" " + tail if tail else "")
        else:
            elems = [slot(i) for i in range(lo, hi if hi is not None else len(slots))]
            body = self.first_optional(elems, item, hi, ws)
        return self.define(self.new(hint + "_arr"), " ".join(p for p in ('"["', ws, body, ws, '"]"') if p))

    def optional_chain(self, elems: list[str], repeat: str | None, ws: str) -> str:
        """``(, e1 (, e2 (, e3 (, r)* )? )? )?`` - each optional element only after the previous."""
        inner = f'({ws} "," {ws} {repeat})*' if repeat else ""
        for e in reversed(elems):
            inner = f'({ws} "," {ws} {e}{" " + inner if inner else ""})?'
        return inner

    def first_optional(self, elems: list[str], repeat: str | None, hi: int | None, ws: str) -> str:
        """No element required: ``(e1 (, e2 ...)?)?`` or ``(r (, r)*)?``."""
        if hi == 0:
            return ""
        if elems:
            rest = self.optional_chain(elems[1:], repeat if hi is None else None, ws)
            return f"({elems[0]}{' ' + rest if rest else ''})?"
        if repeat:
            return f'({repeat} ({ws} "," {ws} {repeat})*)?'
        return ""

    def object(self, s: Mapping, hint: str, where: str) -> str:
        ws = self.use("__ws")
        props = s.get("properties")
        required = list(s.get("required", []))
        if props is None:
            for r in required:
                raise SchemaError(f"{where}: required property {r!r} is not listed in properties")
            extra = s.get("additionalProperties", True)
            if extra is False:
                return self.define(self.new(hint + "_obj"), f'"{{" {ws} "}}"')
            value = self.schema(extra, hint + "_value", f"{where}/additionalProperties")
            key = self.use("__string")
            member = f'{key} {ws} ":" {ws} {value}'
            return self.define(
                self.new(hint + "_obj"), f'"{{" {ws} ({member} ({ws} "," {ws} {member})*)? {ws} "}}"'
            )
        if not isinstance(props, Mapping):
            raise SchemaError(f"{where}: properties must be an object")
        missing = [r for r in required if r not in props]
        if missing:
            raise SchemaError(f"{where}: required propert(ies) {missing} are not listed in properties")
        members = []
        for name, sub in props.items():
            value = self.schema(sub, f"{hint}_{name}", f"{where}/properties/{name}")
            members.append(
                (
                    f'{kbnf_literal(json.dumps(name, ensure_ascii=False))} {ws} ":" {ws} {value}',
                    name in required,
                )
            )
        # rest_i: members i.. after at least one member was written (each needs a leading comma);
        # first_i: members i.. when none was written yet. Optional members may be skipped.
        base = self.new(hint + "_obj")
        n = len(members)
        for i in range(n - 1, -1, -1):
            m, req = members[i]
            nxt = f" {base}_rest{i + 1}" if i + 1 < n else ""
            item = f'{ws} "," {ws} {m}'
            self.define(f"{base}_rest{i}", f"{item}{nxt}" if req else f"({item})?{nxt}")
        for i in range(n - 1, -1, -1):
            m, req = members[i]
            after = f" {base}_rest{i + 1}" if i + 1 < n else ""
            if req:
                self.define(f"{base}_first{i}", f"{m}{after}")
            elif i + 1 < n:
                self.define(f"{base}_first{i}", f"{m}{after} | {base}_first{i + 1}")
            else:
                self.define(f"{base}_first{i}", f"({m})?")
        body = f"{base}_first0" if n else ""
        return self.define(base, " ".join(p for p in ('"{"', ws, body, ws, '"}"') if p))


def check_schema(schema: Any) -> None:
    """Raise SchemaError unless ``schema`` is a valid JSON Schema (by its declared draft)."""
    import jsonschema
    import jsonschema.exceptions

    if not isinstance(schema, Mapping | bool):
        raise SchemaError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(
            schema
        )
    except jsonschema.exceptions.SchemaError as exc:
        path = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise SchemaError(f"invalid JSON schema at {path}: {exc.message}") from None


def schema_to_kbnf(schema: Any, start: str = "start", prefix: str = "__json_") -> str:
    """KBNF rules whose ``start`` nonterminal derives exactly the documents we generate for
    ``schema``; every other nonterminal's name begins with ``prefix``."""
    check_schema(schema)
    c = _Compiler(schema, prefix)
    top = c.schema(schema, "root", "#")
    return "\n".join([f"{start} ::= {top};", *c.rules])
