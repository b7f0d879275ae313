"""POST /v1/chat/completions: messages -> chat template -> n engine sequences -> a response or an SSE stream."""
from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from warmstart.errors import UserError
from warmstart.server.async_engine import SubRequest
from warmstart.server.protocol import ChatCompletionRequest, bad_request, parse
from warmstart.server.render import chat_logprobs, usage
from warmstart.server.serving import (SSE_HEADERS, Generation, ServingContext, chunk_writer, new_id, now,
                                      server_error, sse)

ROUTE = "/v1/chat/completions"


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    # Parsing, templating and tokenizing a body of megabytes takes seconds: never on the event loop.
    req: ChatCompletionRequest = await run_in_threadpool(parse, ChatCompletionRequest, await request.body())
    ctx.check_model(req.model)
    ids = await run_in_threadpool(_encode, ctx, req)
    top = (req.top_logprobs or 0) if req.logprobs else None
    subs = [SubRequest(i, ids, ctx.params(req, len(ids), req.token_limit, choice=i, logprobs=top))
            for i in range(req.n)]
    gen = Generation(ctx, ROUTE, subs, request.receive)
    rid, created = new_id("chatcmpl"), now()
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(ctx, gen, req, rid, created, len(ids), include_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    results = await gen.collect()
    choices = []
    for i in sorted(results):
        r = results[i]
        choices.append({
            "index": i, "message": {"role": "assistant", "content": r.text},
            "logprobs": chat_logprobs(ctx.tokens, r.token_ids, r.logprobs) if req.logprobs else None,
            "finish_reason": r.finish_reason})
    completion_tokens = sum(len(r.token_ids) for r in results.values())
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name,
                         "choices": choices, "usage": usage(len(ids), completion_tokens,
                                                            results[0].num_cached_tokens)})


def _encode(ctx: ServingContext, req: ChatCompletionRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        ids = ctx.tokenizer.encode_chat(messages)
    except UserError as e:
        raise bad_request(str(e), "messages") from None
    except jinja2.TemplateError as e:
        raise bad_request(f"The chat template rejected these messages: {e}", "messages") from None
    ctx.check_prompt(ids, "messages")
    return ids


async def _stream(ctx: ServingContext, gen: Generation, req: ChatCompletionRequest, rid: str, created: int,
                  prompt_len: int, include_usage: bool) -> AsyncIterator[bytes]:
    chunk = chunk_writer("chat.completion.chunk", rid, created, ctx.model_name, include_usage)

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
                if d.text or (req.logprobs and d.token_ids):
                    lp = chat_logprobs(ctx.tokens, d.token_ids, d.logprobs) if req.logprobs else None
                    yield chunk([{"index": d.index, "delta": {"content": d.text}, "logprobs": lp,
                                  "finish_reason": None}])
                if d.finished:
                    yield chunk([{"index": d.index, "delta": {}, "logprobs": None,
                                  "finish_reason": d.finish_reason}])
    except RuntimeError as e:
        yield sse(server_error(e).body())
    if include_usage:
        yield chunk([], usage=usage(prompt_len, completion_tokens, cached_tokens))
    yield sse("[DONE]")
