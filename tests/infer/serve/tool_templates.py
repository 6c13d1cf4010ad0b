"""Chat templates with tools, in the formats the model families publish, and tokenizer directories
that carry them (built from tests/hf_tokenizers.py; no downloads): Qwen 2.5 (its template as
published; Qwen 3 calls tools the same way), Llama 3.1 (tools in the first user turn, calls as
{"name", "parameters"}, results as ipython turns; built-in tools left out) and Mistral v3 ([TOOL_CALLS]
and the other markers as special tokens; call ids of 9 characters)."""

from __future__ import annotations

import json
from pathlib import Path

QWEN25_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501 (the template as published)

LLAMA31_TOOLS = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n" + system_message + "<|eot_id|>" }}
{%- if tools is not none %}
    {%- set first_user_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
    {{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\\n\\n' }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) + "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'tool' or message.role == 'ipython' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message.content + "<|eot_id|>" }}
    {%- elif message.tool_calls %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""  # noqa: E501

MISTRAL_TOOLS = """{{- bos_token }}
{%- set user_messages = messages | selectattr("role", "equalto", "user") | list %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {%- if tools and message == user_messages[-1] %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}{{- tool | tojson }}{{- ", " if not loop.last }}{%- endfor %}
            {{- "][/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST] " + message.content + "[/INST]" }}
    {%- elif message.tool_calls %}
        {{- "[TOOL_CALLS] [" }}
        {%- for call in message.tool_calls %}
            {%- if call.id is not string or call.id | length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- {"name": call.function.name, "arguments": call.function.arguments, "id": call.id} | tojson }}
            {{- ", " if not loop.last }}
        {%- endfor %}
        {{- "]" + eos_token }}
    {%- elif message.role == "tool" %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content | tojson + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- elif message.role == "assistant" %}
        {{- " " + message.content + eos_token }}
    {%- endif %}
{%- endfor %}
"""  # noqa: E501
MISTRAL_SPECIALS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]
MISTRAL_SPECIALS += ["[TOOL_RESULTS]", "[/TOOL_RESULTS]"]


def with_template(path: Path, template: str, specials: tuple[str, ...] = ()) -> Path:
    """A tokenizer directory given another chat template (chat_template.jinja wins over
    tokenizer_config.json's, as in transformers) and extra special tokens."""
    if specials:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        tok.add_special_tokens(list(specials))
        tok.save(str(path / "tokenizer.json"))
        config = json.loads((path / "tokenizer_config.json").read_text())
        config.pop("added_tokens_decoder", None)  # transformers rebuilds it from tokenizer.json
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(template)
    return path
