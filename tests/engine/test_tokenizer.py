"""engine.tokenizer against transformers' tokenizer on the same files.

Real tokenizers: the tiny byte-level BPE of the EXL3 fixtures, SmolLM2 (byte-level BPE, ChatML
template) and Gemma 3 (SentencePiece BPE with byte fallback, BOS in the template), both as our
GGUF importer wrote them; plus a small Llama-style SentencePiece tokenizer trained here, for the
leading-space rules that neither of the others has.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path

import jinja2.sandbox
import pytest

from engine.errors import TokenizerError
from engine.tokenizer import ChatTemplateError, Tokenizer

TEXTS = [
    "Hello, world!",
    "  two leading spaces, and two trailing  ",
    "naïve café résumé Ångström façade",
    "日本語のテキストと中文，한국어도",
    "emoji: 😀🎉 family 👩‍👩‍👧 flag 🇫🇷 done",
    "def f(x):\n    return {'a': x ** 2}  # ok\n",
    "tabs\tand\nnew\r\nlines\n\n\nend",
    "numbers 1234567 and 3.14159, year 2024",
    "€100 — “quotes” … ½ ∑ ≠",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "How are you?\nTell me  more."},
    ],
    [
        {"role": "user", "content": "Write code"},
        {"role": "assistant", "content": "```python\nprint('hi')\n```"},
        {"role": "user", "content": "Thanks 😀 ça marche"},
        {"role": "assistant", "content": "De rien."},
        {"role": "user", "content": "日本語で"},
    ],
]


def _hf_tokenizer(directory: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    decoder = tok.incremental_decoder(skip_special_tokens=skip_special_tokens)
    return [decoder.add(i) for i in ids] + [decoder.flush()]


# ---------------------------------------------------------------------------------------------
# Loading and errors
# ---------------------------------------------------------------------------------------------


def test_missing_tokenizer_json_names_directory_and_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(info.value) and "tokenizer.json" in str(info.value)


def test_corrupt_tokenizer_files_raise_tokenizer_error(tmp_path, tiny_llama_hf):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    shutil.copy(tiny_llama_hf / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)


# ---------------------------------------------------------------------------------------------
# The tiny byte-level tokenizer of the EXL3 fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_llama_hf):
    return Tokenizer.from_dir(tiny_llama_hf), _hf_tokenizer(tiny_llama_hf)


def test_tiny_encode_decode_match_transformers(tiny):
    ours, ref = tiny
    for text in TEXTS:
        for specials in (True, False):
            assert ours.encode(text, add_special_tokens=specials) == ref.encode(
                text, add_special_tokens=specials
            ), text
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.bos_token_id == ref.bos_token_id == 1
    assert ours.eos_token_ids == {ref.eos_token_id}
    assert ours.vocab_size == len(ref)
    assert ours.special_ids == set(ref.all_special_ids)


def test_tiny_has_no_template_and_says_so(tiny):
    ours, _ = tiny
    assert not ours.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ours.apply_chat_template(CONVERSATIONS[0])


def test_tiny_incremental_decoding(tiny):
    ours, ref = tiny
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        pieces = _stream(ours, ids)
        assert "".join(pieces) == ref.decode(ids) == text
        assert not any("\ufffd" in piece for piece in pieces), (text, pieces)


def test_incremental_decoder_holds_back_partial_characters(tiny):
    ours, _ = tiny
    # The tiny vocabulary has no emoji: each one is several byte-level tokens.
    ids = ours.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    decoder = ours.incremental_decoder()
    assert [decoder.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.add(ids[-1]) == "😀"
    assert decoder.flush() == ""


def test_incremental_decoder_window_stays_small(tiny):
    ours, _ = tiny
    text = "The quick brown fox — jumps over 13 lazy dogs; 😀 ünïcödé. " * 60
    ids = ours.encode(text, add_special_tokens=False)
    decoder = ours.incremental_decoder()
    out, widest = [], 0
    for i in ids:
        out.append(decoder.add(i))
        widest = max(widest, decoder.window_size)
    out.append(decoder.flush())
    assert "".join(out) == text
    # O(1) per token: the decoded window never grows with the sequence.
    assert len(ids) > 500 and widest <= 12


def test_incremental_flush_emits_invalid_tail(tiny):
    ours, _ = tiny
    ids = ours.encode("😀", add_special_tokens=False)[:-1]  # an emoji cut short
    decoder = ours.incremental_decoder()
    assert "".join(decoder.add(i) for i in ids) == ""
    assert decoder.flush() == ours.decode(ids)  # what is left comes out at the end, as decode has it


# ---------------------------------------------------------------------------------------------
# Chat templates: the sandbox and HF's template environment
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def with_config(tmp_path: Path, tiny_llama_hf: Path):
    """``with_config(post_processor="keep", **config)``: the tiny tokenizer in ``tmp_path`` with
    extra tokenizer_config keys and, optionally, another post-processor in tokenizer.json (None
    removes it)."""

    def make(post_processor: object = "keep", **config) -> Tokenizer:
        data = json.loads((tiny_llama_hf / "tokenizer.json").read_text())
        if post_processor != "keep":
            data["post_processor"] = post_processor
        (tmp_path / "tokenizer.json").write_text(json.dumps(data))
        base = json.loads((tiny_llama_hf / "tokenizer_config.json").read_text())
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
        return Tokenizer.from_dir(tmp_path)

    return make


BOS_POST_PROCESSOR = {
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
}


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{% set ns = namespace(_x=1) %}{{ ns._x }}",
    ],
)
def test_sandbox_blocks_escapes(with_config, template):
    tok = with_config(chat_template=template)
    with pytest.raises(ChatTemplateError) as info:
        tok.apply_chat_template(CONVERSATIONS[0])
    assert isinstance(info.value.__cause__, jinja2.sandbox.SecurityError)


def test_template_helpers_match_hf(with_config, tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% if loop.index == 2 %}{% break %}{% endif %}"
        "{% endfor %}|{{ tools | tojson(indent=2) }}|{{ strftime_now('%Y') }}"
        "{% generation %}|gen{% endgeneration %}"
        "{% if add_generation_prompt %}<go>{% endif %}"
    )
    tok = with_config(chat_template=template)
    messages = [{"role": "user", "content": "ça <b> & 'x'"}, {"role": "assistant", "content": "ok"}] * 2
    tools = [{"name": "f", "parameters": {"é": 1}}]
    ours = tok.apply_chat_template(messages, tools=tools)
    ref = _hf_tokenizer(tmp_path).apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert ours == ref
    assert "\"ça <b> & 'x'\"" in ours  # plain JSON: no HTML escaping, no \\u escapes
    assert str(datetime.now().year) in ours and ours.endswith("|gen<go>")


def test_raise_exception_and_errors_become_chat_template_errors(with_config):
    tok = with_config(chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tok.apply_chat_template(CONVERSATIONS[0])
    bad = with_config(chat_template="{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        bad.apply_chat_template(CONVERSATIONS[0])


def test_template_sources(with_config, tmp_path):
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    assert with_config(chat_template=named).apply_chat_template([]) == "DEFAULT"
    # transformers saves chat_template.jinja beside the JSON; the file wins.
    (tmp_path / "chat_template.jinja").write_text("FILE {{ messages | length }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATIONS[1]) == "FILE 2"


def test_bos_from_post_processor(with_config, tmp_path):
    # tokenizer.json's post-processor adds BOS (as in Llama and Gemma repositories).
    template = "{{ bos_token }}{{ messages[0]['content'] }}"
    tok = with_config(post_processor=BOS_POST_PROCESSOR, chat_template=template)
    ref = _hf_tokenizer(tmp_path)
    for text in ("hello", "", "a <s> in the middle"):
        assert tok.encode(text) == ref.encode(text)
    assert tok.encode("hello")[0] == tok.bos_token_id and tok.add_bos_token
    # A text that already starts with BOS does not get a second one (transformers would add it).
    assert tok.encode("<s>hello") == ref.encode("<s>hello")[1:] == [1, *tok.encode("hello")[1:]]
    chat = [{"role": "user", "content": "hi"}]
    ids = tok.encode_chat(chat)
    assert ids == ref.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert ids.count(tok.bos_token_id) == 1


def test_bos_flags_without_post_processor(with_config):
    # No post-processor: tokenizer_config's add_bos_token decides (transformers' Llama semantics).
    tok = with_config(post_processor=None, add_bos_token=True, chat_template="{{ messages[0].content }}")
    assert tok.encode("hello")[0] == tok.bos_token_id
    assert tok.encode("hello", add_special_tokens=False)[0] != tok.bos_token_id
    # A model that wants BOS but whose template forgets it still gets exactly one.
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == [tok.bos_token_id, *tok.encode("hi")[1:]]


def test_post_processor_wins_over_flags(with_config, tmp_path):
    # The tiny tokenizer's ByteLevel post-processor adds nothing; the flag is not applied on top.
    tok = with_config(add_bos_token=True)
    assert tok.encode("hello") == _hf_tokenizer(tmp_path).encode("hello")
    assert tok.bos_token_id not in tok.encode("hello") and not tok.add_bos_token


# ---------------------------------------------------------------------------------------------
# A Llama-style SentencePiece tokenizer: "▁" spaces, dummy prefix, byte fallback
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory) -> Path:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as Backend

    corpus = [
        "Hello world, hello there. The world is wide and the sea is deep.",
        "Where there is a will there is a way; we went west.",
        "naive cafe resume, simple words only here and there.",
    ] * 20
    trainer_tok = Backend(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer_tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=150, show_progress=False))
    trained = json.loads(trainer_tok.to_str())["model"]

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for token in trained["vocab"]:
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Backend(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    directory = tmp_path_factory.mktemp("spm")
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_sentencepiece_style_matches_transformers(spm_dir):
    ours, ref = Tokenizer.from_dir(spm_dir), _hf_tokenizer(spm_dir)
    for text in [*TEXTS, "Hello world", " Hello  world "]:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        # Streaming the same ids gives the same text: spaces survive the window boundaries,
        # and characters the vocabulary lacks (byte fallback) are never shown half-done.
        pieces = _stream(ours, ids)
        assert "".join(pieces) == ours.decode(ids), text
        assert not any("\ufffd" in p for p in pieces)


def test_sentencepiece_spaces_and_bytes_stream_correctly(spm_dir):
    ours = Tokenizer.from_dir(spm_dir)
    world = ours.encode("Hello world", add_special_tokens=False)
    assert ours.id_to_token(world[-1]).startswith("▁")  # the space lives in the next token
    assert "".join(_stream(ours, world)) == "Hello world"
    # A skipped special token between words must not make the next word look sequence-initial.
    ids = [*ours.encode("Hello", add_special_tokens=False), ours.bos_token_id, *world[-1:]]
    assert "".join(_stream(ours, ids)) == ours.decode(ids) == "Hello world"
    # "€" is not in the vocabulary: three byte-fallback tokens, shown only when complete.
    euro = [ours.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    decoder = ours.incremental_decoder()
    assert decoder.add(world[0]) == "Hello"
    assert [decoder.add(i) for i in euro] == ["", "", "€"]


# ---------------------------------------------------------------------------------------------
# SmolLM2 and Gemma 3, as imported from their GGUF files
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return Tokenizer.from_dir(smollm2_dir), _hf_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def gemma3(gemma3_dir):
    return Tokenizer.from_dir(gemma3_dir), _hf_tokenizer(gemma3_dir)


@pytest.fixture(params=["smollm2", "gemma3"])
def real(request):
    return request.getfixturevalue(request.param)


def test_real_encode_decode_match_transformers(real):
    ours, ref = real
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.pad_token_id == ref.pad_token_id
    assert ours.eos_token_ids == {ref.eos_token_id}
    assert ours.vocab_size == len(ref)


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=lambda c: f"{len(c)}-messages")
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_real_chat_template_matches_transformers(real, conversation, generation_prompt):
    ours, ref = real
    text = ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt)
    assert text == ref.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=generation_prompt
    )
    ids = ours.encode_chat(conversation, add_generation_prompt=generation_prompt)
    expected = ref.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
    )
    assert ids == list(expected)
    if ours.bos_token and text.startswith(ours.bos_token):
        assert ids[:2] == [ours.bos_token_id, ids[1]] and ids[1] != ours.bos_token_id


@pytest.mark.parametrize("text", [t for t in TEXTS if t] + ["<|im_start|>assistant\nHi<|im_end|>"])
def test_real_incremental_decoding(real, text):
    ours, ref = real
    ids = ours.encode(text, add_special_tokens=False)
    pieces = _stream(ours, ids)
    assert "".join(pieces) == ref.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)


def test_smollm2_specifics(smollm2):
    ours, ref = smollm2
    assert ours.bos_token == "<|im_start|>" and ours.eos_token_ids == {ours.token_to_id("<|im_end|>")}
    assert ours.encode("Hello") == ref.encode("Hello") and ours.bos_token_id not in ours.encode("Hello")
    # Without a system message the template supplies SmolLM's default one.
    assert ours.apply_chat_template(CONVERSATIONS[0]).startswith("<|im_start|>system\nYou are a helpful")
    assert {ours.token_to_id("<|im_start|>"), ours.token_to_id("<|im_end|>")} <= ours.special_ids


def test_gemma3_specifics(gemma3):
    ours, _ = gemma3
    assert ours.encode("Hi")[0] == ours.bos_token_id  # Gemma adds BOS...
    chat = ours.encode_chat(CONVERSATIONS[1])
    assert chat.count(ours.bos_token_id) == 1  # ...and its template writes it: still one
    text = ours.apply_chat_template(CONVERSATIONS[1])
    assert text == (
        "<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    )
    # Byte-fallback tokens: "€" spelled as bytes comes out whole, and only then.
    euro = [ours.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    decoder = ours.incremental_decoder()
    assert [decoder.add(i) for i in euro] == ["", "", "€"]
    # Gemma does not alternate roles freely: its template refuses, with a readable error.
    with pytest.raises(ChatTemplateError, match="alternate"):
        ours.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_a_missing_model_folder_is_named_as_such(tmp_path):
    from engine.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match=r"model directory .*nowhere does not exist"):
        Tokenizer.from_dir(tmp_path / "nowhere")
