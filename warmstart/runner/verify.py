"""The verification rule of speculative decoding: which proposed tokens the target accepts, and its own next token.

Inputs for one sequence: the target's logits at the K+1 fed rows ([last token, d_1..d_K]; row j predicts the
token after d_j), the K proposed tokens, and the proposer's distributions q_j they were drawn from (None for a
deterministic proposer such as n-gram lookup, a point mass on d_j).

- greedy: accept d_j while it equals the target's argmax; the first mismatch is replaced by the target's argmax,
  and if all K are accepted the target's argmax after d_K is added. The output is exactly the target's own.
- sampled: the standard rule (Leviathan et al., Chen et al.): accept d_j with probability min(1, p_j(d_j) /
  q_j(d_j)); at the first rejection draw from norm(max(0, p_j - q_j)); if all are accepted draw one more token
  from p_K. p and q are the temperature-scaled, top-k/top-p/min-p filtered distributions, so every emitted token
  is distributed as the target's sampler would have drawn it. All draws use the request's own generator.
Returns 1..K+1 tokens; the first len-1 of them are accepted proposals."""
from __future__ import annotations

import torch

from warmstart import kernels
from warmstart.runner.sampler import _filter
from warmstart.sampling_params import SamplingParams


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] logits -> [R, V] float32 distributions that `sample` draws from for these params (temperature > 0)."""
    scaled = logits.float() / params.temperature
    return _filter(scaled, [params] * logits.shape[0]).softmax(dim=-1)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from probs (unnormalized is fine), the sampler's exponential race."""
    e = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / e).argmax())


def verify(logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None, params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    k = len(drafts)
    assert logits.shape[0] == k + 1, (logits.shape, k)
    if params.greedy:
        target = kernels.argmax(logits)
        out = []
        for j, d in enumerate(drafts):
            if target[j] != d:
                break
            out.append(d)
        out.append(target[len(out)])
        return out
    p = processed_probs(logits, params)
    out = []
    for j, d in enumerate(drafts):
        q_d = float(draft_probs[j, d]) if draft_probs is not None else 1.0
        p_d = float(p[j, d])
        u = float(torch.rand((), generator=generator, device=p.device))
        if q_d > 0 and u * q_d < p_d:          # u < p/q, i.e. accepted with probability min(1, p/q)
            out.append(d)
            continue
        if draft_probs is not None:
            residual = (p[j] - draft_probs[j].to(p.device, torch.float32)).clamp_(min=0)
        else:
            residual = p[j].clone()
            residual[d] = 0
        if float(residual.sum()) <= 0:          # p == q up to rounding: the rejection had probability ~0
            residual = p[j]
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(p[k], generator))
    return out
