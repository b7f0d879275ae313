"""Reasoning parsers: split a thinking model's output into reasoning_content and content, as vLLM does.

"qwen3": the output opens with <think> and the reasoning runs to </think>; what follows is the content. An output
that does not open with <think> is all content (Qwen3 with enable_thinking false gets an empty think block in the
prompt). The split is a function of the text so far, so streaming deltas and the final message always agree."""
from __future__ import annotations

PARSERS = ("qwen3",)
_OPEN, _CLOSE = "<think>", "</think>"


def _held(text: str, marker: str) -> int:
    """Characters at the end of text that could be the start of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def split_qwen3(text: str, finished: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) visible so far; unfinished text holds back a possible partial marker."""
    if not text.startswith(_OPEN):
        if not finished and _OPEN.startswith(text):
            return None, ""
        return None, text
    body = text[len(_OPEN):]
    end = body.find(_CLOSE)
    if end < 0:
        return body[:len(body) - (0 if finished else _held(body, _CLOSE))], ""
    return body[:end], body[end + len(_CLOSE):].lstrip("\n")


def default_parser(chat_template: str | None) -> str | None:
    """Qwen3's template (it knows enable_thinking and <think>) gets the qwen3 parser without a flag."""
    if chat_template and "<think>" in chat_template and "enable_thinking" in chat_template:
        return "qwen3"
    return None
