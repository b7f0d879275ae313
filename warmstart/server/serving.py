"""What the generation routes share: the served model, request -> SamplingParams with the context-length checks,
collecting a request's Deltas into choices, and SSE framing."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from warmstart.boot import Booted
from warmstart.errors import UserError
from warmstart.runner.batch import TokenLogprobs
from warmstart.runner.grammar import Grammar, GrammarCompiler
from warmstart.sampling_params import SamplingParams
from warmstart.server.async_engine import AsyncEngine, ClientGone, Delta, RequestStream, SubRequest
from warmstart.server.metrics import Metrics, RequestTimer
from warmstart.server.protocol import APIError, SamplingRequest, bad_request
from warmstart.server.render import TokenText
from warmstart.tokenizer import Tokenizer


@dataclass
class ServingContext:
    """Everything a generation route needs once the engine is ready."""
    booted: Booted
    engine: AsyncEngine
    model_name: str
    metrics: Metrics
    tool_parser: str = "hermes"
    reasoning_parser: str | None = None
    tokens: TokenText = field(init=False)
    grammars: GrammarCompiler = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = TokenText(self.booted.tokenizer)
        engine = self.booted.engine
        self.grammars = GrammarCompiler(self.booted.tokenizer.to_json(), engine.vocab_size,
                                        tuple(sorted(engine.eos_token_ids)))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.booted.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.booted.max_model_len

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model {name!r} does not exist; this server serves {self.model_name!r} "
                                "(see GET /v1/models).", "invalid_request_error", "model", "model_not_found")

    def check_prompt(self, ids: list[int], param: str) -> None:
        n, limit = len(ids), self.max_model_len
        if n >= limit:
            raise bad_request(f"The prompt is {n} tokens but this model's maximum context length is {limit} "
                              "tokens, which must also leave room for at least one generated token. Shorten the "
                              "prompt.", param, "context_length_exceeded")
        try:
            self.booted.engine.check_prompt(ids)        # reads only immutable limits; safe off the engine thread
        except UserError as e:
            raise bad_request(str(e), param) from None

    def params(self, req: SamplingRequest, prompt_len: int, max_tokens: int | None, *, choice: int,
               logprobs: int | None = None, prompt_logprobs: int | None = None,
               grammar: Grammar | None = None) -> SamplingParams:
        """SamplingParams for one choice. max_tokens None means the rest of the context."""
        limit = self.max_model_len
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens, but {prompt_len + max_tokens}"
                              f" were requested: {prompt_len} in the prompt and max_tokens {max_tokens} for the "
                              f"completion. Lower max_tokens to at most {limit - prompt_len} or shorten the prompt.",
                              "max_tokens", "context_length_exceeded")
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, min_p=req.min_p or 0.0,
                seed=None if req.seed is None else req.seed + choice, stop=req.stop_strings(),
                stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                logit_bias=tuple(req.token_bias().items()), min_tokens=min(req.min_tokens, max_tokens),
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens, grammar=grammar)
        except UserError as e:
            raise bad_request(str(e), e.param) from None


def truncate(ids: list[int], req: SamplingRequest) -> list[int]:
    """truncate_prompt_tokens: keep the last k prompt tokens (vLLM's rule: the end of a prompt matters most)."""
    k = req.truncate_prompt_tokens
    return ids[-k:] if k is not None and len(ids) > k else ids


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse(obj: dict | str) -> bytes:
    body = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {body}\n\n".encode()


def chunk_writer(obj_type: str, rid: str, created: int, model: str, include_usage: bool):
    """The SSE framing every streamed chunk of one response shares. With include_usage, OpenAI sends
    "usage": null on every chunk but the last, which carries the counts."""
    def chunk(choices: list[dict], **extra) -> bytes:
        body = {"id": rid, "object": obj_type, "created": created, "model": model, "choices": choices, **extra}
        if include_usage and "usage" not in body:
            body["usage"] = None
        return sse(body)
    return chunk


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ChoiceResult:
    """One choice, accumulated from its Deltas."""
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, d: Delta) -> None:
        self.token_ids.extend(d.token_ids)
        self.text += d.text
        self.logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.num_prompt_tokens:
            self.num_prompt_tokens = d.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)
        if d.finished:
            self.finish_reason = d.finish_reason
            if d.full_text is not None and d.finish_reason != "abort":
                self.text = d.full_text


def server_error(e: Exception) -> APIError:
    return APIError(500, str(e), "server_error", code="engine_error")


class Generation:
    """One HTTP generation request: its sub-requests, submitted on first use, aborted on any early exit."""

    def __init__(self, ctx: ServingContext, route: str, subs: list[SubRequest], receive: Callable):
        self.ctx, self.route, self.subs, self.receive = ctx, route, subs, receive
        self.timer = RequestTimer(ctx.metrics, route)
        self.outcome = "aborted"
        ctx.metrics.add_prompt_tokens(sum(len(s.prompt_token_ids) for s in subs))

    def _open(self) -> RequestStream:
        stream = self.ctx.engine.submit(self.subs, prefix=self.route.rsplit("/", 1)[-1])
        stream.watch_disconnect(self.receive)
        return stream

    async def deltas(self) -> AsyncIterator[Delta]:
        """Every Delta of every choice. The caller must exhaust or close this generator (aclosing)."""
        try:
            async with self._open() as stream:
                async for d in stream:
                    if d.token_ids:
                        self.timer.token(len(d.token_ids), d.index)
                    if d.finished:
                        self.timer.finished(d.finish_reason)
                    yield d
            self.outcome = "finished"
        except ClientGone:
            pass                        # outcome stays "aborted", as when the task is cancelled (client gone)
        except RuntimeError:
            self.outcome = "error"
            raise
        finally:
            self.timer.done(self.outcome)

    async def collect(self) -> dict[int, ChoiceResult]:
        """All choices, finished. Raises APIError(500) when the engine failed."""
        results = {s.index: ChoiceResult(s.index) for s in self.subs}
        gen = self.deltas()
        try:
            async for d in gen:
                results[d.index].add(d)
        except RuntimeError as e:
            raise server_error(e) from None
        finally:
            await gen.aclose()
        return results
