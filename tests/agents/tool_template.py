"""The chat template of the agent tests (a module of its own: test folders share the name `conftest`)."""

TOOL_TEMPLATE = (
    "{% if tools %}T:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}U:{{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}A:{{ m['content'] }}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}")
"""Hermes-like: the tools by name first, a tool's answer in <tool_response> after the assistant turn that called it."""
