"""Constrained output: a per-job filter that masks the logits before sampling.

A :class:`Constraint` says what the output must look like - a JSON schema (or a pydantic model),
a regular expression, or a grammar in KBNF, formatron's grammar language - independently of any
model. :meth:`Constraint.start` binds it to a tokenizer's vocabulary and returns a
:class:`ConstraintState`, the per-job filter the generator drives::

    mask = state.allowed(logits_size, stop_ids)   # bool [vocab]; None: nothing can follow
    token = sampler.sample(logits, ..., mask=mask)
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
* cost: building a kbnf engine for a grammar and a 50k-token vocabulary takes from 0.1 s to a
  few seconds (it pre-computes token tables), so engines are built once per (constraint,
  vocabulary) and copied per job (about a millisecond). The next step's mask is computed on a
  worker thread right after a token is accepted, overlapping the next forward pass (torch
  releases the GIL inside its kernels).
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import EngineError

END_MARK = "\U0010ffff"  # stands for "the model stopped" inside a grammar; see the module doc
_END_LITERAL = '"\\u{10ffff}"'  # END_MARK in KBNF
_END_LEAD_BYTE = 0xF4  # first UTF-8 byte of END_MARK: tokens containing it are left out
_TEMPLATES_PER_VOCAB = 32


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
        self.kbnf = kbnf.Vocabulary(tokens, names)
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
        try:
            return builder.build(vocab.kbnf, vocab.decode)
        except Exception as exc:  # kbnf raises plain ValueError/RuntimeError with its parser message
            raise ConstraintError(f"{self.kind} constraint does not compile: {exc}") from exc

    def start(self, tokenizer: Any, prefetch: bool | None = None) -> ConstraintState:
        """A fresh per-job state over ``tokenizer``'s vocabulary. ``prefetch``: compute each next
        mask on a worker thread (default: on, unless TRELLIS_CONSTRAINT_PREFETCH=0)."""
        vocab = ConstraintVocabulary.for_tokenizer(tokenizer)
        if prefetch is None:
            prefetch = os.environ.get("TRELLIS_CONSTRAINT_PREFETCH", "1") != "0"
        return ConstraintState(self, vocab, vocab.formatter(self), prefetch)


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
    without this a single job's grammar could bring down the whole generator loop."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit, ConstraintError):
        raise
    except BaseException as exc:  # noqa: BLE001 - see above
        raise ConstraintError(
            f"the {constraint.kind} constraint engine (kbnf) failed: {type(exc).__name__}: {exc}"
        ) from exc


class ConstraintState:
    """One job's progress through its constraint (not thread-safe: one generator drives it)."""

    def __init__(
        self, constraint: Constraint, vocab: ConstraintVocabulary, formatter: Any, prefetch: bool
    ) -> None:
        self.constraint, self.vocab, self.formatter = constraint, vocab, formatter
        # formatron has no public accessor for the kbnf engine; its own integrations use this one.
        self._engine = formatter._engine
        self._bits = torch.zeros((vocab.end_id + 32) // 32, dtype=torch.int32)
        self._prefetch = prefetch
        self._pending: Future | None = None
        self.tokens: list[int] = []
        # Read from the engine only where no mask computation runs (see complete).
        self._complete = bool(formatter.is_completed())
        self._schedule()

    # -- mask -------------------------------------------------------------------------------

    def _compute(self) -> None:
        self.formatter.compute_allowed_tokens()
        self._engine.fill_torch_bitmask(self._bits.data_ptr())

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

    def allowed(self, logits_size: int, stop_ids: Iterable[int]) -> torch.Tensor | None:
        """Which of ``logits_size`` token ids may come next (stop ids only where the output may
        end), or ``None`` when no token can: the constraint cannot be satisfied any more."""
        self._wait()
        if self.complete:
            return None
        # kbnf's bitmask: uint32 words, bit j of word w = token 32w+j. numpy, not torch: these are
        # small single-threaded operations, and torch would spread them over its thread pool.
        words = self._bits.numpy()
        if sys.byteorder != "little":
            words = words.byteswap()
        bits = np.unpackbits(words.view(np.uint8), bitorder="little").view(np.bool_)
        n = min(self.vocab.size, logits_size)
        mask = np.zeros(logits_size, dtype=np.bool_)
        mask[:n] = bits[:n]
        may_end = bool(bits[self.vocab.end_id]) and self._end_completes()
        for s in stop_ids:
            if 0 <= s < logits_size:
                mask[s] = may_end
        return torch.from_numpy(mask) if mask.any() else None

    def _end_completes(self) -> bool:
        """The end mark is allowed here; but does it *end* the grammar, or could it be ordinary
        text (a regex ``.`` matches U+10FFFF too)? Try it on a copy."""
        trial = copy.copy(self._engine)
        try:
            trial.try_accept_new_token(self.vocab.end_id)
        except ValueError:
            return False
        return trial.is_finished()

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
