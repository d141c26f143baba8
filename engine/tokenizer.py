"""The model's tokenizer: HF ``tokenizers`` for text <-> ids, plus its Jinja chat template.

A model directory in Hugging Face format carries ``tokenizer.json`` (the whole tokenization
pipeline, which the ``tokenizers`` library runs) and ``tokenizer_config.json`` (special tokens,
BOS/EOS flags and the chat template). This module reads both and offers what the engine needs:

* :meth:`Tokenizer.encode` / :meth:`Tokenizer.decode` with Hugging Face's add-BOS rules;
* :meth:`Tokenizer.apply_chat_template` rendering the model's own template in a Jinja sandbox,
  within time and size limits, because templates come from the internet and are untrusted code
  (see :mod:`engine.chat_template`);
* :meth:`Tokenizer.incremental_decoder` for streaming text out of generated ids without ever
  showing half a UTF-8 character.

Nothing here imports ``transformers``; the tests compare against it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2

from engine.chat_template import (
    ChatTemplateError,
    ChatTemplateLimitError,
    TemplateLimits,
    compile_template,
    input_size,
    render_template,
)
from engine.config import require_model_dir
from engine.errors import TokenizerError

__all__ = ["ChatTemplateError", "ChatTemplateLimitError", "IncrementalDecoder", "TemplateLimits", "Tokenizer"]

# Named special tokens a chat template may refer to by variable (``{{ bos_token }}`` ...).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)

REPLACEMENT_CHAR = "\ufffd"


# ---------------------------------------------------------------------------------------------
# Reading the files
# ---------------------------------------------------------------------------------------------


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string, or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path.parent}: cannot read {path.name} ({what}): {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path.parent}: {path.name} ({what}) is not a JSON object")
    return data


def _select_template(value: Any, directory: Path) -> str | None:
    """tokenizer_config's ``chat_template`` is a string or a list of ``{name, template}``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {
            item.get("name"): item.get("template")
            for item in value
            if isinstance(item, Mapping) and isinstance(item.get("template"), str)
        }
        if "default" in named:
            return named["default"]
        # No "default": a list with a single template is unambiguous; more than one is not.
        if len(named) == 1:
            return next(iter(named.values()))
        return None
    raise TokenizerError(
        f"{directory}: tokenizer_config.json has a chat_template of type {type(value).__name__}"
    )


# ---------------------------------------------------------------------------------------------
# Template data
# ---------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A copy of ``value`` made of plain JSON-like types only.

    The sandbox guards attribute access, but an arbitrary object handed in (a numpy array, a
    PIL image...) may have methods that are harmful yet look harmless to it; templates only ever
    need plain data.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums...) may carry methods: keep the plain value
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(type(value).__name__)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """``tokenizer.json`` + ``tokenizer_config.json`` of one model directory."""

    def __init__(
        self, backend: Any, config: Mapping[str, Any], chat_template: str | None, source: str
    ) -> None:
        self._tok = backend
        self._config = dict(config)
        self._compiled_template: jinja2.Template | None = None
        self.chat_template = chat_template
        self.source = source
        # Bounds on rendering the template; ChatSession sizes them for the model's context.
        self.template_limits = TemplateLimits()

        self.special_tokens: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_text(self._config.get(name))
            if text is not None:
                self.special_tokens[name] = text
        self._bos_id = self._id_of(self.special_tokens.get("bos_token"))
        self._eos_id = self._id_of(self.special_tokens.get("eos_token"))
        self._pad_id = self._id_of(self.special_tokens.get("pad_token"))
        self._add_bos, self._add_eos, self._manual_specials = self._bos_eos_rules()

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (required), ``tokenizer_config.json`` and ``chat_template.jinja``
        (both optional) from a model directory."""
        from tokenizers import Tokenizer as Backend  # deferred: keeps `import engine` light

        directory = Path(path)
        require_model_dir(directory)  # a wrong path is named as such, not as a missing tokenizer
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{directory}: tokenizer.json is missing (the model has no fast tokenizer)")
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust library raises plain Exception on bad JSON
            raise TokenizerError(f"{directory}: cannot read tokenizer.json: {exc}") from exc

        config_file = directory / "tokenizer_config.json"
        config = _read_json(config_file, "tokenizer settings") if config_file.is_file() else {}

        # transformers >= 4.43 may save the template as its own file; it wins over the JSON one.
        template_file = directory / "chat_template.jinja"
        if template_file.is_file():
            try:
                template = template_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise TokenizerError(f"{directory}: cannot read chat_template.jinja: {exc}") from exc
        else:
            template = _select_template(config.get("chat_template"), directory)
        return cls(backend, config, template, str(directory))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _bos_eos_rules(self) -> tuple[bool, bool, bool]:
        """Whether ``encode`` adds BOS / EOS, and whether tokenizer_config's flags decide it.

        tokenizer.json's post-processor, when it has one, decides (as transformers 5 does; Llama
        and Gemma repositories keep it in step with ``add_bos_token``). Without a post-processor,
        ``add_bos_token``/``add_eos_token`` from tokenizer_config decide, as transformers' Llama
        and Gemma tokenizers do. We learn what the post-processor does by running it on a probe.
        """
        cfg = self._config
        if self._tok.post_processor is None:
            add_bos = bool(cfg.get("add_bos_token")) and self._bos_id is not None
            add_eos = bool(cfg.get("add_eos_token")) and self._eos_id is not None
            return add_bos, add_eos, True
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        add_bos = self._bos_id is not None and full[:1] == [self._bos_id] and plain[:1] != [self._bos_id]
        add_eos = self._eos_id is not None and full[-1:] == [self._eos_id] and plain[-1:] != [self._eos_id]
        return add_bos, add_eos, False

    # -- properties --------------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token_ids(self) -> set[int]:
        """EOS from tokenizer_config (generation_config.json's ids are merged by the caller)."""
        return set() if self._eos_id is None else {self._eos_id}

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_id

    @property
    def add_bos_token(self) -> bool:
        return self._add_bos

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the embedding may be larger, never smaller)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> set[int]:
        """Ids of every special added token (skipped by ``decode(skip_special_tokens=True)``)."""
        ids = {index for index, token in self._tok.get_added_tokens_decoder().items() if token.special}
        ids.update(i for i in (self._bos_id, self._eos_id, self._pad_id) if i is not None)
        return ids

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, index: int) -> str | None:
        return self._tok.id_to_token(index)

    # -- encode / decode ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text``; with ``add_special_tokens`` the model's BOS/EOS rules apply, but a text
        that already starts with the BOS token (e.g. a rendered chat) never gets a second one."""
        if not add_special_tokens:
            return self._tok.encode(text, add_special_tokens=False).ids
        if self._manual_specials:
            return self._with_specials(self._tok.encode(text, add_special_tokens=False).ids, self._add_eos)
        ids = self._tok.encode(text, add_special_tokens=True).ids
        if self._add_bos and ids[:2] == [self._bos_id, self._bos_id] and self._starts_with_bos(text):
            ids = ids[1:]
        return ids

    def _starts_with_bos(self, text: str) -> bool:
        bos = self.bos_token
        return bool(bos) and text.startswith(bos)

    def _with_specials(self, ids: list[int], add_eos: bool) -> list[int]:
        if self._add_bos and ids[:1] != [self._bos_id]:
            ids = [self._bos_id, *ids]
        if add_eos:
            ids = [*ids, self._eos_id]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        # No clean_up_tokenization_spaces: it corrupts BPE output (" ." -> "."), and transformers 5
        # ignores it for BPE models too.
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # -- chat ---------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @chat_template.setter
    def chat_template(self, text: str | None) -> None:
        self._chat_template = text
        self._compiled_template = None  # compiled again on next use

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def _template(self) -> jinja2.Template:
        if self._compiled_template is None:
            if not self.chat_template:
                raise ChatTemplateError(
                    f"{self.source}: the model has no chat template (tokenizer_config.json has no "
                    "chat_template and there is no chat_template.jinja); use plain completion instead"
                )
            self._compiled_template = compile_template(self.chat_template, self.source)
        return self._compiled_template

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the model's template.

        ``extra`` reaches the template as variables (``tools``, ``documents``, ``enable_thinking``...).
        The template sees the special tokens by name (``bos_token``...), as under transformers.
        Rendering is bounded by :attr:`template_limits`; past one, ChatTemplateLimitError says which.
        """
        template = self._template()
        # A message key set to None is treated as absent: templates test `is defined`, and
        # rendering "None" into a prompt is never what the caller meant.
        chat = [{k: v for k, v in _plain(dict(m)).items() if v is not None} for m in messages]
        context: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens}
        context.update(_plain(extra))
        context["messages"] = chat
        context["add_generation_prompt"] = add_generation_prompt
        return render_template(
            template, context, self.template_limits, self.source, input_chars=input_size(context)
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        """Render + encode. The template writes its own special tokens; BOS is added only where the
        model wants one and the template did not write it, and EOS is never appended."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return self._with_specials(ids, add_eos=False)


# ---------------------------------------------------------------------------------------------
# Streaming detokenization
# ---------------------------------------------------------------------------------------------


class IncrementalDecoder:
    """Turns generated ids into text pieces as they arrive.

    Decoding one id at a time is wrong in two ways: a character may span several byte tokens
    (``<0xE2><0x82><0xAC>`` is "€"), and decoders that strip the leading space of the first token
    (SentencePiece) would eat every space. So each step decodes a short window -- the tokens
    already shown as context, plus the new ones -- and emits only what the new ones add, holding
    text back while it ends in an incomplete UTF-8 sequence (U+FFFD). The window is trimmed after
    each emission, so a step costs O(window), not O(sequence).
    """

    # Past this many pending ids a trailing U+FFFD cannot be an incomplete character (a UTF-8
    # sequence is at most 4 bytes) -- the model really produced invalid bytes -- so it is shown.
    MAX_PENDING = 8

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context: ids already emitted, decoded only for context
        self._read = 0  # start of ids whose text has not been emitted yet

    @property
    def window_size(self) -> int:
        """Ids currently kept for decoding (context + pending); stays small, whatever the length."""
        return len(self._ids) - self._prefix

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Feed one generated id; return the text it completes (often "", never half a character)."""
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is still held back (at the end of generation), then reset."""
        text = self._emit(final=True)
        self._ids, self._prefix, self._read = [], 0, 0
        return text

    def _emit(self, final: bool) -> str:
        ids = self._ids
        if self._read >= len(ids):
            return ""
        context = self._decode(ids[self._prefix : self._read])
        full = self._decode(ids[self._prefix :])
        pending = len(ids) - self._read
        if not final and full.endswith(REPLACEMENT_CHAR) and pending < self.MAX_PENDING:
            return ""
        new = full[len(context) :] if len(full) > len(context) else ""
        if new:
            # The just-emitted ids become the next context; older ones are no longer needed.
            # (When they decoded to nothing, e.g. a skipped special token, the old context stays:
            # a context that decodes to "" would make the next token look sequence-initial.)
            del ids[: self._read]
            self._prefix = 0
        self._read = len(ids)
        return new
