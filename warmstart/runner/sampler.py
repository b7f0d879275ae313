"""Turn logits into tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds, and logprobs.

Logprobs are of the model's distribution (log_softmax of raw logits), as the OpenAI API reports them, not of the
temperature-scaled and filtered distribution that the token was drawn from."""
from __future__ import annotations

from typing import Callable

import torch

from warmstart import kernels
from warmstart.runner.batch import TokenLogprobs
from warmstart.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] float32 -> one token id per row."""
    out = kernels.argmax(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    sub = logits[rows] / torch.tensor([params[i].temperature for i in rows], device=logits.device)[:, None]
    sub = _filter(sub, [params[i] for i in rows])
    probs = sub.softmax(dim=-1)
    for j, i in enumerate(rows):
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, using only this request's generator.
        e = torch.empty_like(probs[j]).exponential_(generator=generators[i])
        out[i] = int((probs[j] / e).argmax())
    return out


def sample_isolated(logits: torch.Tensor, params: list[SamplingParams],
                    generators: list[Callable[[], torch.Generator | None]]) -> list[int | Exception]:
    """sample(), but a row whose preparation (its generator) or sampling raises fails alone: the batch is sampled
    at once, and only if that raises is each row sampled by itself, so one request's bad value yields an Exception
    in its slot instead of failing every request of the step. Generators are made before any row draws, so the
    retry never draws twice from a good row's generator when the failure was in preparation or filtering."""
    try:
        return sample(logits, params, [g() for g in generators])
    except Exception:
        pass
    out: list[int | Exception] = []
    for i, p in enumerate(params):
        try:
            out.append(sample(logits[i:i + 1], [p], [generators[i]()])[0])
        except Exception as e:
            out.append(e)
    return out


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if not any(top_k) and all(p == 1.0 for p in top_p) and not any(min_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    k = torch.tensor([k if k > 0 else logits.shape[-1] for k in top_k], device=logits.device)[:, None]
    drop |= ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    p = torch.tensor(top_p, device=logits.device)[:, None]
    drop |= (probs.cumsum(dim=-1) - probs) >= p                  # keep the smallest prefix reaching top_p
    mp = torch.tensor(min_p, device=logits.device)[:, None]
    drop |= probs < mp * probs[:, :1]                             # min_p relative to the most likely token
    drop[:, 0] = False                                            # always keep the best token
    filtered = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, filtered)


def token_logprobs(logprobs_row: torch.Tensor, token_id: int, top_n: int) -> TokenLogprobs:
    """The logprob of token_id and the top_n alternatives, from one row of log_softmax output."""
    top: list[tuple[int, float]] = []
    if top_n > 0:
        vals, ids = logprobs_row.topk(top_n)
        top = list(zip(ids.tolist(), vals.tolist()))
    return TokenLogprobs(float(logprobs_row[token_id]), top)
