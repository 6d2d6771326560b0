"""Chat templates for GGUF files that carry none (tokenizer.chat_template missing), chosen by the turn
markers the file's own vocabulary defines, as llama.cpp does when a file has no template.

Only the turn formats whose markers are unambiguous are known here; any other file without a template is
refused by the converter with a message naming it.
"""

from __future__ import annotations

from collections.abc import Collection

# Gemma's turns: <start_of_turn>{user|model}\n ... <end_of_turn>\n; no system role, so a system message is
# put before the first user message; the prompt starts with <bos> (the server encodes the rendered text
# without adding special tokens).
_START_END_OF_TURN = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = message['content'] | selectattr('type', 'equalto', 'text') "
    "| map(attribute='text') | join('\n\n') -%}{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = ns.system + text + '\n\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{%- if message['role'] == 'user' -%}{{ ns.system }}{%- set ns.system = '' -%}{%- endif -%}"
    "{{ text | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# (markers that must all be control tokens of the vocabulary, the template, the token that ends a turn)
_BY_MARKERS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("<start_of_turn>", "<end_of_turn>"), _START_END_OF_TURN, "<end_of_turn>"),
)


def template_for_vocabulary(control_tokens: Collection[str]) -> tuple[str, str] | None:
    """(template, end-of-turn token) for a vocabulary with these control tokens; None if none fits."""
    for markers, template, end in _BY_MARKERS:
        if all(m in control_tokens for m in markers):
            return template, end
    return None
