"""Tool-call and reasoning parsers on model text, and the streaming rule that makes deltas add up to the final
message whatever the chunking."""
from __future__ import annotations

import json

import pytest

from warmstart.server.chat import ChatPlan, ChoiceStream, final_split, text_deltas, message
from warmstart.server.reasoning import default_parser as default_reasoning
from warmstart.server.reasoning import split_qwen3
from warmstart.server.tools import ToolPlan, default_parser, parse_hermes, parse_llama3_json

TOOLS = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]


def test_hermes_finds_every_call_and_keeps_content_before():
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n' \
           '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert parse_hermes("no calls here") == ("no calls here", [])
    assert parse_hermes("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])


def test_llama3_json_reads_bare_objects_and_python_tag():
    content, calls = parse_llama3_json('<|python_tag|>{"name": "f", "parameters": {"a": "b"}}; {"name": "g", '
                                       '"parameters": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": "b"}), ("g", {})]
    assert parse_llama3_json("Hello {not a call}") == ("Hello {not a call}", [])


def test_parser_defaults_follow_template_and_family():
    assert default_parser("... <tool_call> ...", "llama") == "hermes"
    assert default_parser("{{ messages }}", "llama") == "llama3_json"
    assert default_parser(None, "qwen2") == "hermes"
    assert default_reasoning("{% if enable_thinking %}<think>{% endif %}") == "qwen3"
    assert default_reasoning("plain") is None


def test_qwen3_split():
    assert split_qwen3("<think>\nhmm\n</think>\n\nAnswer", True) == ("\nhmm\n", "Answer")
    assert split_qwen3("Answer only", True) == (None, "Answer only")
    assert split_qwen3("<think>still thinking</th", False) == ("still thinking", "")
    assert split_qwen3("<thi", False) == (None, "")


def _streamed(plan: ChatPlan, pieces: list[str]) -> tuple[dict, list[dict]]:
    s, deltas = ChoiceStream(), []
    for k, piece in enumerate(pieces):
        s.text += piece
        deltas += text_deltas(plan, s, k == len(pieces) - 1)
    rest, calls = final_split(plan, s, "stop")
    if rest:
        deltas.append({"content": rest})
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    return {"reasoning": reasoning, "content": content, "calls": calls}, deltas


TEXTS = [
    "<think>\nplan it\n</think>\n\nSure.<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 2}}\n</tool_call>",
    "<think>only thinking",
    "plain answer with a < sign and <tool_ but no call",
    "<tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_stream_deltas_add_up_to_the_final_message(text, size):
    plan = ChatPlan(None, [], [], ToolPlan("auto", TOOLS, "hermes"), True)
    final, deltas = _streamed(plan, [text[i:i + size] for i in range(0, len(text), size)])
    msg, reason = message(plan, text, "stop")
    assert final["content"] == (msg["content"] or "")
    assert final["reasoning"] == (msg.get("reasoning_content") or "")
    assert [c["function"] for c in final["calls"]] == [c["function"] for c in msg.get("tool_calls", [])]
    assert (reason == "tool_calls") == bool(final["calls"])
    assert not any("<tool_call>" in d.get("content", "") for d in deltas)       # a call never leaks as text
