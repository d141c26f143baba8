"""Structured output on the app side: checking a pasted JSON schema, and showing a JSON reply.

The engine constrains the reply (``engine.generation.constraints.json_schema``), but that module
imports torch, which must not load on the GUI thread. Its schema compiler,
``engine.generation.json_schema_grammar``, is plain Python (plus ``jsonschema``), and it is what
``json_schema`` runs first and what raises its ``ConstraintError`` messages: so the settings
dialog can refuse every schema the engine would refuse, with the same message, without torch.
The worker still builds the real constraint and reports any error it raises.

The reply is stored as the model wrote it (compact JSON) and formatted only for display, so
copying, exporting and sending it back to the model all use the exact text that was generated.
"""

from __future__ import annotations

import json
from typing import Any

# The engine's stop reason for a constrained reply that finished as a complete, valid document.
CONSTRAINT_COMPLETE = "constraint_complete"


def schema_problem(text: str) -> str:
    """Why ``text`` cannot be used as the structured-output schema ("" when it can, or is empty)."""
    if not text.strip():
        return ""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        return f"The JSON schema is not valid JSON: {exc}"
    # Lazy: only the settings dialog needs the compiler. Pure Python: no torch on the GUI thread.
    from engine.generation.json_schema_grammar import SchemaError, schema_to_kbnf

    try:
        schema_to_kbnf(schema)
    except SchemaError as exc:
        return f"This JSON schema cannot be used: {exc}"
    return ""


def display_text(content: str, stats: dict[str, Any]) -> str:
    """What the chat shows for a finished reply: a completed constrained reply as a pretty-printed
    JSON code block; anything else (or JSON that somehow does not parse) as written."""
    if stats.get("stop_reason") != CONSTRAINT_COMPLETE:
        return content
    try:
        value = json.loads(content)
    except ValueError:
        return content
    pretty = json.dumps(value, indent=2, ensure_ascii=False)
    # A fence longer than any backtick run in the JSON (strings may contain ```), so it stays one block.
    fence = "`" * max(3, _longest_backtick_run(pretty) + 1)
    return f"{fence}json\n{pretty}\n{fence}"


def _longest_backtick_run(text: str) -> int:
    longest = run = 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    return longest
