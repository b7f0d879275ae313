"""A Qwen2.5-style (Hermes) chat template for the tiny checkpoints: tools in the system turn, assistant tool calls
as <tool_call> JSON, tool results as <tool_response>, and Qwen3's enable_thinking switch."""
import json
from pathlib import Path

TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}Reply with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% if m.content %}{{ m.content }}
{% endif %}{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


def use_tool_template(ckpt: Path) -> Path:
    cfg_path = ckpt / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return ckpt
