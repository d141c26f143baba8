"""Constrained output: a per-job filter that masks the logits before sampling.

A :class:`Constraint` says what the output must look like - a JSON schema (or a pydantic model),
a regular expression, or a grammar in KBNF, formatron's grammar language - independently of any
model. :meth:`Constraint.start` binds it to a tokenizer's vocabulary and returns a
:class:`ConstraintState`, the per-job filter the generator drives::

    mask = state.allowed(logits_size, stop_ids)   # bool [vocab]; None: nothing can follow
    token = sampler.sample(logits, ..., mask=mask)
    if not state.fits(token):                     # the budget left could not finish after it
        token = sampler.sample(logits, ..., mask=state.closing_mask(logits_size, stop_ids))
    state.advance(token, is_stop=token in stop_ids)
    state.complete                                # the output is finished and valid

formatron is the engine: a ``formatron.formatter.Formatter`` per job, built from a
``FormatterBuilder`` whose extractors carry our grammar, running on kbnf (formatron's Earley
engine in Rust), which computes the set of allowed tokens incrementally. What is ours:

* the JSON-schema compiler (:mod:`engine.generation.json_schema_grammar`; formatron 0.5's own one
  lets invalid documents through - see that module);
* the vocabulary: each token's bytes read off the tokenizer's own decoder settings, special
  tokens left out (they decode to nothing, so the grammar would see text the user never gets);
* the end of the output. kbnf stops at the *earliest* point where the grammar is complete, so a
  regex like ``[a-z]+`` would end after one token. For regexes and grammars we therefore append
  an end mark (``U+10FFFF``) that only the model's stop tokens can produce: the model itself
  decides when to stop, and it may only stop where the text is complete. A JSON document ends
  by itself at its last bracket, so JSON constraints have no end mark and finish right there.
* the token budget. A job has ``max_new_tokens``; a model that keeps writing inside a long array
  would reach it mid-document and the reply would be invalid. With a budget, each step also
  finds a short way to finish from where the output is (:func:`closing_text`: a greedy walk of a
  copy of the kbnf engine, so the grammar itself vouches for it) and the fewest tokens that write
  it (:func:`token_costs`). Once the budget left is no more than that, the mask admits only the
  tokens on such a path (:meth:`ConstraintState.allowed`); near that point a sampled token that
  would leave too little room to finish is refused (:meth:`ConstraintState.fits`) and the draw is
  repeated among the closing tokens. A reply that had room to be valid therefore is valid.
* cost: building a kbnf engine for a grammar and a 50k-token vocabulary takes from 0.1 s to a
  few seconds (it pre-computes token tables), so engines are built once per (constraint,
  vocabulary) and copied per job (about a millisecond). The next step's mask is computed on a
  worker thread right after a token is accepted, overlapping the next forward pass (torch
  releases the GIL inside its kernels). kbnf's own mask cache is off: it can serve one parser
  state another state's mask (engine/compat/kbnf_engine.py).
* kbnf's failures end only their job: a Rust panic (pyo3's PanicException, a BaseException)
  becomes a :class:`ConstraintError` at every call into the engine (:func:`_engine_failures`).
"""

from __future__ import annotations

import copy
import json
import logging
import re
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.compat.kbnf_engine import engine_config
from engine.errors import EngineError

END_MARK = "\U0010ffff"  # stands for "the model stopped" inside a grammar; see the module doc
_END_LITERAL = '"\\u{10ffff}"'  # END_MARK in KBNF
_END_LEAD_BYTE = 0xF4  # first UTF-8 byte of END_MARK: tokens containing it are left out
_TEMPLATES_PER_VOCAB = 32
_MAX_CLOSING_BYTES = 512  # no closing found within this many bytes: no budget steering
_MAX_TOKEN_BYTES = 64  # longer tokens are never needed to write a closing text cheaply
# A sampled token is checked against the budget (:meth:`ConstraintState.fits`) once the budget
# left is within twice the closing's length plus this: one token can open a structure whose
# required parts lengthen the closing by many tokens (",{" in an array of objects).
_PROBE_SLACK = 16
# Far from the end of the budget the closing cannot matter yet: it is refreshed only this often
# there (a walk over a copy of the engine), and at every step once the end comes into view.
_REPLAN_EVERY = 16

_log = logging.getLogger(__name__)


class ConstraintError(EngineError):
    """A constraint is invalid (bad schema, regex or grammar) or cannot be satisfied."""


# ---------------------------------------------------------------------------------------------
# Vocabulary: what bytes each token stands for
# ---------------------------------------------------------------------------------------------


def _gpt2_byte_decoder() -> dict[str, int]:
    """Byte-level BPE writes each byte as a printable character; this maps them back."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_kinds(tokenizer_json: Mapping | None) -> tuple[set[str], bool]:
    """The decoder step types of a tokenizer.json, and whether "▁" is decoded as a space."""
    kinds: set[str] = set()
    metaspace = False
    stack = [tokenizer_json.get("decoder")] if tokenizer_json else []
    while stack:
        d = stack.pop()
        if not isinstance(d, Mapping):
            continue
        kinds.add(str(d.get("type")))
        stack.extend(d.get("decoders") or [])
        if d.get("type") == "Metaspace":
            metaspace = True
        if (
            d.get("type") == "Replace"
            and (d.get("pattern") or {}).get("String") == "▁"
            and d.get("content") == " "
        ):
            metaspace = True
    return kinds, metaspace


def token_bytes(tokenizer: Any) -> dict[int, bytes]:
    """Every non-special token id -> the bytes it adds to the output.

    Read off the tokenizer's decoder (tokenizer.json) rather than guessed: byte-level BPE
    (GPT-2, Llama 3, SmolLM, Qwen) maps characters back to bytes; SentencePiece-style tokenizers
    (Llama 2, Gemma) write spaces as "▁" and unknown bytes as ``<0xHH>`` pieces.
    """
    data = None
    source = Path(getattr(tokenizer, "source", "") or "/nonexistent") / "tokenizer.json"
    if source.is_file():
        try:
            data = json.loads(source.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = None
    kinds, metaspace = _decoder_kinds(data)
    strings = {i: tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)}
    if not kinds:  # no decoder settings: recognise byte-level BPE by its "Ġ" (a space)
        with_g = sum(1 for s in strings.values() if s and "Ġ" in s)
        kinds = {"ByteLevel"} if with_g > len(strings) // 10 else set()
        metaspace = sum(1 for s in strings.values() if s and "▁" in s) > len(strings) // 10
    special = set(tokenizer.special_ids)
    byte_level = "ByteLevel" in kinds
    byte_fallback = "ByteFallback" in kinds
    table = _gpt2_byte_decoder() if byte_level else {}
    hex_piece = re.compile(r"<0x([0-9A-Fa-f]{2})>")
    out: dict[int, bytes] = {}
    for i, s in strings.items():
        if s is None or i in special:
            continue
        if byte_level:
            try:
                b = bytes(table[c] for c in s)
            except KeyError:  # an added (non-special) token written as plain text
                b = s.encode("utf-8")
        elif byte_fallback and (m := hex_piece.fullmatch(s)):
            b = bytes([int(m.group(1), 16)])
        else:
            b = (s.replace("▁", " ") if metaspace else s).encode("utf-8")
        if b and _END_LEAD_BYTE not in b:
            out[i] = b
    return out


_MISSING_BYTES_WARNING = "The following bytes are not present in any token"


class _MissingBytesFilter(logging.Filter):
    """Keeps kbnf's "bytes not present in any token" warning off the user's terminal.

    kbnf (Rust, logging through pyo3-log to the Python logger ``kbnf.vocabulary``) warns whenever
    some byte value has no token. Real tokenizers do lack some: SmolLM2's has no token for 13
    of them (a few ASCII control characters, and 0xC0 0xC1 0xF5-0xF7, which never occur in
    UTF-8). The vocabulary we build is right, so the warning is noise on every constrained run; a
    grammar that needs such a byte ends its job with a clear "cannot be satisfied" error. The
    message goes to this module's debug log instead; kbnf's other warnings pass.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(_MISSING_BYTES_WARNING):
            _log.debug("kbnf: %s", message.split(". ", 1)[0])
            return False
        return True


_MISSING_BYTES_FILTER = _MissingBytesFilter()


def _quiet_kbnf_vocabulary_warning() -> None:
    # A logger filter (not a level): it applies however the application configures handlers,
    # and only to this one message. addFilter ignores a filter that is already installed.
    logging.getLogger("kbnf.vocabulary").addFilter(_MISSING_BYTES_FILTER)


class ConstraintVocabulary:
    """A tokenizer's vocabulary as kbnf sees it, plus the cached engines built on it."""

    def __init__(
        self, token_bytes: Mapping[int, bytes], size: int, decode: Callable[[list[int]], str]
    ) -> None:
        import kbnf

        self.size = size  # ids 0 .. size-1 are the tokenizer's
        self.end_id = size  # a pseudo token producing END_MARK: the model's stop tokens map to it
        tokens = {i: kbnf.Token(b) for i, b in token_bytes.items() if i < size}
        tokens[self.end_id] = kbnf.Token(END_MARK.encode("utf-8"))
        names = {i: repr(b) for i, b in token_bytes.items() if i < size}
        names[self.end_id] = "<end>"
        _quiet_kbnf_vocabulary_warning()
        self.kbnf = kbnf.Vocabulary(tokens, names)
        # For closing the output within a budget: which ids write exactly these bytes, and the
        # bytes a closing text may use (those with a one-byte token, so it can always be written).
        self.ids_by_bytes: dict[bytes, list[int]] = {}
        for i, b in token_bytes.items():
            if i < size and len(b) <= _MAX_TOKEN_BYTES:
                self.ids_by_bytes.setdefault(b, []).append(i)
        self.max_token_bytes = max((len(b) for b in self.ids_by_bytes), default=1)
        self.closing_alphabet = closing_alphabet({b[0] for b in self.ids_by_bytes if len(b) == 1})
        self._decode = decode
        self._templates: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def decode(self, ids: list[int]) -> str:
        return self._decode([i for i in ids if i < self.size])

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> ConstraintVocabulary:
        """One per tokenizer object (building it takes a moment for a large vocabulary)."""
        with _vocab_lock:
            vocab = _vocabularies.get(tokenizer)
            if vocab is None:
                vocab = cls(token_bytes(tokenizer), tokenizer.vocab_size, tokenizer.decode)
                _vocabularies[tokenizer] = vocab
            return vocab

    def formatter(self, constraint: Constraint) -> Any:
        """A fresh formatron Formatter for ``constraint``: a copy of a cached template."""
        key = constraint.key
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
        if template is None:
            template = constraint._build(self)
            with self._lock:
                self._templates[key] = template
                while len(self._templates) > _TEMPLATES_PER_VOCAB:
                    self._templates.popitem(last=False)
        # Deep (the kbnf engine, the accepted-token list), but sharing this vocabulary, which
        # the decode callback refers to and which kbnf cannot copy.
        return copy.deepcopy(template, {id(self): self})


_vocabularies: weakref.WeakKeyDictionary[Any, ConstraintVocabulary] = weakref.WeakKeyDictionary()
_vocab_lock = threading.Lock()


def _byte_vocabulary() -> ConstraintVocabulary:
    """256 one-byte tokens: enough to check that a grammar compiles, before any model is loaded."""
    global _BYTE_VOCAB
    if _BYTE_VOCAB is None:
        _BYTE_VOCAB = ConstraintVocabulary(
            {b: bytes([b]) for b in range(256) if b != _END_LEAD_BYTE},
            256,
            lambda ids: bytes(ids).decode("utf-8", "replace"),
        )
    return _BYTE_VOCAB


_BYTE_VOCAB: ConstraintVocabulary | None = None


# ---------------------------------------------------------------------------------------------
# formatron glue
# ---------------------------------------------------------------------------------------------


def _formatron() -> Any:
    from engine.compat.formatron_pydantic import import_formatron

    return import_formatron()


def _rules_extractor(
    nonterminal: str, rules: Callable[[str], str], parse: Callable[[str], Any], capture: str | None
) -> Any:
    """A formatron extractor whose grammar is ``rules(its nonterminal)``; on completion it
    captures ``parse(text)`` (formatron calls ``extract`` with the whole output)."""
    from formatron.extractor import NonterminalExtractor

    class RulesExtractor(NonterminalExtractor):
        def extract(self, input_str: str) -> tuple[str, Any] | None:
            try:
                return "", parse(input_str)
            except ValueError:
                return None

        @property
        def kbnf_definition(self) -> str:
            return rules(self.nonterminal)

    return RulesExtractor(nonterminal, capture)


_KBNF_TOKEN = re.compile(
    r"""(?P<str>\#?(?:ex|substrs|e)?(?:"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'))"""
    r"""|(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<bang>!?)|(?P<other>\s+|::=|.)""",
    re.S,
)


def prefix_kbnf_names(grammar: str, prefix: str) -> str:
    """Rename every nonterminal of a KBNF grammar to ``prefix + name`` (strings and regexes and
    built-ins like ``except!`` untouched), so it can be embedded next to formatron's rules."""
    out = []
    for m in _KBNF_TOKEN.finditer(grammar):
        if m.group("name") and not m.group("bang"):
            out.append(prefix + m.group("name"))
        else:
            out.append(m.group(0))
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Constraints
# ---------------------------------------------------------------------------------------------


class Constraint:
    """What the output must look like. Build with :func:`json_schema`, :func:`regex` or
    :func:`grammar`; the constructor compiles and checks it, so a bad one fails here, early."""

    kind: str = "constraint"
    ends_with_stop = True  # the model ends the output with a stop token (see module doc)

    def __init__(self, rules: str, description: str) -> None:
        self.rules = rules  # KBNF defining the nonterminal "value" (other names prefixed "u_")
        self.description = description
        self.key = f"{self.kind}\n{self.ends_with_stop}\n{rules}"
        _byte_vocabulary().formatter(self)  # compile now: syntax errors surface at construction

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.description[:60]!r}>"

    def parse(self, text: str) -> Any:
        """The finished output as a value (JSON: the parsed document; regex/grammar: the text)."""
        return text

    def _build(self, vocab: ConstraintVocabulary) -> Any:
        fm = _formatron()
        builder = fm.FormatterBuilder()
        # Our rules define "value"; formatron names the extractor's own nonterminal.
        main = str(
            builder.extractor(
                lambda nt: _rules_extractor(
                    nt, lambda me: f"{me} ::= value;\n{self.rules}", self.parse, "value"
                )
            )
        )
        if self.ends_with_stop:
            main += str(
                builder.extractor(
                    lambda nt: _rules_extractor(nt, lambda me: f"{me} ::= {_END_LITERAL};", str, None)
                )
            )
        builder.append_str(main)
        with _engine_failures(self):  # a panic while building is kbnf's failure, not the grammar's
            try:
                return builder.build(vocab.kbnf, vocab.decode, engine_config())
            except Exception as exc:  # kbnf raises plain ValueError/RuntimeError with its parser message
                raise ConstraintError(f"{self.kind} constraint does not compile: {exc}") from exc

    def start(self, tokenizer: Any, prefetch: bool = True, budget: int | None = None) -> ConstraintState:
        """A fresh per-job state over ``tokenizer``'s vocabulary. ``prefetch``: compute each next
        mask on a worker thread (overlapping the model's step; off: in the step). ``budget``:
        how many tokens the job may generate; the output is then steered to finish within it."""
        vocab = ConstraintVocabulary.for_tokenizer(tokenizer)
        with _engine_failures(self):
            formatter = vocab.formatter(self)
        return ConstraintState(self, vocab, formatter, prefetch, budget)


class JsonSchemaConstraint(Constraint):
    kind = "json_schema"
    ends_with_stop = False  # "}" or "]" ends the document

    def __init__(self, schema: Any) -> None:
        from engine.generation.json_schema_grammar import SchemaError, schema_to_kbnf

        self.schema = schema
        try:
            rules = schema_to_kbnf(schema, start="value", prefix="u_")
        except SchemaError as exc:
            raise ConstraintError(str(exc)) from None
        super().__init__(rules, json.dumps(schema, sort_keys=True))

    def parse(self, text: str) -> Any:
        return json.loads(text)


class RegexConstraint(Constraint):
    kind = "regex"

    def __init__(self, pattern: str) -> None:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConstraintError(f"invalid regular expression {pattern!r}: {exc}") from None
        if re.search(r"\(\?<?[=!]|\\[1-9]|\(\?P=", pattern):
            raise ConstraintError(
                f"regular expression {pattern!r}: lookaround and backreferences are not supported"
            )
        self.pattern = pattern
        from engine.generation.json_schema_grammar import kbnf_regex

        super().__init__(f"value ::= {kbnf_regex(pattern)};", pattern)


class GrammarConstraint(Constraint):
    kind = "grammar"

    def __init__(self, kbnf_grammar: str, start: str = "start") -> None:
        if not re.search(rf"(^|[\s;]){re.escape(start)}\s*::=", kbnf_grammar):
            raise ConstraintError(f"grammar has no rule for its start symbol {start!r}")
        self.grammar = kbnf_grammar
        rules = f"value ::= u_{start};\n" + prefix_kbnf_names(kbnf_grammar, "u_")
        super().__init__(rules, kbnf_grammar)


def json_schema(schema: Any) -> JsonSchemaConstraint:
    """Output one JSON document valid under ``schema``: a dict (or bool), JSON text, or a
    pydantic model class (its ``model_json_schema()``)."""
    if isinstance(schema, str | bytes):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from None
    elif isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    return JsonSchemaConstraint(schema)


def regex(pattern: str) -> RegexConstraint:
    """Output text that matches ``pattern`` in full (``re.fullmatch``); no lookaround."""
    return RegexConstraint(pattern)


def grammar(kbnf_grammar: str, start: str = "start") -> GrammarConstraint:
    """Output text derived from ``start`` in a KBNF grammar (formatron's grammar language)."""
    return GrammarConstraint(kbnf_grammar, start)


# ---------------------------------------------------------------------------------------------
# Finishing within the budget
# ---------------------------------------------------------------------------------------------

# Preference order for the bytes of a closing text. Closers first, so strings, arrays and
# objects end as soon as the grammar lets them; then separators (a required member or item is
# still missing); then digits ("1" before "0": it ends bounded fractions like 0.0*[1-9] at once)
# and letters (key names, enum values, literals); openers last, as they only lead deeper.
_CLOSING_PREFERENCE = (
    b'"]},:'
    + b"1023456789"
    + bytes(range(ord("a"), ord("z") + 1))
    + bytes(range(ord("A"), ord("Z") + 1))
    + b".-_{[ "
)
_REPEAT_LIMIT = 8  # the same byte this many times in a row: the walk is looping; demote it


def closing_alphabet(single_byte_tokens: Iterable[int]) -> bytes:
    """The bytes a closing text is built from, in the order they are tried: every byte that is a
    token by itself (so any closing text can be written), the preferred ones first."""
    have = set(single_byte_tokens)
    rest = [*range(0x21, 0x7F), 0x0A, 0x09, *range(0x80, 0x100), *range(0x00, 0x20), 0x7F]
    return bytes(b for b in dict.fromkeys([*_CLOSING_PREFERENCE, *rest]) if b in have)


def _ends_here(engine: Any, end_id: int | None) -> bool:
    """Whether the output may end at ``engine``'s state (``end_id``: the end-mark token that a
    stop token stands for, for constraints the model ends; ``None``: the grammar ends itself)."""
    if end_id is None:
        return bool(engine.is_finished())
    trial = copy.copy(engine)
    try:
        trial.try_accept_new_token(end_id)
    except ValueError:
        return False
    return bool(trial.is_finished())


def _next_byte(trial: Any, order: list[int], end_id: int | None) -> tuple[int, Any] | None:
    """The byte a closing walk takes from ``trial``'s state, and the state after it.

    For JSON (``end_id`` None) the first acceptable byte of ``order``: closers come first there,
    so the walk leaves each string, array and object as soon as the grammar allows. Regexes and
    grammars have no such fixed closers (``[a-z ,]+\\.`` ends with "."), so among the acceptable
    bytes one after which the output may end is taken first.
    """
    if end_id is None:
        for b in order:
            try:
                trial.try_accept_new_bytes(bytes((b,)))  # a rejected byte leaves the state unchanged
            except ValueError:
                continue
            return b, trial
        return None
    first: tuple[int, Any] | None = None
    for b in order:
        after = copy.copy(trial)
        try:
            after.try_accept_new_bytes(bytes((b,)))
        except ValueError:
            continue
        if _ends_here(after, end_id):
            return b, after
        if first is None:
            first = (b, after)
    return first


def closing_text(
    engine: Any, alphabet: bytes, end_id: int | None = None, max_bytes: int = _MAX_CLOSING_BYTES
) -> bytes | None:
    """A short text that completes the output from ``engine``'s state (a kbnf engine, left
    unchanged), or ``None`` if none is found within ``max_bytes``.

    kbnf does not expose its parse state, so the text is found by walking a copy of the engine
    one byte at a time (:func:`_next_byte`). That makes the text valid by construction, for any
    grammar, and deterministic in the state: a model that writes a closing's first bytes is left
    with the rest of that same closing. It is short rather than shortest (the first acceptable
    letter may start an optional key); the budget only needs a way to finish that exists and is
    not much longer than the best one.
    """
    trial = copy.copy(engine)
    order = list(alphabet)
    out = bytearray()
    last, repeats = -1, 0
    while not _ends_here(trial, end_id):
        if len(out) >= max_bytes:
            return None
        step = _next_byte(trial, order, end_id)
        if step is None:
            return None
        b, trial = step
        out.append(b)
        repeats = repeats + 1 if b == last else 1
        last = b
        if repeats >= _REPEAT_LIMIT:  # e.g. "a" forever under the pattern a+@: try others first
            order.remove(b)
            order.append(b)
            repeats = 0
    return bytes(out)


def token_costs(text: bytes, ids_by_bytes: Mapping[bytes, Any], max_token_bytes: int) -> list[int]:
    """``costs[i]``: the fewest tokens that write ``text[i:]`` exactly (``costs[len(text)] == 0``;
    a position no tokens can continue from costs more than ``len(text)``)."""
    n = len(text)
    unreachable = n + 1
    costs = [unreachable] * (n + 1)
    costs[n] = 0
    for i in range(n - 1, -1, -1):
        best = unreachable
        for j in range(i + 1, min(n, i + max_token_bytes) + 1):
            if costs[j] + 1 < best and text[i:j] in ids_by_bytes:
                best = costs[j] + 1
        costs[i] = best
    return costs


@dataclass(frozen=True)
class ClosingPlan:
    """The way to finish the output from the current state: ``text``, the fewest tokens to write
    each suffix of it (``costs``), and whether a stop token must follow (regex and grammar
    constraints end when the model stops; JSON ends at its last bracket)."""

    text: bytes
    costs: list[int]
    stop_after: bool

    @property
    def tokens(self) -> int:
        """Tokens it takes to finish, the stop token included."""
        return self.costs[0] + int(self.stop_after)


# ---------------------------------------------------------------------------------------------
# Per-job state
# ---------------------------------------------------------------------------------------------

_executor: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="constraint-mask")
    return _executor


@contextmanager
def _engine_failures(constraint: Constraint) -> Iterator[None]:
    """Report a failure inside kbnf as a ConstraintError for this one job. kbnf is Rust: an
    internal error there arrives as pyo3's PanicException, which derives from BaseException, so
    without this a single job's grammar could bring down the whole generator loop. (kbnf 0.4.2
    panics - "slice index starts at 9 but ends at 7" - when a token's first byte is accepted and
    a later one rejected; see engine/compat/kbnf_engine.py for how a wrong mask led there.)"""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit, ConstraintError):
        raise
    except BaseException as exc:  # noqa: BLE001 - see above
        raise ConstraintError(
            f"the {constraint.kind} constraint engine (kbnf) failed: {type(exc).__name__}: {exc}; "
            "this reply was ended, the next one starts afresh"
        ) from exc


class ConstraintState:
    """One job's progress through its constraint (not thread-safe: one generator drives it)."""

    def __init__(
        self,
        constraint: Constraint,
        vocab: ConstraintVocabulary,
        formatter: Any,
        prefetch: bool,
        budget: int | None = None,
    ) -> None:
        self.constraint, self.vocab, self.formatter = constraint, vocab, formatter
        # formatron has no public accessor for the kbnf engine; its own integrations use this one.
        self._engine = formatter._engine
        self._bits = torch.zeros((vocab.end_id + 32) // 32, dtype=torch.int32)
        self._prefetch = prefetch
        self._pending: Future | None = None
        self.tokens: list[int] = []
        # Tokens the job may generate (None: no limit to steer by) and how to finish from here,
        # refreshed with the masks (on the worker thread when prefetching; see _plan_due).
        self.budget = budget
        self._plan: ClosingPlan | None = None
        self._planned_at: int | None = None  # len(tokens) when the plan was made
        # Read from the engine only where no mask computation runs (see complete).
        with _engine_failures(constraint):
            self._complete = bool(formatter.is_completed())
            self._schedule()

    # -- mask -------------------------------------------------------------------------------

    def _compute(self) -> None:
        self.formatter.compute_allowed_tokens()
        self._engine.fill_torch_bitmask(self._bits.data_ptr())
        if self.budget is not None and self._plan_due():
            self._plan = self._plan_from(self._engine)
            self._planned_at = len(self.tokens)

    def _schedule(self) -> None:
        if self.complete:
            return
        if self._prefetch:
            self._pending = _pool().submit(self._compute)
        else:
            self._compute()

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            with _engine_failures(self.constraint):
                pending.result()

    def _grammar_mask(self, logits_size: int) -> tuple[np.ndarray, np.ndarray]:
        """kbnf's bitmask as bools over all its ids, and as a mask over ``logits_size`` ids."""
        # uint32 words, bit j of word w = token 32w+j. numpy, not torch: these are small
        # single-threaded operations, and torch would spread them over its thread pool.
        words = self._bits.numpy()
        if sys.byteorder != "little":
            words = words.byteswap()
        bits = np.unpackbits(words.view(np.uint8), bitorder="little").view(np.bool_)
        n = min(self.vocab.size, logits_size)
        mask = np.zeros(logits_size, dtype=np.bool_)
        mask[:n] = bits[:n]
        return bits, mask

    def allowed(self, logits_size: int, stop_ids: Iterable[int]) -> torch.Tensor | None:
        """Which of ``logits_size`` token ids may come next (stop ids only where the output may
        end), or ``None`` when no token can: the constraint cannot be satisfied any more. When
        the budget left is no more than finishing takes, only tokens on the way to the end."""
        self._wait()
        if self.complete:
            return None
        if self._closing_now():
            closing = self.closing_mask(logits_size, stop_ids)
            if closing is not None:
                return closing
        bits, mask = self._grammar_mask(logits_size)
        with _engine_failures(self.constraint):
            may_end = bool(bits[self.vocab.end_id]) and self._end_completes()
        for s in stop_ids:
            if 0 <= s < logits_size:
                mask[s] = may_end
        return torch.from_numpy(mask) if mask.any() else None

    def _end_completes(self) -> bool:
        """The end mark is allowed here; but does it *end* the grammar, or could it be ordinary
        text (a regex ``.`` matches U+10FFFF too)? Try it on a copy."""
        return _ends_here(self._engine, self.vocab.end_id)

    # -- the budget -------------------------------------------------------------------------

    @property
    def remaining(self) -> int | None:
        """Tokens the job may still generate, this step's included (None: no budget)."""
        return None if self.budget is None else self.budget - len(self.tokens)

    def closing(self) -> ClosingPlan | None:
        """How the output would finish from here (None: no budget, or no closing was found)."""
        self._wait()
        if self.budget is not None and self._planned_at != len(self.tokens) and not self.complete:
            with _engine_failures(self.constraint):
                self._plan = self._plan_from(self._engine)
            self._planned_at = len(self.tokens)
        return self._plan

    def _plan_due(self) -> bool:
        if self._planned_at is None or len(self.tokens) - self._planned_at >= _REPLAN_EVERY:
            return True
        # Near enough that it may decide the mask or the probe (fits) soon: at every step.
        near = 4 * (self._plan.tokens if self._plan is not None else 0) + 4 * _PROBE_SLACK
        return self._plan is not None and self.remaining is not None and self.remaining <= near

    def _plan_from(self, engine: Any) -> ClosingPlan | None:
        end_id = self.vocab.end_id if self.constraint.ends_with_stop else None
        text = closing_text(engine, self.vocab.closing_alphabet, end_id)
        if text is None:
            return None
        costs = token_costs(text, self.vocab.ids_by_bytes, self.vocab.max_token_bytes)
        return ClosingPlan(text, costs, self.constraint.ends_with_stop)

    def _closing_now(self) -> bool:
        return self._plan is not None and self.remaining is not None and self.remaining <= self._plan.tokens

    def closing_mask(self, logits_size: int, stop_ids: Iterable[int]) -> torch.Tensor | None:
        """The tokens that start a way to finish within the budget: each writes a prefix of the
        closing text after which the rest still fits. If nothing fits any more, those on the
        cheapest way (the reply will be incomplete, but as near to finished as it can be)."""
        self._wait()
        plan, remaining = self._plan, self.remaining
        if plan is None or remaining is None or self.complete:
            return None
        bits, grammar = self._grammar_mask(logits_size)
        mask = np.zeros(logits_size, dtype=np.bool_)
        if not plan.text:  # only the stop token is left to write
            if bits[self.vocab.end_id]:
                for s in stop_ids:
                    if 0 <= s < logits_size:
                        mask[s] = True
            return torch.from_numpy(mask) if mask.any() else None
        room = max(remaining, plan.tokens) - int(plan.stop_after)
        for k in range(1, min(len(plan.text), self.vocab.max_token_bytes) + 1):
            ids = self.vocab.ids_by_bytes.get(plan.text[:k])
            if ids and 1 + plan.costs[k] <= room:
                for i in ids:
                    if i < logits_size:
                        mask[i] = True
        mask &= grammar  # the same tokens, unless the vocabulary and kbnf disagree
        return torch.from_numpy(mask) if mask.any() else None

    def fits(self, token: int, is_stop: bool = False) -> bool:
        """Whether the output can still finish within the budget after ``token``. Checked only
        near the end of the budget (far from it no single token matters): the token is tried on
        a copy of the engine and the closing recomputed from there."""
        self._wait()
        plan, remaining = self._plan, self.remaining
        if is_stop or plan is None or remaining is None:
            return True
        if remaining > 2 * plan.tokens + _PROBE_SLACK:
            return True
        with _engine_failures(self.constraint):
            trial = copy.copy(self._engine)
            try:
                trial.try_accept_new_token(token)
            except ValueError:
                return True  # not allowed at all: advance() reports that
            if trial.is_finished():
                return True
            after = self._plan_from(trial)
        return after is None or after.tokens <= remaining - 1

    # -- advancing --------------------------------------------------------------------------

    def advance(self, token: int, is_stop: bool = False) -> None:
        """Accept the sampled token (a stop token is accepted as the end mark)."""
        self._wait()
        tid = self.vocab.end_id if is_stop else token
        with _engine_failures(self.constraint):
            try:
                self.formatter.accept_token(tid)
            except ValueError:
                raise ConstraintError(
                    f"token {token} is not allowed by the {self.constraint.kind} constraint here"
                ) from None
            if not is_stop:
                self.tokens.append(token)
            self._complete = bool(self.formatter.is_completed())
            self._schedule()

    @property
    def complete(self) -> bool:
        """The output so far is a finished, valid instance of the constraint. Recorded when the
        last token was accepted, before the next mask's computation started on the worker thread:
        asking the engine while that runs would borrow it twice (kbnf raises "Already mutably
        borrowed"), and waiting for it would give up the overlap with the forward pass."""
        return self._complete

    def value(self) -> Any:
        """The parsed output once :attr:`complete` (JSON: the document)."""
        return self.constraint.parse(self.vocab.decode(self.tokens))

    def close(self) -> None:
        """Wait for a pending mask computation (call when the job ends early)."""
        try:
            self._wait()
        except Exception:  # noqa: BLE001 - nothing depends on the result any more
            pass
