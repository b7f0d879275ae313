"""vLLM's tokenizer routes: POST /tokenize, POST /detokenize, GET /tokenizer_info, and GET /version.

lm-evaluation-harness's default remote tokenizer probes these and otherwise tries to fetch the tokenizer from a hub;
tooling uses /tokenize to count tokens exactly as the server will."""
from __future__ import annotations

from typing import Any

import jinja2
from pydantic import Field

from warmstart import __version__
from warmstart.errors import UserError
from warmstart.server.protocol import ChatMessage, TopLevelRequest, bad_request, parse
from warmstart.server.serving import ServingContext
from warmstart.server.tools import template_message


class TokenizeRequest(TopLevelRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None           # default: true for a prompt, false for messages (templates)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    def check_unsupported(self) -> None:
        self.check_unknown()
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("Send exactly one of prompt and messages.", "prompt")


class DetokenizeRequest(TopLevelRequest):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)

    def check_unsupported(self) -> None:
        self.check_unknown()


def tokenize(ctx: ServingContext, raw: bytes) -> dict:
    req: TokenizeRequest = parse(TokenizeRequest, raw)
    if req.model is not None:
        ctx.check_model(req.model)
    tok = ctx.tokenizer
    if req.prompt is not None:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        try:
            text = tok.apply_chat_template([template_message(m) for m in req.messages],
                                           add_generation_prompt=req.add_generation_prompt, tools=req.tools,
                                           continue_final_message=req.continue_final_message,
                                           **(req.chat_template_kwargs or {}))
        except UserError as e:
            raise bad_request(str(e), "messages") from None
        except jinja2.TemplateError as e:
            raise bad_request(f"The chat template rejected these messages: {e}", "messages") from None
        ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
    out: dict = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": None}
    if req.return_token_strs:
        out["token_strs"] = [tok.id_to_token(i) for i in ids]
    return out


def detokenize(ctx: ServingContext, raw: bytes) -> dict:
    req: DetokenizeRequest = parse(DetokenizeRequest, raw)
    if req.model is not None:
        ctx.check_model(req.model)
    bad = [t for t in req.tokens if not 0 <= t < ctx.tokenizer.vocab_size]
    if bad:
        raise bad_request(f"Token id {bad[0]} is outside the vocabulary (0..{ctx.tokenizer.vocab_size - 1}).",
                          "tokens")
    return {"prompt": ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def tokenizer_info(ctx: ServingContext) -> dict:
    tok = ctx.tokenizer
    eos = sorted(ctx.booted.engine.eos_token_ids)
    return {"tokenizer_class": "PreTrainedTokenizerFast", "vocab_size": tok.vocab_size,
            "model_max_length": ctx.max_model_len, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "eos_token_id": eos[0] if eos else None, "eos_token_ids": eos, "pad_token": None,
            "chat_template": tok.chat_template}


def version() -> dict:
    return {"version": __version__}
