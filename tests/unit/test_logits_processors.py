"""Logits processors against reference implementations written token by token from the definitions
(OpenAI's presence/frequency penalties, the CTRL/HF repetition penalty, logit_bias, min_tokens)."""
from __future__ import annotations

import random

import pytest
import torch

from warmstart.errors import UserError
from warmstart.runner.batch import BatchItem
from warmstart.runner.logits_processors import LogitsProcessors, unpack_bitmask
from warmstart.sampling_params import SamplingParams

V = 50


def reference(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    out = list(logits)
    for tok, bias in p.logit_bias:
        out[tok] += bias
    for tok in set(prompt) | set(output):                 # repetition: prompt and output, once per distinct token
        out[tok] = out[tok] / p.repetition_penalty if out[tok] > 0 else out[tok] * p.repetition_penalty
    for tok in set(output):                               # OpenAI: mu[j] - c[j] * a_freq - float(c[j] > 0) * a_pres
        c = output.count(tok)
        out[tok] -= c * p.frequency_penalty + (1.0 if c > 0 else 0.0) * p.presence_penalty
    if len(output) < p.min_tokens:
        for tok in p.min_tokens_banned:
            out[tok] = float("-inf")
    return out


def item(seq_id: int, prompt: list[int], output: list[int], p: SamplingParams) -> BatchItem:
    history = prompt + output
    return BatchItem(seq_id, history[-1:], len(history) - 1, [0], True, p, len(prompt),
                     history=history if p.processes_logits else None)


CASES = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(frequency_penalty=-0.5, presence_penalty=-1.0),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8),
    SamplingParams(logit_bias={3: 5.0, 7: -100.0}),
    SamplingParams(max_tokens=20, min_tokens=10, min_tokens_banned=(2, 4)),
    SamplingParams(max_tokens=20, presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1,
                   logit_bias={1: 2.0}, min_tokens=5, min_tokens_banned=(0,)),
]


@pytest.mark.parametrize("params", CASES)
def test_processors_match_the_reference(params):
    rng = random.Random(0)
    items, rows = [], []
    for seq_id in range(4):
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 8))]
        output = [rng.randrange(V) for _ in range(rng.randrange(0, 12))]
        items.append(item(seq_id, prompt, output, params))
        rows.append((prompt, output))
    plain = SamplingParams()
    items.append(item(9, [1, 2], [3, 3], plain))          # an unprocessed row in the same batch stays untouched
    logits = torch.randn(len(items), V, generator=torch.Generator().manual_seed(1))
    out = LogitsProcessors().apply(logits, items)
    for i, (prompt, output) in enumerate(rows):
        expect = torch.tensor(reference(logits[i].tolist(), prompt, output, params))
        torch.testing.assert_close(out[i], expect, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[-1], logits[-1])


def test_each_penalty_moves_repeated_tokens_as_defined():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    history_prompt, output = [0], [1, 1, 2]
    def run(**kw):
        p = SamplingParams(**kw)
        return LogitsProcessors().apply(logits, [item(0, history_prompt, output, p)])[0].tolist()
    assert run(presence_penalty=1.0) == [2.0, -3.0, 0.0, 0.5]           # once per generated token
    assert run(frequency_penalty=1.0) == [2.0, -4.0, 0.0, 0.5]          # once per occurrence
    assert run(repetition_penalty=2.0) == [1.0, -4.0, 0.5, 0.5]         # prompt token 0 too; unseen 3 untouched


def test_plain_batch_is_returned_as_is():
    logits = torch.randn(3, V)
    items = [item(i, [1], [2], SamplingParams()) for i in range(3)]
    assert LogitsProcessors().apply(logits, items) is logits


def test_bitmask_unpacks_bit_j_of_word_i_to_token_32i_plus_j():
    mask = torch.tensor([[0b101, -(1 << 31), 1]], dtype=torch.int32)
    allowed = unpack_bitmask(mask, 70)[0]
    assert allowed.nonzero().flatten().tolist() == [0, 2, 63, 64]


def test_bad_values_are_user_errors():
    for kw in (dict(repetition_penalty=0), dict(min_tokens=5, max_tokens=4), dict(logit_bias={1: 101})):
        with pytest.raises(UserError):
            SamplingParams(**kw)
