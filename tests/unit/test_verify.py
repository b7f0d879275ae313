"""The verification rule of speculative decoding (runner/verify.py), statistically: whatever the proposal
distribution q, the emitted tokens are distributed as the target's p. A wrong rule (always accept, or resample
from p instead of the residual) fails the same check, so the check has the power to catch it."""
import pytest
import torch

from warmstart.runner.verify import _draw, processed_probs, verify
from warmstart.sampling_params import SamplingParams

V, N = 6, 3000
P_LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3])
Q = torch.tensor([0.05, 0.5, 0.05, 0.3, 0.05, 0.05])
PARAMS = SamplingParams(temperature=1.0)


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny tensor ops: threads only add contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def run(rule, k=2, q=Q, point_mass=False, seed=0):
    """Empirical distribution of the first two emitted tokens (the second only when the first was accepted)."""
    gen = torch.Generator().manual_seed(seed)
    logits = P_LOGITS.repeat(k + 1, 1)
    first = torch.zeros(V)
    second = torch.zeros(V)
    for _ in range(N):
        drafts = [int(torch.multinomial(q, 1, generator=gen)) for _ in range(k)]
        probs = None if point_mass else q.repeat(k, 1)
        out = rule(logits, drafts, probs, PARAMS, gen)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


def always_accept(logits, drafts, probs, params, gen):
    return drafts + [_draw(processed_probs(logits[-1:], params)[0], gen)]


def resample_from_p(logits, drafts, probs, params, gen):
    p = processed_probs(logits, params)
    out = []
    for j, d in enumerate(drafts):
        q_d = float(probs[j, d]) if probs is not None else 1.0
        if float(torch.rand((), generator=gen)) * q_d < float(p[j, d]):
            out.append(d)
            continue
        return out + [_draw(p[j], gen)]           # wrong: p, not norm(max(0, p - q))
    return out + [_draw(p[-1], gen)]


P = processed_probs(P_LOGITS[None], PARAMS)[0]


def test_rule_emits_the_targets_distribution():
    first, second = run(verify)
    assert tv(first, P) < 0.05
    assert tv(second, P) < 0.06


def test_rule_with_a_point_mass_proposal():
    """n-gram proposals are deterministic: q is a point mass on the proposed token."""
    first, _ = run(verify, q=torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0]), point_mass=True)
    assert tv(first, P) < 0.05


@pytest.mark.parametrize("wrong", [always_accept, resample_from_p])
def test_wrong_rules_fail_the_same_check(wrong):
    first, _ = run(wrong)
    assert tv(first, P) > 0.12    # always accept: 0.56; resample from p: 0.17


def test_greedy_accepts_while_argmax_agrees():
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0], [0.0, 5.0, 0.0]])
    g = SamplingParams(temperature=0)
    assert verify(logits, [1, 2, 0], None, g, None) == [1, 2, 0, 1]
    assert verify(logits, [1, 0, 0], None, g, None) == [1, 2]
    assert verify(logits, [2, 2, 0], None, g, None) == [1]


def test_seeded_draws_are_reproducible():
    a = run(verify, seed=5)
    b = run(verify, seed=5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
