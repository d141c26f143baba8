"""From a drafting setting (``--draft`` on the command line, ``EngineOptions.draft``) to a
drafter: ``off``, ``ngram``, ``model:DIR``, ``mtp``, or ``auto`` (what the front ends use when the
user chose nothing: n-gram drafting on the CPU, where it was measured never slower than plain
decoding with the starter model; off on a GPU, where a prompt measured 0.93x and a verify step of
an 8B-class model costs 1.3-2x a plain one: docs/SPECULATIVE.md)."""

from __future__ import annotations

from pathlib import Path

from engine.architectures.mtp_names import declared_mtp_layers
from engine.errors import UsageError
from engine.generation.speculative.draft_model import ModelDrafter
from engine.generation.speculative.drafter import Drafter
from engine.generation.speculative.mtp import MtpDrafter
from engine.generation.speculative.ngram import NgramDrafter
from engine.generation.speculative.speculation import MAX_DRAFT_TOKENS

DRAFT_CHOICES = "off, auto, ngram, model:DIR or mtp"


def parse_draft(text: str | None) -> tuple[str, Path | None]:
    """``(kind, directory)`` of a drafting setting; a UsageError names what is accepted."""
    value = (text or "off").strip()
    if value in ("off", "auto", "ngram", "mtp"):
        return value, None
    if value.startswith("model:") and value[len("model:") :].strip():
        return "model", Path(value[len("model:") :].strip()).expanduser()
    raise UsageError(f"--draft takes {DRAFT_CHOICES}, got {text!r}")


def check_mtp(config: dict, name: str) -> None:
    """Refuse ``--draft mtp`` for a model whose config.json declares no MTP heads."""
    if not declared_mtp_layers(config):
        raise UsageError(f"--draft mtp: {name} has no MTP heads in its config.json")


def check_draft_tokens(count: int) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_DRAFT_TOKENS:
        raise UsageError(f"--draft-tokens must be a whole number in 1..{MAX_DRAFT_TOKENS}, got {count!r}")
    return count


def make_drafter(
    text: str | None, model, tokenizer=None, cache=None, max_sequences: int = 16, cuda_graphs: bool = True
) -> Drafter | None:
    """The drafter a setting names for the target ``model`` (its ``tokenizer`` and ``cache`` size
    a draft model's own), or None for ``off``. ``cuda_graphs``: a draft model replays its steps
    from CUDA graphs on a GPU (``EngineOptions.cuda_graphs``)."""
    kind, directory = parse_draft(text)
    if kind == "auto":
        kind = "ngram" if model.device.type == "cpu" else "off"
    if kind == "off":
        return None
    if kind == "ngram":
        return NgramDrafter()
    if kind == "mtp":
        check_mtp(model.config.raw, model.directory.name)
        tokens = cache.capacity if cache is not None else None
        page_size = cache.page_size if cache is not None else 64
        return MtpDrafter(model, tokens, max_sequences=max_sequences, page_size=page_size)
    return _model_drafter(directory, model, tokenizer, cache, max_sequences, cuda_graphs)


def _model_drafter(
    directory: Path, model, tokenizer, cache, max_sequences: int, cuda_graphs: bool
) -> ModelDrafter:
    from engine.model import load_model
    from engine.tokenizer import Tokenizer

    draft_tokenizer = Tokenizer.from_dir(directory)  # fail fast, before reading weights
    if tokenizer is not None and not same_vocabulary(tokenizer, draft_tokenizer):
        raise UsageError(
            f"the draft model {directory} does not share the target's tokenizer (its vocabulary "
            "differs): a draft model must use the same token ids"
        )
    draft = load_model(directory, device=str(model.device), dtype=model.dtype)
    vocab = int(model.config.get("vocab_size") or draft.config.get("vocab_size"))
    tokens = cache.capacity if cache is not None else min(model.spec.max_position_embeddings, 8192)
    page_size = cache.page_size if cache is not None else 64
    return ModelDrafter(
        draft, vocab, tokens, max_sequences=max_sequences, page_size=page_size, cuda_graphs=cuda_graphs
    )


def same_vocabulary(a, b) -> bool:
    """Whether two tokenizers map every id to the same token."""
    if a.vocab_size != b.vocab_size:
        return False
    return all(a.id_to_token(i) == b.id_to_token(i) for i in range(a.vocab_size))
