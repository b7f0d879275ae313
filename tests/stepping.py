"""Driving a Scheduler without a runner, for the scheduler and prefix-cache unit tests."""


def run_step(s, sampled_token=7):
    """Apply a step's results the way the engine does: advance computed tokens, append a token when sampled.
    The batch the runner would get is attached as out.batch (built before the results are applied)."""
    out = s.schedule()
    object.__setattr__(out, "batch", out.to_batch([]))
    for sc in out.scheduled:
        sc.seq.num_computed_tokens += sc.num_tokens
        if sc.seq.num_computed_tokens == len(sc.seq.token_ids):
            sc.seq.token_ids.append(sampled_token)
    return out
