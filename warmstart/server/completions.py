"""POST /v1/completions: prompts (text or token ids) -> n engine sequences each -> a response or an SSE stream.

echo returns the prompt before the completion; with logprobs it also returns the prompt tokens' logprobs (the first
token's is null), which is what evaluation harnesses score with. max_tokens 0 is allowed with echo: nothing is
generated. With logprobs the engine still runs one step (the prompt logprobs come from the prefill, which needs a
sampled token to finish) and that one token is dropped; without logprobs the engine is not called at all."""
from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from warmstart.server.async_engine import Delta, SubRequest
from warmstart.server.protocol import CompletionRequest, parse
from warmstart.server.render import LegacyLogprobs, TokenText, usage
from warmstart.server.serving import (SSE_HEADERS, ChoiceResult, Generation, ServingContext, chunk_writer, new_id,
                                      now, server_error, sse, truncate)
from warmstart.server.structured import compile_grammar, requested_grammar

ROUTE = "/v1/completions"


@dataclass(frozen=True)
class _Prompt:
    ids: list[int]
    text: str


@dataclass(frozen=True)
class _Plan:
    req: CompletionRequest
    prompts: list[_Prompt]
    subs: list[SubRequest]
    score_only: bool                 # max_tokens 0: the generated token (if any) is dropped

    def prompt_of(self, index: int) -> _Prompt:
        return self.prompts[index // self.req.n]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.ids) for p in self.prompts)

    def is_first_choice(self, index: int) -> bool:
        """Usage counts each prompt once: its cached tokens are those of its first choice."""
        return index % self.req.n == 0


async def create_completion(ctx: ServingContext, request: Request) -> Response:
    # Parsing and tokenizing a body of megabytes takes seconds: never on the event loop.
    req: CompletionRequest = await run_in_threadpool(parse, CompletionRequest, await request.body())
    ctx.check_model(req.model)
    spec = requested_grammar(req)
    grammar = await compile_grammar(ctx.grammars, spec, "structured_outputs") if spec is not None else None
    prompts = await run_in_threadpool(_tokenize, ctx, req)
    score_only = req.max_tokens == 0
    prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
    subs = []
    for k, p in enumerate(prompts):
        for i in range(req.n):
            params = ctx.params(req, len(p.ids), 1 if score_only else req.max_tokens, choice=i,
                                logprobs=req.logprobs, prompt_logprobs=prompt_lp, grammar=grammar)
            subs.append(SubRequest(k * req.n + i, p.ids, params))
    plan = _Plan(req, prompts, subs if not score_only or prompt_lp is not None else [], score_only)
    gen = Generation(ctx, ROUTE, plan.subs, request.receive)
    rid, created = new_id("cmpl"), now()
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(ctx, gen, plan, rid, created, include_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    results = await gen.collect() if plan.subs else {}
    choices, completion_tokens, cached_tokens = [], 0, 0
    for index in range(len(prompts) * req.n):
        r = results.get(index) or ChoiceResult(index, finish_reason="length")
        cached_tokens += r.num_cached_tokens if plan.is_first_choice(index) else 0
        if score_only:
            r = ChoiceResult(index, prompt_logprobs=r.prompt_logprobs, finish_reason="length")
        completion_tokens += len(r.token_ids)
        p = plan.prompt_of(index)
        lp = None
        if req.logprobs is not None:
            legacy = LegacyLogprobs(ctx.tokens)
            lp = _merge(_echo_logprobs(legacy, p, r.prompt_logprobs) if req.echo else None,
                        _completion_logprobs(legacy, len(p.text), r.token_ids, r.logprobs))
        choices.append({"index": index, "text": (p.text if req.echo else "") + r.text, "logprobs": lp,
                        "finish_reason": r.finish_reason})
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
                         "choices": choices, "usage": usage(plan.prompt_tokens, completion_tokens, cached_tokens)})


def _tokenize(ctx: ServingContext, req: CompletionRequest) -> list[_Prompt]:
    """Tokenize (and truncate) every prompt; runs in a worker thread, never on the event loop."""
    prompts = []
    for p in req.prompts():
        full = ctx.tokenizer.encode(p) if isinstance(p, str) else p
        ids = truncate(full, req)
        ctx.check_prompt(ids, "prompt")
        # token-id (or truncated) prompts echo, and offset logprobs, as their decoded text; only in-vocabulary ids
        # get here
        text = p if isinstance(p, str) and ids is full else ctx.tokenizer.decode(ids, skip_special_tokens=False)
        prompts.append(_Prompt(ids, text))
    return prompts


def _echo_logprobs(legacy: LegacyLogprobs, p: _Prompt, prompt_lp) -> dict:
    legacy.offset = 0
    return legacy.render(p.ids, [None, *(prompt_lp or [None] * (len(p.ids) - 1))])


def _completion_logprobs(legacy: LegacyLogprobs, offset: int, token_ids, logprobs) -> dict:
    # Offsets index into prompt + completion text, as OpenAI's do, whether or not the prompt is echoed.
    if not legacy.in_completion:
        legacy.offset, legacy.in_completion = offset, True
    return legacy.render(token_ids, logprobs)


def _merge(a: dict | None, b: dict) -> dict:
    return b if a is None else {k: a[k] + b[k] for k in b}


async def _stream(ctx: ServingContext, gen: Generation, plan: _Plan, rid: str, created: int,
                  include_usage: bool) -> AsyncIterator[bytes]:
    req = plan.req

    chunk = chunk_writer("text_completion", rid, created, ctx.model_name, include_usage)

    legacy: dict[int, LegacyLogprobs] = {}
    completion_tokens = 0
    cached: dict[int, int] = {}
    try:
        if not plan.subs:            # echo with max_tokens 0 and no logprobs: nothing to run
            for index in range(len(plan.prompts) * req.n):
                yield chunk([{"index": index, "text": plan.prompt_of(index).text, "logprobs": None,
                              "finish_reason": "length"}])
        else:
            async with aclosing(gen.deltas()) as deltas:
                async for d in deltas:
                    body = _stream_choice(ctx.tokens, plan, d, legacy)
                    completion_tokens += 0 if plan.score_only else len(d.token_ids)
                    if plan.is_first_choice(d.index):
                        cached[d.index] = max(cached.get(d.index, 0), d.num_cached_tokens)
                    if body is not None:
                        yield chunk([body])
    except RuntimeError as e:
        yield sse(server_error(e).body())
    if include_usage:
        yield chunk([], usage=usage(plan.prompt_tokens, completion_tokens, sum(cached.values())))
    yield sse("[DONE]")


def _stream_choice(tokens: TokenText, plan: _Plan, d: Delta, legacy: dict[int, LegacyLogprobs]) -> dict | None:
    req, p = plan.req, plan.prompt_of(d.index)
    first = d.index not in legacy
    lg = legacy.setdefault(d.index, LegacyLogprobs(tokens))
    text, lp = "", None
    if first and req.echo:
        text = p.text
        if req.logprobs is not None:
            lp = _echo_logprobs(lg, p, d.prompt_logprobs)
    if not plan.score_only and d.finish_reason != "abort":
        text += d.text
        if req.logprobs is not None:
            lp = _merge(lp, _completion_logprobs(lg, len(p.text), d.token_ids, d.logprobs))
    elif req.logprobs is not None and lp is None and d.finished:
        lp = _completion_logprobs(lg, len(p.text), (), ())
    if not text and lp is None and not d.finished:
        return None
    reason = ("length" if plan.score_only else d.finish_reason) if d.finished else None
    return {"index": d.index, "text": text, "logprobs": lp, "finish_reason": reason}
