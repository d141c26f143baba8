"""Chat templates for GGUF files that carry none.

Some GGUF conversions drop ``tokenizer.chat_template`` (the Gemma 3 270M file we test with has
none), which would leave a chat model unable to chat. When the vocabulary shows the family's
turn tokens, we write a template of our own that produces that family's documented turn format.
"""

from __future__ import annotations

from collections.abc import Collection

# Gemma turn format: "<start_of_turn>{user|model}\n{text}<end_of_turn>\n", after <bos>. Gemma has
# no system role: a system message is put at the top of the first user turn, followed by a blank
# line. Turns must alternate user/model. Content may be a string or a list of typed parts.
GEMMA_CHAT_TEMPLATE = """{{- bos_token -}}
{%- set ns = namespace(system='', turns=messages) -%}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set first = messages[0]['content'] -%}
  {%- set ns.system = first if first is string
      else first | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}
  {%- set ns.turns = messages[1:] -%}
{%- endif -%}
{%- for message in ns.turns -%}
  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
  {%- if (role == 'user') != (loop.index0 % 2 == 0) -%}
    {{- raise_exception('Gemma conversations must alternate user and assistant turns, starting with user') -}}
  {%- endif -%}
  {{- '<start_of_turn>' + role + '\\n' -}}
  {%- if loop.first and ns.system -%}{{- ns.system + '\\n\\n' -}}{%- endif -%}
  {%- if message['content'] is string -%}
    {{- message['content'] | trim -}}
  {%- else -%}
    {%- for part in message['content'] -%}
      {%- if part['type'] == 'image' -%}{{- '<start_of_image>' -}}
      {%- elif part['type'] == 'text' -%}{{- part['text'] | trim -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
  {{- '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}
"""

_FALLBACKS = {
    "gemma": (GEMMA_CHAT_TEMPLATE, ("<start_of_turn>", "<end_of_turn>")),
}


def fallback_chat_template(architecture: str, vocabulary: Collection[str]) -> str | None:
    """Our template for ``architecture`` (a GGUF ``general.architecture``) when its turn tokens
    are in ``vocabulary``; None when we have no template for it."""
    for family, (template, needed) in _FALLBACKS.items():
        if architecture.startswith(family) and all(token in vocabulary for token in needed):
            return template
    return None
