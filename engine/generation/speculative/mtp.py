"""Multi-token prediction (MTP) heads as a drafter: designed here, not implemented yet.

Some checkpoints carry extra layers trained to predict tokens further ahead: Qwen3.5 and
Qwen3-Next (``mtp.*`` tensors, ``mtp_num_hidden_layers`` in config.json), DeepSeek-V3 and
GLM-4.5 (``num_nextn_predict_layers`` extra decoder layers after the last one, with their own
``enorm``/``hnorm``/``eh_proj``). An MTP step takes the target's last hidden state (before the
final norm) and the embedding of the token just chosen, ``eh_proj(concat(hnorm(h), enorm(e)))``,
runs its layer(s) with their own KV cache, and predicts the token after.

What it needs from the engine, and why it is not here yet: the target's forward step would have
to return the last layer's hidden states of the verified positions next to the logits (the step
functions return logits only), the loader would have to keep the ``mtp.*`` / extra-layer tensors
(it skips them today), and the MTP layer's cache would follow the target's accepted length.
:class:`MtpDrafter` is the place for it; :func:`mtp_layers` already says whether a checkpoint
has such heads, so ``--draft mtp`` can tell a model without them from the missing feature.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.errors import UsageError
from engine.generation.speculative.drafter import Draft, Drafter, DraftRequest

NOT_IMPLEMENTED = (
    "MTP drafting (Qwen3.5 'mtp.*' heads, DeepSeek-V3/GLM-4.5 next-token layers) is not "
    "implemented yet (issue 38): it needs the target's hidden states from each step; use "
    "--draft ngram or --draft model:DIR"
)


class MtpNotImplementedError(UsageError, NotImplementedError):
    """``--draft mtp`` for a checkpoint that has MTP heads: the drafter does not exist yet (a
    UsageError too, so the command line says so in one line)."""


def mtp_layers(config: dict) -> int:
    """How many MTP layers a model's config.json (its dict, or its ``text_config``) declares."""
    text = config.get("text_config") or config
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers", "num_mtp_layers"):
        value = text.get(key) or config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0


class MtpDrafter(Drafter):
    """Drafts from the target checkpoint's own MTP heads (not implemented: see the module)."""

    kind = "mtp"

    def __init__(self, *args, **kwargs) -> None:
        raise MtpNotImplementedError(NOT_IMPLEMENTED)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:  # pragma: no cover
        raise MtpNotImplementedError(NOT_IMPLEMENTED)
