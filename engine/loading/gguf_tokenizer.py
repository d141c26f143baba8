"""Rebuild a Hugging Face ``tokenizer.json`` (+ ``tokenizer_config.json``) from GGUF metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary (``tokenizer.ggml.tokens``),
token kinds, merges or scores, special ids, and the name of its pre-tokenizer
(``tokenizer.ggml.pre``) as metadata. Two families cover the models we import:

* ``gpt2``: byte-level BPE with explicit merges (SmolLM2, Llama 3, Qwen). The text is split
  before BPE by a regex chosen by ``tokenizer.ggml.pre``; a wrong split still produces valid ids,
  but not the ones the model was trained on, so the split table below matters.
* ``llama``: SentencePiece-style BPE with byte fallback (Llama 2, Mistral, Gemma). The file has
  scores instead of merges; merges are recovered from the vocabulary: every way of cutting a
  token into two tokens is a merge, ranked by the token's priority.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import GGUFImportError
from engine.loading.gguf_templates import fallback_chat_template

log = logging.getLogger(__name__)

# llama.cpp's token kinds (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's visible space

# Pre-tokenizer regexes by ``tokenizer.ggml.pre``. GPT-2's own split is ByteLevel's built-in one.
_GPT2 = "gpt2"
_DIGITS_THEN_GPT2 = "digits+gpt2"  # each digit alone, then GPT-2's split
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    "default": _GPT2,
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "llama3": _LLAMA3_REGEX,
    "llama-v3": _LLAMA3_REGEX,
    "llama-bpe": _LLAMA3_REGEX,
    "smaug-bpe": _LLAMA3_REGEX,
    "qwen2": _QWEN2_REGEX,
    "deepseek-r1-qwen": _QWEN2_REGEX,
}

# Tokens that end a turn in common chat formats. One that the chat template writes is also a
# generation stop (generation_config's eos list), as llama.cpp treats it.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>")


@dataclass
class TokenizerFiles:
    """What the importer writes: tokenizer.json's object, tokenizer_config.json's dict and the
    ids for config.json / generation_config.json."""

    backend: Any  # tokenizers.Tokenizer
    config: dict[str, Any]
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    stop_token_ids: list[int] = field(default_factory=list)


def _meta_id(meta: Mapping[str, Any], key: str, n_tokens: int) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    value = int(value)
    # llama.cpp writes -1 (as u32: 0xFFFFFFFF) for "none".
    return value if 0 <= value < n_tokens else None


def _token_types(meta: Mapping[str, Any], n_tokens: int, path: str) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return [NORMAL] * n_tokens
    types = [int(t) for t in types]
    if len(types) != n_tokens:
        raise GGUFImportError(f"{path}: {len(types)} token types for {n_tokens} tokens")
    return types


def build_tokenizer(meta: Mapping[str, Any], path: str, context_length: int | None = None) -> TokenizerFiles:
    """tokenizer.json / tokenizer_config.json for the GGUF whose metadata is ``meta``."""
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise GGUFImportError(f"{path}: the file has no tokenizer (tokenizer.ggml.model / tokens missing)")
    tokens = list(tokens)
    types = _token_types(meta, len(tokens), path)
    arch = str(meta.get("general.architecture", ""))

    if model == "gpt2":
        backend = _byte_level_bpe(meta, tokens, path)
    elif model == "llama":
        backend = _sentencepiece_bpe(meta, tokens, types, arch, path)
    else:
        raise GGUFImportError(
            f"{path}: tokenizer model {model!r} is not supported (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece BPE)"
        )

    spelled = [backend.id_to_token(i) for i in range(len(tokens))]
    _add_special_tokens(backend, tokens, spelled, types)

    ids = {
        key: _meta_id(meta, f"{key}_token_id", len(tokens)) for key in ("bos", "eos", "unknown", "padding")
    }
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")) and ids["bos"] is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and ids["eos"] is not None
    _set_post_processor(backend, model, spelled, ids["bos"], ids["eos"], add_bos, add_eos)

    template = _chat_templates(meta) or fallback_chat_template(arch, set(tokens))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # i.e. "use tokenizer.json as it is"
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (
        ("bos_token", "bos"),
        ("eos_token", "eos"),
        ("unk_token", "unknown"),
        ("pad_token", "padding"),
    ):
        if ids[key] is not None:
            config[name] = spelled[ids[key]]
    if context_length:
        config["model_max_length"] = int(context_length)
    if template is not None:
        config["chat_template"] = template

    return TokenizerFiles(
        backend=backend,
        config=config,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["padding"],
        unk_token_id=ids["unknown"],
        stop_token_ids=_stop_ids(meta, spelled, ids["eos"], template),
    )


def _chat_templates(meta: Mapping[str, Any]) -> str | list[dict[str, str]] | None:
    """``tokenizer.chat_template``, plus named ones (``tokenizer.chat_template.tool_use``) as HF's
    list form."""
    default = meta.get("tokenizer.chat_template")
    prefix = "tokenizer.chat_template."
    named = {key[len(prefix) :]: value for key, value in meta.items() if key.startswith(prefix)}
    if not named:
        return default
    templates = [{"name": "default", "template": default}] if default else []
    templates += [{"name": name, "template": value} for name, value in sorted(named.items())]
    return templates


def _stop_ids(meta: Mapping[str, Any], spelled: Sequence[str], eos: int | None, template: Any) -> list[int]:
    ids = [] if eos is None else [eos]
    for key in ("eot_token_id", "eom_token_id"):
        value = _meta_id(meta, key, len(spelled))
        if value is not None and value not in ids:
            ids.append(value)
    text = str(template or "")
    index = {token: i for i, token in enumerate(spelled) if token in END_OF_TURN_TOKENS}
    for token in END_OF_TURN_TOKENS:
        if token in index and token in text and index[token] not in ids:
            ids.append(index[token])
    return ids


# ---------------------------------------------------------------------------------------------
# Byte-level BPE (tokenizer.ggml.model == "gpt2")
# ---------------------------------------------------------------------------------------------


def _byte_level_bpe(meta: Mapping[str, Any], tokens: list[str], path: str) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    raw_merges = meta.get("tokenizer.ggml.merges")
    if not raw_merges:
        raise GGUFImportError(f"{path}: byte-level BPE tokenizer without merges (tokenizer.ggml.merges)")
    merges = []
    for merge in raw_merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise GGUFImportError(f"{path}: malformed merge {merge!r} in tokenizer.ggml.merges")
        merges.append((parts[0], parts[1]))

    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))

    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        log.warning("%s: unknown pre-tokenizer %r; using GPT-2's split", path, pre)
        split = _GPT2
    if split == _GPT2:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == _DIGITS_THEN_GPT2:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


# ---------------------------------------------------------------------------------------------
# SentencePiece-style BPE (tokenizer.ggml.model == "llama")
# ---------------------------------------------------------------------------------------------


def _sentencepiece_bpe(
    meta: Mapping[str, Any], tokens: list[str], types: list[int], arch: str, path: str
) -> Any:
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    gemma = arch.startswith("gemma")
    if gemma:
        # Gemma files store its whitespace-run tokens with real spaces; in the vocabulary that
        # BPE sees, after the normalizer, a space is always "▁".
        tokens = [SPIECE_SPACE * len(t) if t and set(t) == {" "} else t for t in tokens]
        # Gemma's merge order is its vocabulary order (earlier = merged first).
        priority = [-float(i) for i in range(len(tokens))]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise GGUFImportError(f"{path}: SentencePiece tokenizer without one score per token")
        priority = [float(s) for s in scores]

    vocab = {token: index for index, token in enumerate(tokens)}
    merges = merges_from_vocab(tokens, priority, vocab)
    unk_id = _meta_id(meta, "unknown_token_id", len(tokens))
    backend = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    pieces = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        # Gemma adds no space at the start of the text; spaces become "▁" before BPE.
        backend.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        # Llama-style SentencePiece prepends "▁" to the text ("add_dummy_prefix") unless told not
        # to, and its decoder removes that one space again.
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        scheme = "first" if prefix else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPIECE_SPACE, prepend_scheme=scheme, split=False
        )
        if prefix:
            pieces.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(pieces)
    return backend


def merges_from_vocab(
    tokens: Sequence[str], priority: Sequence[float], vocab: Mapping[str, int]
) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies.

    SentencePiece's BPE repeatedly joins the adjacent pair whose joined piece ranks highest. A BPE
    with a merge ``(left, right)`` for every token that splits into two vocabulary tokens,
    ordered by the joined token's priority (best first; for one token, longer left pieces
    first), makes the same choices.
    """
    candidates: list[tuple[float, int, int, int, str, str]] = []
    for order, token in enumerate(tokens):
        if len(token) < 2:
            continue
        rank = priority[order]
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                candidates.append((-rank, -len(left), -len(right), len(candidates), left, right))
    candidates.sort()
    return [(left, right) for *_, left, right in candidates]


# ---------------------------------------------------------------------------------------------
# Added tokens, post-processor
# ---------------------------------------------------------------------------------------------


def _add_special_tokens(
    backend: Any, tokens: Sequence[str], spelled: Sequence[str | None], types: Sequence[int]
) -> None:
    """Control tokens (``<|im_start|>``) become special added tokens; user-defined ones (``\\n\\n``
    in Gemma) plain added tokens. Either way the text is matched whole before BPE, as llama.cpp
    does; otherwise ``<|im_start|>`` would be cut into pieces. A user-defined token respelled for
    BPE (Gemma's space runs, now "▁▁") is left to BPE: its raw form never occurs after the
    normalizer."""
    from tokenizers import AddedToken

    control = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(spelled, types)
        if kind == CONTROL and token
    ]
    user = [
        AddedToken(token, special=False, normalized=False)
        for token, raw, kind in zip(spelled, tokens, types)
        if kind == USER_DEFINED and token and token == raw
    ]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _set_post_processor(
    backend: Any,
    model: str,
    spelled: Sequence[str | None],
    bos: int | None,
    eos: int | None,
    add_bos: bool,
    add_eos: bool,
) -> None:
    from tokenizers import processors

    if not add_bos and not add_eos:
        if model == "gpt2":
            backend.post_processor = processors.ByteLevel(trim_offsets=False)
        return
    single = " ".join(
        [*([f"{spelled[bos]}:0"] if add_bos else []), "$A:0", *([f"{spelled[eos]}:0"] if add_eos else [])]
    )
    pair = " ".join(
        [
            single,
            *([f"{spelled[bos]}:1"] if add_bos else []),
            "$B:1",
            *([f"{spelled[eos]}:1"] if add_eos else []),
        ]
    )
    special = []
    if add_bos:
        special.append((spelled[bos], bos))
    if add_eos and (not add_bos or eos != bos):
        special.append((spelled[eos], eos))
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
