"""Structured outputs from a request: OpenAI's response_format and vLLM's structured_outputs / guided_* spellings,
reduced to one (kind, spec) and compiled off the event loop and off the engine thread."""
from __future__ import annotations

import asyncio
from typing import Any

from warmstart.errors import UserError
from warmstart.runner.grammar import Grammar, GrammarCompiler
from warmstart.server.protocol import SamplingRequest, bad_request

GrammarSpec = tuple[str, Any]          # (kind, spec): ("json", schema) | ("regex", str) | ("choice", [...]) | ...

_ANY_OBJECT = {"type": "object"}
_STRUCTURED_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def requested_grammar(req: SamplingRequest, response_format: dict | None = None) -> GrammarSpec | None:
    """The one grammar a request asks for, or None. More than one way of asking is a 400."""
    found: list[tuple[str, GrammarSpec]] = []
    if response_format:
        kind = response_format.get("type")
        if kind == "json_object":
            found.append(("response_format", ("json", _ANY_OBJECT)))
        elif kind == "json_schema":
            js = response_format.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise bad_request("response_format json_schema needs json_schema.schema, a JSON object.",
                                  "response_format")
            found.append(("response_format", ("json", schema)))
        elif kind != "text":
            raise bad_request(f"response_format type {kind!r} is not supported; use text, json_object or "
                              "json_schema.", "response_format")
    so = req.structured_outputs or {}
    for key, kind in _STRUCTURED_KEYS.items():
        if so.get(key) is not None:
            found.append(("structured_outputs", (kind, so[key])))
    if so.get("json_object"):
        found.append(("structured_outputs", ("json", _ANY_OBJECT)))
    unknown = set(so) - set(_STRUCTURED_KEYS) - {"json_object"}
    if unknown:
        raise bad_request(f"structured_outputs: unsupported keys {sorted(unknown)}.", "structured_outputs")
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        value = getattr(req, field)
        if value is not None:
            found.append((field, (kind, value)))
    if len(found) > 1:
        raise bad_request(f"Ask for one structured output at a time, got {', '.join(f for f, _ in found)}.",
                          found[1][0])
    return found[0][1] if found else None


async def compile_grammar(compiler: GrammarCompiler, spec: GrammarSpec, param: str) -> Grammar:
    """Compile in the default thread pool: a large schema takes milliseconds to seconds, which must stall neither
    the event loop nor the engine thread. A bad grammar is a 400."""
    try:
        return await asyncio.get_running_loop().run_in_executor(None, compiler.compile, *spec)
    except UserError as e:
        raise bad_request(str(e), param) from None
