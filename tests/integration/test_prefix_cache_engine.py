"""Prefix caching on a tiny real checkpoint: greedy tokens with the cache equal tokens without it (shared system
prompts, multi-turn chats, mixed batches, n > 1, a cache small enough to evict and preempt), prompt logprobs still
cover the whole prompt, and the cache survives LLM.close() -> boot, while corrupt, truncated, foreign and modified
files are ignored with a reason and change no token."""
import json
import shutil
import struct

import pytest

from tests.checkpoints import write_checkpoint
from warmstart import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SYSTEM = [(7 * i) % 300 + 3 for i in range(70)]          # 70 tokens: 4 full blocks of 16, then 6
QUESTIONS = [[11, 12, 13], [40] * 9, [5, 300, 7, 9], list(range(100, 130))]
ARGS = dict(kv_cache_memory=16 * 2**20, max_model_len=256, startup_plan="off")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama", layers=2)


@pytest.fixture(scope="module")
def cold(ckpt):
    return LLM(str(ckpt), enable_prefix_caching=False, **ARGS)


@pytest.fixture
def warm(ckpt, tmp_path):
    return LLM(str(ckpt), cache_dir=tmp_path / "cache", **ARGS)


def run(llm, prompts, params=GREEDY):
    """Add every prompt, step to the end; the live sequences (tokens, cached tokens, preemptions)."""
    engine = llm.booted.engine
    seqs = [engine.add(f"t{i}-{id(p)}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished:
        engine.step()
    engine.step()
    return seqs


def tokens(seqs):
    return [s.output_token_ids for s in seqs]


def test_shared_system_prompt_hits_and_matches_uncached(cold, warm):
    prompts = [SYSTEM + q for q in QUESTIONS]
    expect = tokens(run(cold, prompts))
    first = run(warm, prompts[:1])
    assert first[0].num_cached_tokens == 0
    rest = run(warm, prompts[1:])             # one at a time would hit too; a batch checks admission order
    assert [s.num_cached_tokens for s in rest] == [64, 64, 64]
    assert tokens(first + rest) == expect
    stats = warm.booted.engine.scheduler.prefix_stats
    assert stats.hit_tokens == 192 and stats.queried_tokens == sum(map(len, prompts))


def test_multi_turn_chat_reuses_the_history(cold, warm):
    conv = [{"role": "system", "content": "You are terse. " * 8}, {"role": "user", "content": "Hello world"}]
    for turn in range(3):
        ids = warm.tokenizer.encode_chat(conv)
        (w,), (c,) = run(warm, [ids]), run(cold, [ids])
        assert w.output_token_ids == c.output_token_ids
        if turn:
            assert w.num_cached_tokens >= 16 and w.num_cached_tokens % 16 == 0
        conv += [{"role": "assistant", "content": w.output_text}, {"role": "user", "content": f"And {turn}?"}]


def test_mixed_batch_with_groups_matches_uncached(cold, warm):
    run(warm, [SYSTEM + [1]])                 # the system prompt is cached before the batch arrives
    prompts = [SYSTEM + [2, 3], list(range(200, 240)), SYSTEM[:20] + [9] * 30, SYSTEM + [2, 3], [8, 8, 8]]
    expect = tokens(run(cold, prompts))
    assert tokens(run(warm, prompts)) == expect
    group = warm.booted.engine.add_group(["g0", "g1", "g2"], SYSTEM + [77], [GREEDY] * 3)   # n = 3
    while warm.booted.engine.has_unfinished:
        warm.booted.engine.step()
    assert [s.output_token_ids for s in group] == tokens(run(cold, [SYSTEM + [77]])) * 3
    assert group[0].num_cached_tokens == 64
    assert warm.booted.engine.blocks.num_used == 0


def test_small_cache_evicts_and_preempts_with_the_same_tokens(ckpt, cold, tmp_path):
    block_bytes = cold.booted.runner.kv_block_bytes(16)
    small = LLM(str(ckpt), kv_cache_memory=12 * block_bytes, max_model_len=128, max_num_batched_tokens=32,
                startup_plan="off", cache_dir=tmp_path / "cache")
    prompts = [SYSTEM[:40] + q for q in QUESTIONS] + [[5 + i] * (10 + 9 * i) for i in range(4)]
    expect = tokens(run(cold, prompts))
    first = run(small, prompts)
    again = run(small, list(reversed(prompts)))
    assert sum(s.num_preemptions for s in first + again) > 0
    assert tokens(first) == expect and tokens(again) == list(reversed(expect))
    blocks = small.booted.engine.blocks
    assert blocks.num_free == 12 and blocks.num_cached <= 12
    assert small.booted.engine.scheduler.prefix_stats.hit_tokens > 0


def test_prompt_logprobs_cover_the_whole_prompt_despite_a_cached_prefix(cold, warm):
    run(warm, [SYSTEM + [1, 2]])
    p = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1, ignore_eos=True)
    (w,), (c,) = run(warm, [SYSTEM + [1, 2]], p), run(cold, [SYSTEM + [1, 2]], p)
    assert w.num_cached_tokens == 0 and len(w.prompt_logprobs) == len(SYSTEM) + 1
    assert [x.logprob for x in w.prompt_logprobs] == pytest.approx([x.logprob for x in c.prompt_logprobs],
                                                                   abs=1e-4)


# ------------------------------------------------------------------------------------------ across a restart

@pytest.fixture(scope="module")
def saved(ckpt, tmp_path_factory):
    """A cache dir holding the file an LLM wrote at close() after serving SYSTEM-prefixed prompts."""
    cache = tmp_path_factory.mktemp("saved")
    llm = LLM(str(ckpt), cache_dir=cache, **ARGS)
    run(llm, [SYSTEM + QUESTIONS[0]])
    out = llm.close()
    assert out.status == "saved" and out.blocks == 5 and llm.close() is None   # 84 computed tokens
    (path,) = (cache / "prefix").glob("*.safetensors")
    return cache, path, out


def boot_with(ckpt, tmp_path, saved, mutate=None, **args):
    cache = tmp_path / "cache"
    shutil.copytree(saved[0], cache)
    path = cache / "prefix" / saved[1].name
    if mutate:
        mutate(path)
    return LLM(str(ckpt), cache_dir=cache, **{**ARGS, **args})


def test_restore_after_close_hits_and_matches_uncached(ckpt, cold, saved, tmp_path):
    llm = boot_with(ckpt, tmp_path, saved)
    report = llm.report.to_dict()
    assert "prefix restore" in [s["name"] for s in report["steps"]]
    r = report["prefix_restore"]
    assert r["status"] == "restored" and r["blocks"] == 5
    assert r["bytes"] == 5 * llm.booted.runner.kv_block_bytes(16)
    (s,) = run(llm, [SYSTEM + QUESTIONS[2]])
    assert s.num_cached_tokens == 64
    assert s.output_token_ids == tokens(run(cold, [SYSTEM + QUESTIONS[2]]))[0]


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 1000])


def _edit_index(path):
    """Change one saved token id but keep the K/V bytes and their digest: only the key chain can tell."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    index = json.loads(header["__metadata__"]["index"])
    index["entries"][1]["tokens"][0] += 1
    header["__metadata__"]["index"] = json.dumps(index)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


@pytest.mark.parametrize("mutate, reason", [
    (_flip_last_byte, "SHA-256"),
    (_truncate, "truncated"),
    (_edit_index, "does not match its token ids"),
    (lambda p: p.write_bytes(b"\x00" * 4), "truncated"),
])
def test_damaged_file_is_ignored_and_changes_no_token(ckpt, cold, saved, tmp_path, mutate, reason):
    llm = boot_with(ckpt, tmp_path, saved, mutate)
    r = llm.report.extra["prefix_restore"]
    assert r["status"] == "ignored" and reason in r["reason"] and r["blocks"] == 0
    (s,) = run(llm, [SYSTEM + QUESTIONS[2]])
    assert s.num_cached_tokens == 0
    assert s.output_token_ids == tokens(run(cold, [SYSTEM + QUESTIONS[2]]))[0]


def test_foreign_and_mismatched_files_are_ignored(ckpt, cold, saved, tmp_path):
    other = write_checkpoint(tmp_path / "other", "llama", layers=2, seed=1)
    foreign = LLM(str(other), cache_dir=tmp_path / "other-cache", **ARGS)
    run(foreign, [SYSTEM + QUESTIONS[0]])
    assert foreign.close().status == "saved"
    (foreign_file,) = (tmp_path / "other-cache" / "prefix").glob("*.safetensors")
    llm = boot_with(ckpt, tmp_path, saved, lambda p: shutil.copyfile(foreign_file, p))
    r = llm.report.extra["prefix_restore"]
    assert r["status"] == "ignored" and "model.weights" in r["reason"]
    (s,) = run(llm, [SYSTEM + QUESTIONS[2]])
    assert s.num_cached_tokens == 0 and s.output_token_ids == tokens(run(cold, [SYSTEM + QUESTIONS[2]]))[0]
    shutil.rmtree(tmp_path / "cache")
    r = boot_with(ckpt, tmp_path, saved, block_size=8).report.extra["prefix_restore"]
    assert r["status"] == "ignored" and "block_size" in r["reason"]


def test_persist_zero_neither_saves_nor_restores(ckpt, saved, tmp_path):
    llm = boot_with(ckpt, tmp_path, saved, prefix_cache_persist=0)
    assert llm.report.extra["prefix_restore"]["status"] == "off"
    run(llm, [SYSTEM + QUESTIONS[1]])
    assert llm.close() is None
