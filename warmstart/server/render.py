"""Engine results in OpenAI's JSON shapes: token strings and bytes, chat logprobs, legacy completion logprobs."""
from __future__ import annotations

import math
import re
from functools import lru_cache

from warmstart.runner.batch import TokenLogprobs
from warmstart.tokenizer import Tokenizer

_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted: how byte-level BPE vocabularies spell raw bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """A token's own bytes and the string OpenAI shows for it (partial UTF-8 shows as U+FFFD), cached per id."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        m = _HEX_BYTE.match(piece)                       # SentencePiece byte fallback: <0xE2>
        if m:
            return bytes([int(m.group(1), 16)])
        table = _byte_level_decoder()
        if all(ch in table for ch in piece):             # byte-level BPE: "Ġthe" -> b" the"
            return bytes(table[ch] for ch in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


def _lp(x: float) -> float:
    """JSON has no -inf: a token the model rules out entirely gets a very low finite logprob."""
    return x if math.isfinite(x) else -9999.0


def chat_logprobs(tokens: TokenText, token_ids: list[int] | tuple[int, ...],
                  logprobs: list[TokenLogprobs] | tuple[TokenLogprobs, ...]) -> dict:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}"""
    content = []
    for tid, lp in zip(token_ids, logprobs):
        text, raw = tokens.get(tid)
        top = []
        for alt, alt_lp in lp.top:
            alt_text, alt_raw = tokens.get(alt)
            top.append({"token": alt_text, "logprob": _lp(alt_lp), "bytes": list(alt_raw)})
        content.append({"token": text, "logprob": _lp(lp.logprob), "bytes": list(raw), "top_logprobs": top})
    return {"content": content, "refusal": None}


class LegacyLogprobs:
    """The completions API's logprobs: parallel lists of tokens, their logprobs, top-N dicts and text offsets.
    Offsets count characters from the start of the returned text; a choice's offsets continue across chunks."""

    def __init__(self, tokens: TokenText, start_offset: int = 0):
        self.tokens, self.offset = tokens, start_offset
        self.in_completion = False           # offsets of the completion start at the prompt text's length

    def render(self, token_ids: list[int] | tuple[int, ...],
               logprobs: list[TokenLogprobs | None] | tuple[TokenLogprobs | None, ...]) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp in zip(token_ids, logprobs):
            text = self.tokens.text(tid)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if lp is None:                               # the first prompt token has no logprob
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_lp(lp.logprob))
            top: dict[str, float] = {}
            for alt, alt_lp in lp.top:
                top.setdefault(self.tokens.text(alt), _lp(alt_lp))
            out["top_logprobs"].append(top)
        return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens are prompt tokens whose K/V came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def prompt_logprobs(tokens: TokenText, ids: list[int], logprobs) -> list[dict | None]:
    """vLLM's prompt_logprobs shape: None for the first prompt token, then {token_id: {logprob, rank,
    decoded_token}} with the actual token and the top alternatives (rank 1 is the most likely)."""
    out: list[dict | None] = [None]
    for tid, lp in zip(ids[1:], logprobs or ()):
        entry = {str(tid): {"logprob": _lp(lp.logprob), "rank": None, "decoded_token": tokens.text(tid)}}
        for rank, (alt, alt_lp) in enumerate(lp.top, 1):
            entry.setdefault(str(alt), {"logprob": _lp(alt_lp), "rank": rank, "decoded_token": tokens.text(alt)})
            if alt == tid:
                entry[str(tid)]["rank"] = rank
        out.append(entry)
    return out
