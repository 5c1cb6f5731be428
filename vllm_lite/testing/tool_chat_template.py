"""A Hermes-style, tool-aware chat template for the tiny test checkpoints (their own template knows no tools).

It writes what a Hermes/Qwen template writes: the `tools` in a system turn inside `<tools></tools>`,
an assistant's `tool_calls` as `<tool_call>{"name": .., "arguments": {..}}</tool_call>`, and `tool`
messages (with their `tool_call_id`) as `<tool_response>` turns, so tests can see every piece reach
the template. Pass it as `chat_template=` (build_app, --chat-template, or the request field).
"""

from __future__ import annotations

# transformers renders with trim_blocks and lstrip_blocks: a line holding only a tag leaves no text.
HERMES_TOOL_CHAT_TEMPLATE = """\
{% if tools %}
<|system|>
{% if messages[0].role == 'system' %}
{{ messages[0].content }}
{% endif %}
You may call functions. Their signatures are inside <tools></tools>:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>
For each call reply with <tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call></s>
{% elif messages[0].role == 'system' %}
<|system|>
{{ messages[0].content }}</s>
{% endif %}
{% for message in messages %}
{% if message.role == 'system' and loop.first %}
{% elif message.role == 'assistant' and message.tool_calls %}
<|assistant|>
{% if message.content %}
{{ message.content }}
{% endif %}
{% for call in message.tool_calls %}
<tool_call>{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{% endfor %}
</s>
{% elif message.role == 'tool' %}
<|tool|>
<tool_response tool_call_id={{ message.tool_call_id | tojson }}>{{ message.content }}</tool_response></s>
{% else %}
<|{{ message.role }}|>
{{ message.content }}</s>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""
