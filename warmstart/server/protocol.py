"""The OpenAI request schemas and error shape. Requests are validated strictly (no "1" for 1, no true for 1), so a
wrong type is a 400 that names the field, never a silent coercion."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from warmstart.sampling_params import SamplingParams

MAX_N = 64                     # choices per request; each is one engine sequence
MAX_STOP = 16                  # stop strings per request
MAX_DEPTH = 64                 # JSON nesting: no field of any request goes near it; deeper is an attack or a bug
TokenId = Annotated[int, Field(ge=0, lt=2**63)]      # token ids become int64 tensors


class APIError(Exception):
    """An error that becomes an OpenAI-shaped JSON response: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def not_ready() -> APIError:
    return APIError(503, "The engine is still starting; retry when GET /ready answers 200.", "service_unavailable",
                    code="not_ready")


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        # Many clients send every field, null meaning "default"; treat it so instead of as a type error.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


# Fields clients send that change nothing here, by their definition: accepted silently. Any other field the schema
# does not name is a 400 that names it, so a request never silently loses a behaviour it asked for.
KNOWN_NO_OPS = frozenset({"user", "metadata", "store", "service_tier"})


class TopLevelRequest(_Request):
    model_config = ConfigDict(strict=True, extra="allow")

    def check_unknown(self) -> None:
        unknown = sorted(set(self.model_extra or ()) - KNOWN_NO_OPS)
        if unknown:
            raise bad_request(f"Unsupported field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}. This "
                              "server does not implement them; leave them out.", unknown[0], "unsupported_parameter")


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(TopLevelRequest):
    """Fields both generation routes share, plus the vLLM-style extras the engine supports (top_k, min_p, ...)."""
    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1 - MAX_N)   # choice i samples with seed + i (int64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    # extras (not in OpenAI's API; the openai client sends them through extra_body)
    top_k: int | None = Field(None, ge=0, le=SamplingParams.MAX_TOP_K)
    min_p: float | None = Field(None, ge=0, le=1)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    # structured outputs, as vLLM spells them (response_format is on chat)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > MAX_STOP:
            raise bad_request(f"At most {MAX_STOP} stop strings are supported, got {len(stops)}.", "stop")
        if any(not s for s in stops):
            raise bad_request("Stop strings must not be empty.", "stop")
        return stops

    def token_bias(self) -> dict[int, float]:
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                out[int(key)] = bias
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}.", "logit_bias") from None
            if not -100 <= bias <= 100:
                raise bad_request(f"logit_bias values must be between -100 and 100, got {bias}.", "logit_bias")
        return out

    def check_unsupported(self) -> None:
        self.check_unknown()
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true.", "stream_options")


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None          # an assistant turn that called tools
    tool_call_id: str | None = None                   # a tool turn: which call this is the result of

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=SamplingParams.MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=SamplingParams.MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in \
                self.model_fields_set:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true.",
                              "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs an assistant message last.", "continue_final_message")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Prompt = str | list[TokenId] | list[str | list[TokenId]]        # a batch may mix text and token-id prompts


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    # 0 is allowed with echo: scoring a prompt, generating nothing
    max_tokens: int | None = Field(None, ge=0, le=SamplingParams.MAX_TOKENS)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise bad_request("suffix is not supported by this server.", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported by this server.", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1 (0 is allowed only with echo, to score a prompt).",
                              "max_tokens")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be an empty list.", "prompt")
        if isinstance(p[0], int):
            return [list(p)]
        for item in p:
            if isinstance(item, list) and not item:
                raise bad_request("prompt must not contain an empty token list.", "prompt")
        return list(p)


def parse(model: type[_Request], raw: bytes) -> Any:
    """JSON bytes -> a validated request, or an APIError(400) naming the first bad field. Bad input of any shape
    is a 400 here, never a 500 later: non-standard constants (NaN, Infinity), nesting deeper than MAX_DEPTH, and
    strings that are not Unicode text (lone UTF-16 surrogates, which no tokenizer can encode) are refused up front.
    Runs off the event loop (the routes call it in a worker thread): a body may be megabytes."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise bad_request(f"The request body is nested too deeply (more than {MAX_DEPTH} levels).",
                          code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    check_json(data)
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    request.check_unsupported()
    return request


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def check_json(data: Any) -> None:
    """Walk the decoded body without recursion: depth at most MAX_DEPTH, every string (keys too) encodable as
    UTF-8. The error names the field path, e.g. messages.0.content."""
    stack: list[tuple[Any, tuple, int]] = [(data, (), 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"{_path(path)}: nested more than {MAX_DEPTH} levels deep.", _path(path) or None,
                              "invalid_parameter")
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, path + (k,))
                stack.append((v, path + (k,), depth + 1))
        elif isinstance(value, list):
            stack.extend((v, path + (i,), depth + 1) for i, v in enumerate(value))


def _check_text(s: str, path: tuple) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        where = _path(path) or "body"
        raise bad_request(f"{where}: the text holds a lone UTF-16 surrogate ({s[e.start]!r} at character "
                          f"{e.start}), which is not Unicode text; send valid UTF-8/UTF-16 pairs.",
                          _path(path) or None, "invalid_parameter") from None


def _path(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def validation_error(e: ValidationError) -> APIError:
    # For a union field pydantic reports one error per member; the deepest one is the most specific.
    err = max(e.errors(include_url=False), key=lambda x: len(x["loc"]))
    # Union members appear as path parts ("str", "list[int]"); keep only the user's field path.
    loc = [str(x) for x in err["loc"] if not (isinstance(x, str) and (x in _TYPE_NAMES or "[" in x))]
    param = ".".join(loc) or None
    extra = f" (got {json.dumps(err['input'])[:80]})" if err["type"] != "missing" and _jsonable(err["input"]) else ""
    return bad_request(f"{param or 'body'}: {err['msg']}{extra}.", param, "invalid_parameter")


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "TextPart", "StreamOptions", "dict[str,any]",
               "list[TextPart]", "ToolCall", "FunctionCall"}


def _jsonable(x: Any) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False
