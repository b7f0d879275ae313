"""POST /v1/responses: the text subset of OpenAI's Responses API that the OpenAI Agents SDK uses: input as a string
or items (messages, function_call, function_call_output), instructions, function tools, text.format, streaming
events. It is translated into a chat request and served by chat.py's path, so templates, tool calls, structured
outputs and parsers behave exactly as on /v1/chat/completions. Not kept: stored responses (previous_response_id),
built-in tools, reasoning items, n > 1."""
from __future__ import annotations

import json
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, ValidationError

from warmstart.server.chat import ChatPlan, ChoiceStream, final_split, text_deltas, message, prepare
from warmstart.server.protocol import ChatCompletionRequest, TopLevelRequest, bad_request, parse, validation_error
from warmstart.server.serving import SSE_HEADERS, Generation, ServingContext, now, server_error

ROUTE = "/v1/responses"
# Fields the Agents SDK and the openai client send that change nothing here (or only say "the default").
_NO_OPS = {"store", "metadata", "user", "service_tier", "include", "truncation", "prompt_cache_key",
           "safety_identifier"}


class ResponsesRequest(TopLevelRequest):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    text: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        unknown = sorted(set(self.model_extra or ()) - _NO_OPS)
        if unknown:
            raise bad_request(f"Unsupported field{'s' if len(unknown) > 1 else ''} for /v1/responses: "
                              f"{', '.join(unknown)}.", unknown[0], "unsupported_parameter")
        if (self.model_extra or {}).get("truncation") not in (None, "disabled"):
            raise bad_request("Only truncation \"disabled\" is supported.", "truncation")


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The equivalent chat request; a malformed item is a 400 naming it."""
    messages: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content
                                  if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text"))
            messages.append({"role": item.get("role"), "content": content})
        elif kind == "function_call":
            call = {"id": item.get("call_id", ""), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("content") is None:
                last.setdefault("tool_calls", []).append(call)      # parallel calls form one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind != "reasoning":                     # our own reasoning items carry nothing the template needs
            raise bad_request(f"input item type {kind!r} is not supported.", f"input.{i}.type")
    body: dict[str, Any] = {"model": req.model, "messages": messages, "parallel_tool_calls": req.parallel_tool_calls}
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function":
                raise bad_request(f"Only function tools are supported, got {t.get('type')!r}.", f"tools.{i}")
            tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                           if k in t}})
        body["tools"] = tools
    if isinstance(req.tool_choice, dict):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.get("name")}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = (req.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "output"), "schema": fmt.get("schema"), "strict": fmt.get("strict", True)}}
    elif isinstance(fmt, dict):
        body["response_format"] = {"type": fmt.get("type")}
    for ours, theirs in (("max_completion_tokens", "max_output_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p")):
        if getattr(req, theirs) is not None:
            body[ours] = getattr(req, theirs)
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    chat.check_unsupported()
    return chat


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or
            status == "completed" else []}


def _call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def _response(req: ResponsesRequest, rid: str, created: int, ctx: ServingContext, status: str, output: list[dict],
              usage: dict | None, incomplete: str | None = None) -> dict:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": ctx.model_name,
            "output": output, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "text": req.text or {
                "format": {"type": "text"}}, "truncation": "disabled", "metadata": {}, "usage": usage}


def _usage(prompt: int, completion: int) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


async def create_response(ctx: ServingContext, request: Request) -> Response:
    req: ResponsesRequest = parse(ResponsesRequest, await request.body())
    plan = await prepare(ctx, to_chat(req))
    gen = Generation(ctx, ROUTE, plan.subs, request.receive)
    rid, created = _id("resp"), now()
    if req.stream:
        return StreamingResponse(_stream(ctx, gen, req, plan, rid, created), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    r = (await gen.collect())[0]
    msg, reason = message(plan, r.text, r.finish_reason)
    output = []
    if msg["content"] or not msg.get("tool_calls"):
        output.append(_message_item(_id("msg"), msg["content"] or ""))
    output += [_call_item(c) for c in msg.get("tool_calls", [])]
    incomplete = "max_output_tokens" if reason == "length" else None
    return JSONResponse(_response(req, rid, created, ctx, "incomplete" if incomplete else "completed", output,
                                  _usage(len(plan.ids), len(r.token_ids)), incomplete))


async def _stream(ctx: ServingContext, gen: Generation, req: ResponsesRequest, plan: ChatPlan, rid: str,
                  created: int) -> AsyncIterator[bytes]:
    seq = 0

    def event(kind: str, **body) -> bytes:
        nonlocal seq
        seq += 1
        data = json.dumps({"type": kind, "sequence_number": seq - 1, **body}, ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n".encode()

    start = _response(req, rid, created, ctx, "in_progress", [], None)
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    s, output, tokens, reason = ChoiceStream(), [], 0, None
    msg_id, text = _id("msg"), ""

    def open_message() -> list[bytes]:
        output.append(_message_item(msg_id, "", "in_progress"))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [event("response.output_item.added", output_index=0, item=output[0]),
                event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0, part=part)]

    def text_delta(delta: str) -> list[bytes]:
        nonlocal text
        out = open_message() if not output else []
        text += delta
        return out + [event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                            delta=delta, logprobs=[])]
    try:
        async with aclosing(gen.deltas()) as deltas:
            async for d in deltas:
                tokens += len(d.token_ids)
                s.text += d.text
                for delta in text_deltas(plan, s, d.finished and d.finish_reason != "abort"):
                    for b in text_delta(delta.get("content", "")) if delta.get("content") else ():
                        yield b
                if d.finished:
                    reason = d.finish_reason
    except RuntimeError as e:
        yield event("error", message=server_error(e).message, code="engine_error", param=None)
        return
    rest, calls = final_split(plan, s, reason) if reason != "abort" else ("", [])
    if rest:
        for b in text_delta(rest):
            yield b
    if output or not calls:
        if not output:
            for b in open_message():
                yield b
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        yield event("response.output_text.done", item_id=msg_id, output_index=0, content_index=0, text=text,
                    logprobs=[])
        yield event("response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=part)
        output[0] = _message_item(msg_id, text)
        yield event("response.output_item.done", output_index=0, item=output[0])
    for call in calls:
        item, index = _call_item(call), len(output)
        output.append(item)
        yield event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                             "status": "in_progress"})
        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                    delta=item["arguments"])
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                    arguments=item["arguments"], name=item["name"])
        yield event("response.output_item.done", output_index=index, item=item)
    incomplete = "max_output_tokens" if reason == "length" and not calls else None
    final = _response(req, rid, created, ctx, "incomplete" if incomplete else "completed", output,
                      _usage(len(plan.ids), tokens), incomplete)
    yield event("response.incomplete" if incomplete else "response.completed", response=final)
