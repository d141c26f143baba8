"""The KV cache's width in words: "context memory", as the load options offer it.

The engine's cache stores keys and values at 16 bits (exact) or quantized to 2-8 bits. Users see
three choices, not two bit-width menus: 8-bit is the default because it halves the memory of
the context at a cost in accuracy too small to notice in chat; 4-bit quarters it. Widths set
some other way (an older version's settings) are shown as they are.
"""

from __future__ import annotations

from typing import NamedTuple


class ContextMemory(NamedTuple):
    key_bits: int
    value_bits: int
    label: str
    description: str


CHOICES: tuple[ContextMemory, ...] = (
    ContextMemory(16, 16, "Full precision", "Exact: 16 bits per number. The most memory per token."),
    ContextMemory(
        8, 8, "Compact (8-bit, recommended)", "Half the memory of full precision; no loss you would notice."
    ),
    ContextMemory(
        4, 4, "Smallest (4-bit)", "A quarter of the memory: the longest context, slightly less exact."
    ),
)
DEFAULT = CHOICES[1]


def describe(key_bits: int, value_bits: int) -> str:
    """The words for a width pair, e.g. "compact (8-bit)" for (8, 8)."""
    for choice in CHOICES:
        if (choice.key_bits, choice.value_bits) == (key_bits, value_bits):
            return choice.label.replace(", recommended", "")
    return f"custom ({key_bits}-bit keys, {value_bits}-bit values)"
