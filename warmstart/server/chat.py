"""POST /v1/chat/completions: messages -> chat template -> n engine sequences -> a response or an SSE stream.

Each choice's text goes through two splits, both functions of the text so far so that a stream and the final
message agree: the reasoning parser (reasoning_content vs content) and the tool plan (content vs tool_calls)."""
from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from warmstart.errors import UserError
from warmstart.server.async_engine import SubRequest
from warmstart.server.protocol import ChatCompletionRequest, bad_request, parse
from warmstart.server.reasoning import split_qwen3
from warmstart.server.render import chat_logprobs, prompt_logprobs, usage
from warmstart.server.serving import (SSE_HEADERS, Generation, ServingContext, chunk_writer, new_id, now,
                                      server_error, sse, truncate)
from warmstart.server.structured import compile_grammar, requested_grammar
from warmstart.server.tools import ToolPlan, plan_tools, template_message

ROUTE = "/v1/chat/completions"


@dataclass(frozen=True)
class ChatPlan:
    """A validated chat request: its prompt, and how its output is split."""
    req: ChatCompletionRequest
    ids: list[int]
    subs: list[SubRequest]
    tools: ToolPlan
    reasoning: bool

    def split(self, text: str, finished: bool) -> tuple[str | None, str]:
        return split_qwen3(text, finished) if self.reasoning else (None, text)


async def prepare(ctx: ServingContext, req: ChatCompletionRequest) -> ChatPlan:
    """Template, tokenize, compile the grammar: everything before the engine sees the request."""
    ctx.check_model(req.model)
    tools = plan_tools(req, ctx.tool_parser)
    messages = [template_message(m) for m in req.messages]
    # Templating and tokenizing a body of megabytes takes seconds: never on the event loop.
    ids = await run_in_threadpool(_encode, ctx, req, messages, tools)
    spec, param = tools.grammar(), "tool_choice"
    asked = requested_grammar(req, req.response_format)
    if spec is not None and asked is not None:
        raise bad_request("A forced tool_choice and a structured output cannot be combined.", "response_format")
    if spec is None:
        spec, param = asked, "response_format"
    grammar = await compile_grammar(ctx.grammars, spec, param) if spec is not None else None
    top = (req.top_logprobs or 0) if req.logprobs else None
    subs = [SubRequest(i, ids, ctx.params(req, len(ids), req.token_limit, choice=i, logprobs=top,
                                          prompt_logprobs=req.prompt_logprobs, grammar=grammar))
            for i in range(req.n)]
    # A grammar forbids free thinking text, so a constrained output is content only.
    return ChatPlan(req, ids, subs, tools, ctx.reasoning_parser == "qwen3" and grammar is None)


def message(plan: ChatPlan, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The assistant message of a finished choice and its finish_reason."""
    reasoning, content = plan.split(text, True)
    calls = []
    if finish_reason != "length" or plan.tools.mode == "auto":
        content, calls = plan.tools.parse(content)
    msg: dict = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [c.to_openai() for c in calls]
        finish_reason = "tool_calls"
    return msg, finish_reason


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    # Parsing a body of megabytes takes seconds too: never on the event loop.
    req: ChatCompletionRequest = await run_in_threadpool(parse, ChatCompletionRequest, await request.body())
    plan = await prepare(ctx, req)
    gen = Generation(ctx, ROUTE, plan.subs, request.receive)
    rid, created = new_id("chatcmpl"), now()
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(ctx, gen, plan, rid, created, include_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    results = await gen.collect()
    choices = []
    for i in sorted(results):
        r = results[i]
        msg, reason = message(plan, r.text, r.finish_reason)
        choices.append({"index": i, "message": msg,
                        "logprobs": chat_logprobs(ctx.tokens, r.token_ids, r.logprobs) if req.logprobs else None,
                        "finish_reason": reason})
    completion_tokens = sum(len(r.token_ids) for r in results.values())
    body = {"id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name,
            "choices": choices, "usage": usage(len(plan.ids), completion_tokens, results[0].num_cached_tokens)}
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs(ctx.tokens, plan.ids, results[0].prompt_logprobs)
    return JSONResponse(body)


def _encode(ctx: ServingContext, req: ChatCompletionRequest, messages: list[dict], tools: ToolPlan) -> list[int]:
    kwargs = dict(req.chat_template_kwargs or {})
    for reserved in ("messages", "tools", "add_generation_prompt", "continue_final_message"):
        if reserved in kwargs:
            raise bad_request(f"chat_template_kwargs must not set {reserved}; it has its own field.",
                              "chat_template_kwargs")
    try:
        ids = ctx.tokenizer.encode_chat(messages, add_generation_prompt=req.add_generation_prompt,
                                        tools=tools.template_tools,
                                        continue_final_message=req.continue_final_message, **kwargs)
    except UserError as e:
        raise bad_request(str(e), "messages") from None
    except jinja2.TemplateError as e:
        raise bad_request(f"The chat template rejected these messages: {e}", "messages") from None
    ids = truncate(ids, req)
    ctx.check_prompt(ids, "messages")
    return ids


@dataclass
class ChoiceStream:
    text: str = ""
    reasoning_sent: int = 0
    content_sent: int = 0


async def _stream(ctx: ServingContext, gen: Generation, plan: ChatPlan, rid: str, created: int,
                  include_usage: bool) -> AsyncIterator[bytes]:
    req = plan.req
    chunk = chunk_writer("chat.completion.chunk", rid, created, ctx.model_name, include_usage)
    state = {i: ChoiceStream() for i in range(req.n)}
    for i in range(req.n):
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    completion_tokens = cached_tokens = 0
    try:
        async with aclosing(gen.deltas()) as deltas:
            async for d in deltas:
                completion_tokens += len(d.token_ids)
                if d.index == 0:            # the n choices share one prompt, counted once (choice 0's)
                    cached_tokens = max(cached_tokens, d.num_cached_tokens)
                s = state[d.index]
                s.text += d.text
                lp = chat_logprobs(ctx.tokens, d.token_ids, d.logprobs) if req.logprobs and d.token_ids else None
                for delta in text_deltas(plan, s, d.finished and d.finish_reason != "abort"):
                    yield chunk([{"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": None}])
                    lp = None
                if lp is not None:
                    yield chunk([{"index": d.index, "delta": {}, "logprobs": lp, "finish_reason": None}])
                if d.finished:
                    reason = d.finish_reason
                    if d.finish_reason != "abort":
                        rest, calls = final_split(plan, s, reason)
                        if rest:
                            yield chunk([{"index": d.index, "delta": {"content": rest}, "logprobs": None,
                                          "finish_reason": None}])
                        if calls:
                            yield chunk([{"index": d.index, "delta": {"tool_calls": calls}, "logprobs": None,
                                          "finish_reason": None}])
                            reason = "tool_calls"
                    yield chunk([{"index": d.index, "delta": {}, "logprobs": None, "finish_reason": reason}])
    except RuntimeError as e:
        yield sse(server_error(e).body())
    if include_usage:
        yield chunk([], usage=usage(len(plan.ids), completion_tokens, cached_tokens))
    yield sse("[DONE]")


def text_deltas(plan: ChatPlan, s: ChoiceStream, finished: bool) -> list[dict]:
    """New reasoning and content that can be shown; content that may still turn out to be a tool call waits."""
    reasoning, content = plan.split(s.text, finished)
    out = []
    if reasoning is not None and len(reasoning) > s.reasoning_sent:
        out.append({"reasoning_content": reasoning[s.reasoning_sent:]})
        s.reasoning_sent = len(reasoning)
    safe = plan.tools.safe_content(content)
    if safe > s.content_sent:
        out.append({"content": content[s.content_sent:safe]})
        s.content_sent = safe
    return out


def final_split(plan: ChatPlan, s: ChoiceStream, finish_reason: str | None) -> tuple[str, list[dict]]:
    """At the end of a choice: the content still held back, and the tool calls."""
    _, content = plan.split(s.text, True)
    calls = []
    if finish_reason != "length" or plan.tools.mode == "auto":
        parsed, calls = plan.tools.parse(content)
        content = parsed or ""
    return content[s.content_sent:], [c.to_openai(k) for k, c in enumerate(calls)]
