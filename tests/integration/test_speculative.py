"""Speculative decoding on tiny real checkpoints: greedy output equals the target alone for a draft that agrees
(the target itself), one that rarely does (another random model, same vocab) and n-gram lookup; mixed batches,
rollback after many rejections, stops and max_tokens mid-proposal, preemption, n > 1, logprobs, seeds."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints import write_checkpoint
from warmstart import LLM, SamplingParams
from warmstart.errors import UserError

ARGS = dict(kv_cache_memory=16 * 2**20, max_model_len=320, startup_plan="off", dtype="float32")
REPEAT = [(5 * i) % 40 + 3 for i in range(24)]
PROMPTS = [REPEAT + REPEAT[:9], [11, 12, 13], list(range(100, 150)), [40] * 9, [7, 300, 9, 21, 33, 7, 300]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("target"), "llama", layers=2)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("other"), "llama", layers=1, hidden=64, seed=7)


@pytest.fixture(scope="module")
def plain(target):
    return LLM(str(target), **ARGS)


def run(llm, prompts, params, ids="r"):
    engine = llm.booted.engine
    seqs = [engine.add(f"{ids}{i}", p, params if not isinstance(params, list) else params[i])
            for i, p in enumerate(prompts)]
    while engine.has_unfinished:
        engine.step()
    engine.step()
    return seqs


def out(seqs):
    return [s.output_token_ids for s in seqs]


def spec_llm(kind, target, other, k=4, **kw):
    if kind == "self":
        return LLM(str(target), speculative_model=str(target), num_speculative_tokens=k, **{**ARGS, **kw})
    if kind == "other":
        return LLM(str(target), speculative_model=str(other), num_speculative_tokens=k, **{**ARGS, **kw})
    return LLM(str(target), speculative_method="ngram", num_speculative_tokens=k, **{**ARGS, **kw})


@pytest.mark.parametrize("kind", ["self", "other", "ngram"])
def test_greedy_identity(kind, target, other, plain):
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=2) for m in (40, 1, 17, 33, 6)]
    want = run(plain, PROMPTS, params)
    llm = spec_llm(kind, target, other)
    got = run(llm, PROMPTS, params)
    assert out(got) == out(want)
    for g, w in zip(got, want):             # the target's logprobs, one per token
        assert len(g.logprobs) == len(g.output_token_ids)
        assert [lp.top[0][0] for lp in g.logprobs] == [lp.top[0][0] for lp in w.logprobs]
        assert [round(lp.logprob, 3) for lp in g.logprobs] == pytest.approx([round(lp.logprob, 3) for lp in w.logprobs],
                                                                              abs=2e-3)
    stats = llm.booted.engine.spec_stats
    assert stats.proposals > 0 and stats.verify_steps > 0
    if kind == "self":
        assert stats.acceptance_rate > 0.9
        assert stats.mean_tokens_per_forward > 3


def test_mixed_batch_accepts_different_counts(target, other, plain):
    """Sequences of one step accept different numbers of proposals; each still equals the target alone."""
    llm = spec_llm("ngram", target, other)
    engine = llm.booted.engine
    seen = []
    execute = engine.executor.execute

    def spy(batch):
        results = execute(batch)
        counts = [len(r.all_token_ids) - 1 for it, r in zip(batch.items, results) if it.draft_token_ids]
        if len(counts) > 1:
            seen.append(counts)
        return results
    engine.executor.execute = spy
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    prompts = PROMPTS + [REPEAT * 2, [3, 4, 5, 3, 4, 5, 3, 4]]
    assert out(run(llm, prompts, params)) == out(run(plain, prompts, params))
    assert any(len(set(c)) > 1 for c in seen), seen


def test_rollback_long_generation(target, other, plain):
    """A draft that is rarely right: many rejected proposals leave stale K/V slots behind the rolled-back
    position; a long generation still equals the target alone."""
    params = SamplingParams(max_tokens=250, temperature=0, ignore_eos=True)
    prompts = [[11, 12, 13], REPEAT]
    llm = spec_llm("other", target, other, k=5)
    assert out(run(llm, prompts, params)) == out(run(plain, prompts, params))
    stats = llm.booted.engine.spec_stats
    assert stats.proposals - stats.accepted > 200
    assert llm.booted.engine.blocks.num_used == 0        # every speculative block came back


def test_stops_and_max_tokens_mid_proposal(target, plain, other):
    want_full = run(plain, [REPEAT], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    stop_tok = want_full.output_token_ids[5]
    llm = spec_llm("self", target, other, k=6)
    for m in range(1, 9):
        p = SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
        assert out(run(llm, [REPEAT], p, f"m{m}-")) == [want_full.output_token_ids[:m]]
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=(stop_tok,))
    got, want = run(llm, [REPEAT], p, "s"), run(plain, [REPEAT], p, "s")
    assert out(got) == out(want) and got[0].finish_reason == "stop"
    text = plain.tokenizer.decode(want_full.output_token_ids[3:6])
    if text.strip():
        p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=(text,))
        g, w = run(llm, [REPEAT], p, "t")[0], run(plain, [REPEAT], p, "t")[0]
        assert (g.output_text, g.finish_reason) == (w.output_text, w.finish_reason)


def test_preemption_and_chunked_prefill(target, other):
    """A cache too small for the batch (preemption by recompute) and a small token budget (chunked prefill)."""
    args = dict(ARGS, kv_cache_memory=None, max_num_batched_tokens=32, kv_cache_dtype="float32")  # sizes below: fp32
    base = LLM(str(target), **{**args, "kv_cache_memory": 24 * 12288})      # 24 blocks of 16 tokens
    small = dict(kv_cache_memory=24 * (12288 + 4096))                        # the same 24, draft KV beside
    assert base.booted.ledger.num_kv_blocks == 24
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    prompts = [list(range(3 + i, 60 + i)) for i in range(6)]
    want = run(base, prompts, params)
    llm = spec_llm("other", target, other, **{**args, **small})
    got = run(llm, prompts, params)
    assert out(got) == out(want)
    assert llm.booted.ledger.num_kv_blocks == 24
    assert sum(s.num_preemptions for s in got) > 0


def test_n_greater_than_one_and_seeds(target, other):
    llm = spec_llm("self", target, other)
    engine = llm.booted.engine
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2, 1)]
    seqs = engine.add_group(["a", "b", "c"], REPEAT, params)
    while engine.has_unfinished:
        engine.step()
    engine.step()
    a, b, c = (s.output_token_ids for s in seqs)
    assert a == c and a != b and len(a) == 20
    again = run(llm, [REPEAT], params[0], "x")[0]
    assert again.output_token_ids == a


def test_vocab_mismatch_is_a_user_error(target, tmp_path):
    small = write_checkpoint(tmp_path / "v", "llama", layers=1, vocab_size=320)
    with pytest.raises(UserError, match="320.*384"):
        LLM(str(target), speculative_model=str(small), num_speculative_tokens=3, **ARGS)


def test_config_checks(target):
    with pytest.raises(UserError, match="num-speculative-tokens"):
        LLM(str(target), speculative_method="ngram", **ARGS)
    with pytest.raises(UserError, match="proposer"):
        LLM(str(target), num_speculative_tokens=3, **ARGS)


def test_serve_reports_speculation_in_startup_and_metrics(target, tmp_path):
    import httpx

    from tests.integration.server_process import ServerProcess
    srv = ServerProcess(target, "--kv-cache-memory", "16MiB", "--max-model-len", 320, "--cache-dir", tmp_path / "c",
                        "--speculative-method", "ngram", "--num-speculative-tokens", 3,
                        log_path=tmp_path / "server.log")
    try:
        srv.wait_ready(timeout=120)
        r = httpx.post(f"{srv.base_url}/v1/completions", timeout=60,
                       json={"model": target.name, "prompt": REPEAT + REPEAT, "max_tokens": 40, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200, r.text
        spec = httpx.get(f"{srv.base_url}/startup").json()["speculative"]
        assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 3
        assert spec["proposals"] > 0 and 0 <= spec["acceptance_rate"] <= 1
        assert spec["mean_tokens_per_target_forward"] >= 1
        assert srv.metric("warmstart_spec_proposed_tokens_total") == spec["proposals"]
        assert srv.metric("warmstart_spec_accepted_tokens_total") == spec["accepted_tokens"]
    finally:
        srv.terminate()


def test_plan_key_names_k_and_method_and_the_ledger_covers_the_draft(target, other, tmp_path):
    # Generous: the runtime overhead is this (long-lived test) process's RSS. The KV mapping is lazy on CPU.
    args = dict(max_model_len=320, dtype="float32", memory_utilization=0.25, cache_dir=tmp_path / "c")
    first = LLM(str(target), speculative_model=str(other), num_speculative_tokens=3, **args)
    assert first.report.plan.status == "miss" and first.report.plan.saved
    changed = LLM(str(target), speculative_model=str(other), num_speculative_tokens=4, **args)
    assert changed.report.plan.status == "miss"
    assert any("speculative.num_tokens" in r for r in changed.report.plan.reasons), changed.report.plan.reasons
    ngram = LLM(str(target), speculative_method="ngram", num_speculative_tokens=3, **args)
    assert any("speculative.method" in r or "draft_model" in r for r in ngram.report.plan.reasons)
    m = first.booted.ledger
    assert m.draft_kv_cache_bytes == m.num_kv_blocks * first.booted.engine.proposer.runner.kv_block_bytes(16)
    assert m.kv_block_bytes == first.booted.runner.kv_block_bytes(16) + \
        first.booted.engine.proposer.runner.kv_block_bytes(16)
    assert m.draft_weights_bytes > 0 and "draft kv cache" in m.table() and "draft weights" in m.table()
    # `plan explain` builds the boot's key, draft model included: it finds the plan the first boot saved (a
    # process-RSS difference may still fail the free-memory gate, but never the key).
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "warmstart", "-q", "plan", "explain", str(target), "--speculative-model",
                        str(other), "--num-speculative-tokens", "3", "--max-model-len", "320", "--dtype", "float32",
                        "--memory-utilization", "0.25", "--cache-dir", str(tmp_path / "c")], capture_output=True,
                       text=True, cwd=root, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert str(first.report.plan.path) in r.stdout and "draft_model" not in r.stdout, r.stdout


def test_prefix_cache_holds_only_verified_blocks(target, other, plain, tmp_path):
    """After many rejections, every cached block holds the tokens of its request at its position, and a new
    request that reuses them (prompt = an earlier prompt + its output) still decodes as the target alone without
    a cache. Between steps a sequence never keeps blocks beyond its tokens (rejected slots are trimmed)."""
    llm = spec_llm("other", target, other, k=5)
    engine = llm.booted.engine
    step = engine.step
    extra = []

    def checked_step():
        outs = step()
        for seq in engine.scheduler.running:
            extra.append(len(seq.block_table) - engine.blocks.blocks_for(len(seq.token_ids)))
        return outs
    engine.step = checked_step
    params = SamplingParams(max_tokens=70, temperature=0, ignore_eos=True)
    first = run(llm, [REPEAT, [11, 12, 13]], params)
    assert extra and max(extra) <= 0
    bs = engine.blocks.block_size
    for meta in engine.blocks.cached_blocks():
        assert any(tuple(s.token_ids[meta.depth * bs:(meta.depth + 1) * bs]) == meta.token_ids for s in first)
    again = [s.token_ids for s in first]
    got = run(llm, again, params, "again")
    assert sum(s.num_cached_tokens for s in got) > 0
    nocache = LLM(str(target), enable_prefix_caching=False, **ARGS)
    assert out(got) == out(run(nocache, again, params))


def test_logits_processors_turn_speculation_off_for_their_request_only(target, other, plain):
    """Penalties and bias depend on every token before the one they shape, so a request that uses them decodes one
    token per step (and equals the plain engine), while a plain request in the same batch still speculates."""
    processed = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, presence_penalty=1.5,
                               frequency_penalty=0.5, logit_bias={7: 3.0})
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = run(plain, PROMPTS[:2], [processed, greedy], ids="lp")
    llm = spec_llm("self", target, other)
    got = run(llm, PROMPTS[:2], [processed, greedy], ids="lp")
    assert out(got) == out(want)
    assert llm.booted.engine.spec_stats.accepted > 0            # the plain request did speculate
