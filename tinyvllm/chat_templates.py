"""Chat templates of our own, for models whose files carry none.

A chat template is a Jinja program that turns a list of {role, content} messages into the one prompt string
the model was fine-tuned on. Models in Hugging Face layout normally ship theirs in tokenizer_config.json and
`Tokenizer.from_dir` uses that; these constants are for the rest (a bare tokenizer.json, a random test model,
a GGUF without one). They are rendered by `Tokenizer.apply_chat_template` with the same Jinja settings as
Hugging Face transformers (trim_blocks, lstrip_blocks), so the `{%-`/`{{-` markers below only strip the
indentation and newlines that make the source readable; every character of the output is inside a string
literal.
"""

from __future__ import annotations

CHATML_TEMPLATE = r"""
{%- for message in messages %}
    {{- "<|im_start|>" + message["role"] + "\n" + message["content"] + "<|im_end|>\n" }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|im_start|>assistant\n" }}
{%- endif %}
""".strip()
"""ChatML, as used by SmolLM2 Instruct, Qwen 1.5/2/2.5 and many other fine-tunes.

Each message is `<|im_start|>{role}\\n{content}<|im_end|>\\n`, the content untouched; the generation prompt
opens an assistant turn. No default system message is added (some models' own ChatML templates add one).
"""

LLAMA3_TEMPLATE = r"""
{{- bos_token }}
{%- if date_string is not defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages and messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] | trim %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
    {%- set rest = messages %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message + "<|eot_id|>" }}
{%- for message in rest %}
    {{- "<|start_header_id|>" + message["role"] + "<|end_header_id|>\n\n" }}
    {{- (message["content"] | trim) + "<|eot_id|>" }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|start_header_id|>assistant<|end_header_id|>\n\n" }}
{%- endif %}
""".strip()
"""Llama 3.1 / 3.2 Instruct (Llama 3.2 1B and 3B Instruct among them), without tool calling.

`<|begin_of_text|>`, then a system block that is always there: the knowledge cut-off, today's date
(`date_string` if the caller passes it, else the current date as "%d %b %Y") and the system message if the
conversation starts with one. Every other message is `<|start_header_id|>{role}<|end_header_id|>\\n\\n`,
its content stripped of surrounding whitespace, then `<|eot_id|>`; the generation prompt opens an assistant
header. This is what Meta's own template produces for a conversation without tools.
"""
