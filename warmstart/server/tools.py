"""Tool calling: tools to the chat template, model output to OpenAI tool_calls.

tool_choice "auto" lets the model write freely and a parser per model family finds the calls in its text (vLLM's
names: "hermes", the <tool_call>{json}</tool_call> blocks Qwen2/Qwen3 and Hermes models write; "llama3_json", the
bare {"name", "parameters"} object Llama 3 writes). "required" and a named function are enforced by constrained
decoding instead: the output is generated under a JSON schema (an array of calls, or the named function's
arguments), so it always parses. "none" leaves tools out of the prompt and parses nothing."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from warmstart.server.protocol import ChatCompletionRequest, ChatMessage, bad_request

PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str                       # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request does with tools. mode: "none" | "auto" | "required" | "named"."""
    mode: str
    tools: list[dict]                    # the template's view: [{"type": "function", "function": {...}}]
    parser: str
    named: str | None = None
    parallel: bool = True                # parallel_tool_calls: false allows one call at most

    @property
    def template_tools(self) -> list[dict] | None:
        return self.tools if self.tools and self.mode != "none" else None

    def grammar(self) -> tuple[str, Any] | None:
        """The JSON schema that required / named choices decode under."""
        if self.mode == "named":
            return "json", _parameters(self._by_name(self.named))
        if self.mode == "required":
            one = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                     "parameters": _parameters(t)},
                    "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
            schema = {"type": "array", "minItems": 1, "items": one[0] if len(one) == 1 else {"anyOf": one}}
            return "json", schema if self.parallel else {**schema, "maxItems": 1}
        return None

    def _by_name(self, name: str | None) -> dict:
        return next(t for t in self.tools if t["function"]["name"] == name)

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        """(content, calls) of a finished output."""
        if self.mode == "named":
            return None, [Call(self.named, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
                return None, [Call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
                              for c in items]
            except (ValueError, TypeError, KeyError):        # cut off by max_tokens: not a call
                return text, []
        if self.mode == "auto":
            return (parse_llama3_json if self.parser == "llama3_json" else parse_hermes)(text)
        return text, []

    def safe_content(self, text: str) -> int:
        """While streaming: how many characters of text are surely content (never part of a call)."""
        if self.mode in ("named", "required"):
            return 0
        if self.mode == "none":
            return len(text)
        if self.parser == "llama3_json":
            head = text.lstrip()
            return 0 if not head or head.startswith(("{", "<|python_tag|>")) or \
                "<|python_tag|>".startswith(head) else len(text)
        at = text.find(_HERMES_OPEN)
        if at >= 0:
            return at
        for k in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):      # a marker may be starting
            if _HERMES_OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)


def _parameters(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def plan_tools(req: ChatCompletionRequest, parser: str) -> ToolPlan:
    tools = []
    for i, t in enumerate(req.tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("Each tool must be {\"type\": \"function\", \"function\": {\"name\", ...}}.",
                              f"tools.{i}")
        tools.append({"type": "function", "function": fn})
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name is None:
            raise bad_request("tool_choice must be auto, none, required or {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}}.", "tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools.", "tool_choice")
        return ToolPlan("named", tools, parser, name, req.parallel_tool_calls)
    if choice not in ("auto", "none", "required"):
        raise bad_request(f"tool_choice must be auto, none, required or a named function, got {choice!r}.",
                          "tool_choice")
    if choice != "none" and not tools:
        raise bad_request(f"tool_choice {choice!r} needs tools.", "tool_choice")
    return ToolPlan(choice, tools, parser, None, req.parallel_tool_calls)


def default_parser(chat_template: str | None, model_type: str) -> str:
    """Llama 3 writes bare JSON; Qwen and Hermes-style templates say <tool_call>."""
    if chat_template and "<tool_call>" in chat_template:
        return "hermes"
    return "llama3_json" if model_type == "llama" else "hermes"


def template_message(m: ChatMessage) -> dict:
    """A history message as HF chat templates read it: tool call arguments as objects (templates tojson them),
    tool results with their call id."""
    out: dict = {"role": m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args = json.loads(c.function.arguments) if c.function.arguments else {}
            except ValueError:
                args = c.function.arguments
            calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
        out["tool_calls"] = calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


_HERMES_OPEN = "<tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[Call]]:
    at = text.find(_HERMES_OPEN)
    if at < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text[at:]):
        call = _call(body)
        if call is None:
            return text, []                  # not well-formed: show the text rather than lose it
        calls.append(call)
    content = text[:at]
    return (content if content.strip() else None), calls


def parse_llama3_json(text: str) -> tuple[str | None, list[Call]]:
    body = text.strip()
    body = body.removeprefix("<|python_tag|>").lstrip()
    if not body.startswith("{"):
        return text, []
    calls, pos, dec = [], 0, json.JSONDecoder()
    while pos < len(body):
        try:
            obj, end = dec.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call(obj)
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls


def _call(obj: Any) -> Call | None:
    if isinstance(obj, str):
        try:
            obj = json.loads(obj)
        except ValueError:
            return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return Call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
