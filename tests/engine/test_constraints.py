"""Constrained output: the pydantic shim, the JSON-schema compiler, the formatron-backed filter on
a small synthetic vocabulary, the generator's handling of it (tiny model), and a few real
SmolLM2 generations (slow)."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from decimal import Decimal

import jsonschema
import pytest
import torch

from engine.generation import constraints as C
from engine.generation.json_schema_grammar import SchemaError, number_regex, schema_to_kbnf
from engine.generation.sampling import Sampler, SamplingSettings

# ---------------------------------------------------------------------------------------------
# The pydantic compatibility shim
# ---------------------------------------------------------------------------------------------


def test_formatron_imports_with_current_pydantic_and_pydantic_is_left_alone():
    import pydantic
    import pydantic.typing as stub

    from engine.compat.formatron_pydantic import import_formatron

    formatter = import_formatron()
    from formatron.schemas import dict_inference, json_schema

    # formatron's modules got the standard typing module ...
    assert json_schema.typing is __import__("typing")
    assert dict_inference.typing is __import__("typing")
    # ... and pydantic still has its own stub afterwards.
    assert pydantic.typing is stub
    assert hasattr(formatter, "FormatterBuilder")


def test_shim_is_still_needed_for_a_plain_import():
    """Documents why the shim exists: when this fails, formatron fixed its imports (upstream
    issue #35) or pydantic restored the stub, and engine/compat/formatron_pydantic.py can go."""
    from engine.compat.formatron_pydantic import needs_shim

    if not needs_shim():
        pytest.skip("the installed pydantic still answers pydantic.typing.Type: no shim needed")
    code = "import formatron.formatter"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "pydantic.typing" in proc.stderr and "Type" in proc.stderr


def test_formatron_pydantic_schema_path_works_through_the_shim():
    """formatron's own pydantic integration (ClassSchema, a BaseModel) under current pydantic."""
    from engine.compat.formatron_pydantic import import_formatron

    fm = import_formatron()
    from formatron.schemas.pydantic import ClassSchema

    class Point(ClassSchema):
        x: int
        y: int

    builder = fm.FormatterBuilder()
    builder.append_str(f"{builder.json(Point, capture_name='p')}")
    vocab = C._byte_vocabulary()
    f = builder.build(vocab.kbnf, vocab.decode)
    for b in b'{"x":1,"y":2}':
        f.accept_token(b)
    assert f.is_completed()
    assert f.captures["p"] == Point(x=1, y=2)


# ---------------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------------


def _candidates(rng: random.Random) -> set[str]:
    out = {"0", "1", "1.0", "0.5", "0.25", "0.2", "0.20", "0.19", "0.8", "0.81", "10", "100", "101", "999"}
    for _ in range(150):
        s = str(rng.choice([0, 1, 2, 5, 9, 10, 11, 19, 99, 100, 120, 121, rng.randint(0, 3000)]))
        if rng.random() < 0.6:
            s += "." + "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
        out.add(s)
    return out | {"-" + s for s in out}


@pytest.mark.parametrize("integer", [False, True])
def test_number_regex_admits_exactly_the_numbers_within_bounds(integer):
    rng = random.Random(1)
    cands = _candidates(rng)
    values = [
        None,
        Decimal(0),
        Decimal(1),
        Decimal(10),
        Decimal("0.25"),
        Decimal("0.8"),
        Decimal(-1),
        Decimal("-0.5"),
    ]
    for lo in values:
        for hi in values:
            for lo_x in (False, True):
                for hi_x in (False, True):
                    try:
                        rx = re.compile(
                            number_regex(
                                lo, hi, exclusive_minimum=lo_x, exclusive_maximum=hi_x, integer=integer
                            )
                        )
                    except SchemaError:
                        rx = None
                    for s in cands:
                        v = Decimal(s)
                        want = (lo is None or (v > lo if lo_x else v >= lo)) and (
                            hi is None or (v < hi if hi_x else v <= hi)
                        )
                        want = want and not (integer and "." in s) and not (s.startswith("-") and v == 0)
                        assert bool(rx and rx.fullmatch(s)) == want, (lo, hi, lo_x, hi_x, s)
                    for bad in ("01", "1.", ".5", "+1", "1e3", "-"):
                        assert not (rx and rx.fullmatch(bad))


# ---------------------------------------------------------------------------------------------
# The JSON-schema compiler, checked by walking the grammar with a byte vocabulary
# ---------------------------------------------------------------------------------------------


def _accepts(constraint: C.Constraint, text: str) -> bool:
    """Feed ``text`` byte by byte (the byte vocabulary); True if accepted *and* complete."""
    state = C.ConstraintState(
        constraint, C._byte_vocabulary(), C._byte_vocabulary().formatter(constraint), False
    )
    for b in text.encode("utf-8"):
        mask = state.allowed(256, [])
        if mask is None or not mask[b]:
            return False
        state.advance(b)
    if constraint.ends_with_stop:
        mask = state.allowed(256, [255])
        if mask is None or not mask[255]:
            return False
        state.advance(255, is_stop=True)
    return state.complete


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
}


@pytest.mark.parametrize(
    "text, ok",
    [
        ('{"name":"Bo","age":7}', True),
        ('{"name": "Bo", "age": 7, "email": "x@y", "tags": ["a", "b"]}', True),
        ('{"name":"Bo","age":7,"tags":[]}', True),  # optional members really optional
        ('{ "name":"Bo", "age":120 }', True),
        ('{"name":"Bo","age":121}', False),  # maximum
        ('{"name":"","age":1}', False),  # minLength
        ('{"name":"Bo"}', False),  # required
        ('{"name":"Bo","age":1,"email":}', False),  # formatron 0.5's grammar allowed this
        ('{"name":"Bo","age":1,"tags":["a","b","a"]}', False),  # maxItems
        ('{"name":"Bo","age":1,"tags":["c"]}', False),  # enum
        ('{"age":1,"name":"Bo"}', False),  # we generate in schema order (a documented narrowing)
    ],
)
def test_person_schema(text, ok):
    constraint = C.json_schema(PERSON)
    assert _accepts(constraint, text) is ok
    if ok:
        jsonschema.validate(json.loads(text), PERSON)


def test_refs_unions_consts_and_pydantic_models():
    from typing import Literal

    import pydantic

    class Item(pydantic.BaseModel):
        kind: Literal["tool", "toy"]
        price: float = pydantic.Field(gt=0, le=100)
        note: str | None = None

    class Order(pydantic.BaseModel):
        items: list[Item] = pydantic.Field(min_length=1, max_length=2)
        rush: bool = False

    c = C.json_schema(Order)
    good = '{"items":[{"kind":"toy","price":9.5,"note":null},{"kind":"tool","price":100}],"rush":true}'
    assert _accepts(c, good)
    Order.model_validate_json(good)
    assert not _accepts(c, '{"items":[{"kind":"toy","price":0}]}')  # gt 0
    assert not _accepts(c, '{"items":[]}')  # min_length
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"const": 1},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["v"],
            }
        },
        "$ref": "#/$defs/node",
    }
    assert _accepts(C.json_schema(tree), '{"v":1,"kids":[{"v":1},{"v":1,"kids":[]}]}')
    assert not _accepts(C.json_schema(tree), '{"v":2}')


def test_string_escapes_and_unicode_count_as_one_character():
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}, "required": ["s"]}
    c = C.json_schema(schema)
    assert _accepts(c, '{"s":"a\\nb"}')
    assert _accepts(c, '{"s":"\u00e9\u2603x"}')
    assert not _accepts(c, '{"s":"abcd"}')
    assert not _accepts(c, '{"s":"a\nb"}')  # raw control characters are not JSON


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"type": "strin"}, "invalid JSON schema"),
        ({"type": "object", "properties": {"a": {"not": {}}}}, "unsupported JSON Schema keyword"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "no number satisfies"),
        ({"type": "object", "required": ["a"], "properties": {}}, "not listed in properties"),
        ({"$ref": "https://example.com/s.json"}, "only local references"),
        ({"type": "string", "pattern": "(?=a)"}, "does not support"),
    ],
)
def test_invalid_or_unsupported_schemas_fail_at_construction(schema, message):
    with pytest.raises(C.ConstraintError, match=message):
        C.json_schema(schema)


def test_grammar_names_are_prefixed_so_they_cannot_clash_with_formatrons():
    g = 'start ::= item (", " item)*; item ::= except!("x") | "x" item;'
    assert (
        C.prefix_kbnf_names(g, "u_")
        == 'u_start ::= u_item (", " u_item)*; u_item ::= except!("x") | "x" u_item;'
    )
    assert "start ::=" in schema_to_kbnf({"type": "boolean"})


def test_regex_and_grammar_end_only_where_complete():
    r = C.regex(r"[a-z]+!")
    assert _accepts(r, "abc!")
    assert not _accepts(r, "abc")  # the stop token is masked until the text is complete
    g = C.grammar('start ::= "yes" | "no" | "n/a";')
    assert _accepts(g, "no") and _accepts(g, "n/a") and not _accepts(g, "n")
    for bad, message in [("a(?=b)", "lookaround"), ("a[", "invalid regular expression")]:
        with pytest.raises(C.ConstraintError, match=message):
            C.regex(bad)
    with pytest.raises(C.ConstraintError, match="does not compile"):
        C.grammar("start ::= 'a' |;")
    with pytest.raises(C.ConstraintError, match="start symbol"):
        C.grammar("begin ::= 'a';")


def test_sampler_mask_restricts_greedy_and_sampled_choices():
    logits = torch.tensor([5.0, 4.0, 3.0, 2.0])
    mask = torch.tensor([False, False, True, True])
    assert Sampler(SamplingSettings.greedy()).sample(logits, [], [], mask) == 2
    sampler = Sampler(SamplingSettings(temperature=1.0, top_k=1, seed=0))  # top-k among allowed
    assert {sampler.sample(logits, [], [], mask) for _ in range(20)} == {2}
    sampler = Sampler(SamplingSettings(temperature=2.0, seed=0))
    assert {sampler.sample(logits, [], [], mask) for _ in range(50)} <= {2, 3}


# ---------------------------------------------------------------------------------------------
# The generator with a constraint: a tiny random model over a hand-made byte tokenizer
# ---------------------------------------------------------------------------------------------


class ByteTokenizer:
    """Ids 0-255 are bytes, written byte-level-BPE style (as GPT-2's vocabulary does); 256 is
    EOS. Enough of the Tokenizer interface for the generator and the constraint vocabulary."""

    vocab_size = 257
    eos_token_ids = {256}
    special_ids = {256}

    def __init__(self, directory) -> None:
        # token_bytes() reads the decoder type from tokenizer.json, as for a real model.
        (directory / "tokenizer.json").write_text(json.dumps({"decoder": {"type": "ByteLevel"}}))
        self.source = str(directory)
        self._chars = {b: c for c, b in C._gpt2_byte_decoder().items()}

    def id_to_token(self, i: int) -> str | None:
        return None if i == 256 else self._chars[i]

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")

    def incremental_decoder(self):
        tok = self

        class Dec:
            def __init__(self):
                self.ids = []
                self.sent = 0

            def add(self, i):
                self.ids.append(i)
                text = tok.decode(self.ids)
                if text.endswith("\ufffd"):
                    return ""
                out, self.sent = text[self.sent :], len(text)
                return out

            def flush(self):
                text = tok.decode(self.ids)
                out, self.sent = text[self.sent :], len(text)
                return out

        return Dec()


def test_token_bytes_of_a_byte_level_vocabulary(tmp_path):
    table = C.token_bytes(ByteTokenizer(tmp_path))
    assert table[0x20] == b" " and table[ord("a")] == b"a" and table[0x80] == b"\x80"
    assert 256 not in table  # special
    assert 0xF4 not in table  # could spell the end mark
    assert len(table) == 255


@pytest.fixture(scope="module")
def tiny_generator(tiny_model_factory, tmp_path_factory):
    from engine.generation.generator import Generator
    from engine.model import load_model

    directory, _ = tiny_model_factory("LlamaForCausalLM")  # vocab 320 >= 257 ids
    model = load_model(directory, device="cpu")
    return Generator(model, ByteTokenizer(tmp_path_factory.mktemp("bytetok")), cache_tokens=512, page_size=16)


def test_generator_json_constraint_on_a_random_model(tiny_generator):
    from engine.generation.job import Job

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["ok", "n"],
    }
    constraint = C.json_schema(schema)
    jobs = [
        Job([1, 2, 3], 64, SamplingSettings(temperature=1.0, seed=s), constraint=constraint) for s in range(6)
    ]
    jobs.append(Job([1, 2, 3], 20))  # an unconstrained job in the same batch is unaffected
    results = tiny_generator.generate(jobs)
    for r in results[:-1]:
        assert r.stop_reason == "constraint_complete" and r.error is None, r
        jsonschema.validate(json.loads(r.text), schema)
    assert results[-1].error is None and results[-1].stop_reason in ("eos", "max_new_tokens")


def test_generator_regex_ends_with_eos_and_reports_incomplete_output(tiny_generator):
    from engine.generation.job import Job

    constraint = C.regex(r"[0-9]{2,6}")
    results = tiny_generator.generate(
        [Job([5, 6], 32, SamplingSettings(temperature=1.0, seed=s), constraint=constraint) for s in range(4)]
    )
    for r in results:
        if r.stop_reason == "eos":
            assert re.fullmatch(r"[0-9]{2,6}", r.text) and r.error is None
        else:  # a random model may keep writing digits until the grammar forces the end
            assert r.stop_reason == "eos" or r.error
    r = tiny_generator.generate([Job([5, 6], 3, constraint=C.regex("[0-9]{10}"))])[0]
    assert r.stop_reason == "max_new_tokens" and "incomplete" in r.error
    assert re.fullmatch("[0-9]{3}", r.text)


def test_generator_ends_an_unsatisfiable_constraint_with_an_error(tiny_generator):
    from engine.generation.job import Job

    # U+10FFFF's lead byte is left out of every vocabulary (it marks the end), so after "ok"
    # no token can continue: the job must end at once with an error, not loop or hang.
    g = C.grammar('start ::= "ok" "\\u{10fffe}";')
    r = tiny_generator.generate([Job([1, 2], 50, constraint=g)])[0]
    assert r.stop_reason == "constraint_error" and "cannot be satisfied" in r.error
    assert r.text == "ok" and r.new_tokens == 2
    assert tiny_generator.num_remaining_jobs == 0


# ---------------------------------------------------------------------------------------------
# SmolLM2 (real tokenizer, real model)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_vocabulary_bytes_match_the_tokenizer(smollm2_dir):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    table = C.token_bytes(tok)
    assert 2 not in table and 0 not in table  # special tokens are left out
    for text in ["Hello, world!", ' {"a": [1, 2.5]}\n', "caf\u00e9 \u2603 \U0001f600"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(table[i] for i in ids) == text.encode("utf-8")


@pytest.mark.slow
def test_smollm2_constrained_chat(smollm2_dir):
    from engine.session import ChatSession

    session = ChatSession.load(smollm2_dir, device="cpu", cache_tokens=2048)
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "population_millions": {"type": "number", "minimum": 0, "maximum": 40},
            "capital": {"type": "boolean"},
        },
        "required": ["city", "capital"],
    }
    messages = [{"role": "user", "content": "Give me a city as JSON."}]
    for seed in range(2):
        chunks = list(
            session.stream_chat(
                messages,
                SamplingSettings(temperature=1.0, seed=seed),
                max_new_tokens=80,
                constraint=C.json_schema(schema),
            )
        )
        assert chunks[-1].stop_reason == "constraint_complete" and chunks[-1].error is None
        jsonschema.validate(json.loads("".join(c.text for c in chunks)), schema)
    pattern = r"(Yes|No)\."
    chunks = list(
        session.stream_chat(
            [{"role": "user", "content": "Is water wet? Answer Yes or No."}],
            SamplingSettings(temperature=1.0, seed=0),
            max_new_tokens=10,
            constraint=C.regex(pattern),
        )
    )
    assert chunks[-1].stop_reason == "eos" and re.fullmatch(pattern, "".join(c.text for c in chunks))


def test_complete_never_touches_the_engine_while_the_next_mask_is_computed():
    """The generator asks ``complete`` right after ``advance`` has started the next mask on the
    worker thread; kbnf's engine may not be used from two threads at once ("Already mutably
    borrowed", seen in CI under load). A formatter that fails on overlapping use, with a slow mask."""
    import threading
    import time

    class Engine:
        def fill_torch_bitmask(self, ptr):
            pass

    class Formatter:
        def __init__(self):
            self._engine = Engine()
            self.busy = threading.Lock()
            self.accepted = 0

        def _use(self, seconds=0.0):
            if not self.busy.acquire(blocking=False):
                raise RuntimeError("Already mutably borrowed")
            try:
                time.sleep(seconds)
            finally:
                self.busy.release()

        def compute_allowed_tokens(self):
            self._use(0.05)

        def accept_token(self, token):
            self._use()
            self.accepted += 1

        def is_completed(self):
            self._use()
            return self.accepted >= 3

    constraint = C.regex("[a-z]+")
    formatter = Formatter()
    state = C.ConstraintState(constraint, C._byte_vocabulary(), formatter, prefetch=True)
    seen = []
    for token in b"abc":
        state.advance(token)
        seen.append(state.complete)  # the mask computation runs now
    assert seen == [False, False, True]
    state.close()


# ---------------------------------------------------------------------------------------------
# Finishing within the token budget
# ---------------------------------------------------------------------------------------------


def _state_after(constraint: C.Constraint, prefix: str, budget: int = 100) -> C.ConstraintState:
    vocab = C._byte_vocabulary()
    state = C.ConstraintState(constraint, vocab, vocab.formatter(constraint), False, budget=budget)
    for b in prefix.encode("utf-8"):
        state.advance(b)
    return state


@pytest.mark.parametrize(
    "prefix, closing",
    [
        ("", '{"name":"]","age":1}'),  # minLength 1: any one character; optional members left out
        ('{"name":"Bo', '","age":1}'),  # the required member still missing
        ('{"name":"Bo","age":12', "}"),  # a number may end right here
        ('{"name":"Bo","age":12,"tags":["', 'a"]}'),  # an enum value must be finished
        ('{"name":"Bo","age":12,"tags":["a",', '"a"]}'),  # after a comma an item is owed
        ('{"name":"Bo","age":12,"email":"x\\', '""}'),  # an open escape: \" then the real quote
    ],
)
def test_closing_text_is_the_short_way_to_a_valid_document(prefix, closing):
    state = _state_after(C.json_schema(PERSON), prefix)
    plan = state.closing()
    assert plan.text.decode() == closing
    assert plan.tokens == len(closing)  # one byte per token in the byte vocabulary
    jsonschema.validate(json.loads(prefix + closing), PERSON)
    assert _accepts(C.json_schema(PERSON), prefix + closing)


def test_closing_text_for_regexes_and_grammars_ends_where_the_model_may_stop():
    pattern = r"(Yes|No)\. [A-Za-z ,']{1,80}\."
    plan = _state_after(C.regex(pattern), "No. abc").closing()
    assert plan.text == b"." and plan.tokens == 2  # "." and then the stop token
    plan = _state_after(C.regex(pattern), "").closing()
    assert re.fullmatch(pattern, plan.text.decode()) and len(plan.text) <= 6
    # A byte that keeps the walk going (the first letter, "x") is not taken where one ends it.
    assert _state_after(C.regex("a+b"), "").closing().text == b"ab"
    assert _state_after(C.grammar('start ::= "x" start | "y";'), "").closing().text == b"y"


def test_token_costs_counts_the_fewest_tokens_for_each_suffix():
    ids = {b'"': [1], b"]": [2], b"}": [3], b'"]': [4], b"]}": [5]}
    assert C.token_costs(b'"]}', ids, 2) == [2, 1, 1, 0]
    assert C.token_costs(b'"]}', ids, 1) == [3, 2, 1, 0]  # tokens longer than allowed are not used
    assert C.token_costs(b"x}", ids, 2)[0] > 2  # no token writes "x": unreachable


def test_closing_mask_admits_only_tokens_on_a_way_to_finish_in_time(tmp_path):
    tok = ByteTokenizer(tmp_path)
    state = C.json_schema(PERSON).start(tok, prefetch=False, budget=24)
    for b in b'{"name":"Bo","age":12,"tags":["a",':
        state.advance(b)
    assert state.remaining == 24 - 34 < 0  # over budget: the cheapest way is all that is left
    mask = state.allowed(320, [256])
    assert mask.nonzero().flatten().tolist() == [ord('"')]
    fresh = C.json_schema(PERSON).start(tok, prefetch=False, budget=23)
    for b in b'{"name":"Bo","age":12':  # 21 tokens, 2 left; "}" needs 1: a free choice still
        fresh.advance(b)
    assert fresh.remaining == 2 and fresh.closing().text == b"}"
    assert fresh.allowed(320, [256]).sum() > 1
    assert fresh.fits(ord("0"))  # "120": the "}" still fits after it
    assert not fresh.fits(ord(","))  # a comma owes a whole member ("email":""): it cannot fit
    assert fresh.closing_mask(320, [256]).nonzero().flatten().tolist() == [ord("}")]


LIST_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "items": {
            "type": "array",
            "items": {"type": "string", "maxLength": 60},
            "minItems": 1,
            "maxItems": 8,
        },
    },
    "required": ["title", "items"],
}


def test_generator_finishes_constrained_json_within_a_tight_budget(tiny_generator):
    """A random model inside long strings would run out of tokens mid-document (the old
    behaviour: an incomplete reply); with the budget steering every reply is a valid document."""
    from engine.generation.job import Job

    constraint = C.json_schema(LIST_SCHEMA)
    budget = 40  # the shortest document, {"title":"","items":[""]}, is 26 bytes
    jobs = [
        Job([1, 2, 3], budget, SamplingSettings(temperature=1.0, seed=s), constraint=constraint)
        for s in range(8)
    ]
    for r in tiny_generator.generate(jobs):
        assert r.stop_reason == "constraint_complete" and r.error is None, (r.stop_reason, r.error, r.text)
        assert r.new_tokens <= budget
        jsonschema.validate(json.loads(r.text), LIST_SCHEMA)


def test_generator_reports_incomplete_output_when_even_the_shortest_does_not_fit(tiny_generator):
    from engine.generation.job import Job

    r = tiny_generator.generate([Job([1, 2], 10, constraint=C.json_schema(LIST_SCHEMA))])[0]
    assert r.stop_reason == "max_new_tokens" and "incomplete" in r.error
    assert r.text == '{"title":"'  # steered along the shortest document from the first token


@pytest.mark.slow
def test_smollm2_replies_within_a_tight_budget_are_valid(smollm2_dir):
    """The starter model, a list of up to 8 long strings, a budget of 40 tokens: SmolLM2 at
    temperature 1 spends it inside the list for half the seeds (3 of these 6) unless steered."""
    from engine.generation.job import Job
    from engine.session import ChatSession

    session = ChatSession.load(smollm2_dir, device="cpu", cache_tokens=2048)
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "ingredients": {
                "type": "array",
                "items": {"type": "string", "maxLength": 80},
                "minItems": 1,
                "maxItems": 8,
            },
        },
        "required": ["name", "ingredients"],
    }
    prompt = (
        "List the ingredients of pancakes as JSON: a name and a list of ingredients, "
        "each described in detail."
    )
    ids = session.tokenizer.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
    constraint = C.json_schema(schema)
    settings = [SamplingSettings(temperature=1.0, seed=s) for s in range(6)]
    jobs = [Job(ids, 40, sampling, constraint=constraint) for sampling in settings]
    for r in session.generator.generate(jobs):
        assert r.stop_reason == "constraint_complete" and r.error is None, (r.stop_reason, r.text)
        jsonschema.validate(json.loads(r.text), schema)
    # The budget was tight, yet the shortest reply, {"name":"","ingredients":[""]}, fits it.
    plan = constraint.start(session.tokenizer, prefetch=False, budget=40).closing()
    assert 8 <= plan.tokens <= 20


# ---------------------------------------------------------------------------------------------
# kbnf's noise and its failures
# ---------------------------------------------------------------------------------------------


def test_kbnf_missing_bytes_warning_does_not_reach_stderr(capfd, caplog):
    """kbnf warns (through Python logging) about byte values no token has, on every
    vocabulary we build; real tokenizers lack some, so it is noise for the user."""
    C.ConstraintVocabulary({i: bytes([i]) for i in range(1, 100)}, 100, lambda ids: "")
    assert "not present in any token" not in capfd.readouterr().err
    assert not [r for r in caplog.records if "not present in any token" in r.getMessage()]
    # What a user would see: a fresh process with no logging configured.
    code = (
        "from engine.generation import constraints as C\n"
        "C.ConstraintVocabulary({i: bytes([i]) for i in range(1, 100)}, 100, lambda ids: '')\n"
        "import logging; logging.getLogger('kbnf.vocabulary').warning('another kbnf warning')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "not present in any token" not in proc.stderr
    assert "another kbnf warning" in proc.stderr  # only that one message is held back


def _kbnf_panic() -> BaseException | None:
    """What kbnf 0.4.2 raises for a multi-byte token whose first byte is accepted (and compacts
    the Earley sets) and whose second byte is rejected; None once kbnf rejects it properly."""
    import kbnf

    tokens = {i: kbnf.Token(bytes([i])) for i in range(32, 127)}
    tokens[200] = kbnf.Token(b"},")
    engine = kbnf.Engine(
        'start ::= "[" item ("," item)? "]"; item ::= "{" "}";',
        kbnf.Vocabulary(tokens, {i: repr(t) for i, t in tokens.items()}),
    )
    engine.try_accept_new_bytes(b"[{},{")  # the second (and last) item is open
    try:
        engine.try_accept_new_token(200)  # "}" closes it; "," would start a third
    except ValueError:
        return None
    except BaseException as exc:  # noqa: BLE001 - the point of this helper
        return exc
    raise AssertionError("kbnf accepted a third item")


def test_kbnf_still_panics_on_a_token_rejected_after_compaction():
    """Documents the kbnf bug the constraint boundary guards against (see
    engine/compat/kbnf_engine.py): when this fails, kbnf rejects the token with a ValueError."""
    exc = _kbnf_panic()
    assert exc is not None, "kbnf no longer panics here: see engine/compat/kbnf_engine.py"
    assert type(exc).__name__ == "PanicException" and not isinstance(exc, Exception)
    assert "slice index starts at" in str(exc)


class _StandInPanic(BaseException):
    """pyo3_runtime.PanicException's shape, where kbnf no longer yields the real one."""


@pytest.mark.parametrize(
    "method", ["compute_allowed_token_ids", "try_accept_new_token", "is_finished", "__copy__"]
)
def test_a_kbnf_panic_ends_that_job_with_an_error_and_the_next_job_runs(tiny_generator, monkeypatch, method):
    import kbnf

    from engine.generation.job import Job

    original = getattr(kbnf.Engine, method)
    calls = {"n": 0}

    real = _kbnf_panic()  # the real pyo3_runtime.PanicException: a BaseException, no Exception
    panic_type = type(real) if real is not None else _StandInPanic

    def panics_once(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # mid-job, whichever path reaches the engine then
            raise panic_type("slice index starts at 9 but ends at 7")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(kbnf.Engine, method, panics_once)
    constraint = C.regex(r"[0-9]{3}")  # ends with the stop token: every engine path is used
    r = tiny_generator.generate([Job([1, 2], 20, constraint=constraint)])[0]
    assert calls["n"] >= 3
    assert r.stop_reason == "constraint_error"
    assert "kbnf" in r.error and panic_type.__name__ in r.error and "slice index" in r.error
    assert tiny_generator.num_remaining_jobs == 0
    job = Job([1, 2], 20, SamplingSettings(temperature=1.0, seed=0), constraint=constraint)
    r = tiny_generator.generate([job])[0]
    assert r.error is None and r.stop_reason == "eos" and re.fullmatch("[0-9]{3}", r.text)
