"""Issue 9 item 1: one request can never fail another. A failure injected into one request's sampling (a value
that got past validation) or into its step fails that request alone; the rest of the batch gives the tokens it
gives alone, and every KV block comes back."""
import pytest

from tests.checkpoints import write_checkpoint
from warmstart import LLM, SamplingParams
from warmstart.errors import UserError

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
PROMPTS = [[5, 6, 7], [9, 9, 9, 9], [11, 12]]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    ckpt = write_checkpoint(tmp_path_factory.mktemp("llama"), "llama", layers=2)
    return LLM(str(ckpt), kv_cache_memory=8 * 2**20, max_model_len=128, startup_plan="off")


def _corrupt(**fields) -> SamplingParams:
    """Params whose values validation would refuse: the injected failure happens on the engine thread."""
    p = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    for k, v in fields.items():
        object.__setattr__(p, k, v)
    return p


@pytest.mark.parametrize("bad", [{"top_k": 2**63}, {"seed": 2**70}], ids=["top_k-overflow", "seed-overflow"])
def test_a_failure_in_one_requests_sampling_fails_only_that_request(llm, bad):
    alone = [llm.generate_ids([PROMPTS[0]], GREEDY)[0], llm.generate_ids([PROMPTS[2]], SEEDED)[0]]
    outs = llm.generate_ids(PROMPTS, [GREEDY, _corrupt(**bad), SEEDED])
    assert outs[1].finish_reason == "error" and outs[1].output_token_ids == []
    assert outs[0].output_token_ids == alone[0].output_token_ids
    assert outs[2].output_token_ids == alone[1].output_token_ids
    engine = llm.booted.engine
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_failure_in_one_requests_step_fails_only_that_request(llm, monkeypatch):
    """The forward itself raising for one request's input: the engine retries the items one by one."""
    alone = llm.generate_ids([PROMPTS[0], PROMPTS[2]], GREEDY)
    runner = llm.booted.runner
    real = runner.execute

    def execute(batch):
        if any(it.token_ids[:4] == PROMPTS[1] for it in batch.items):
            raise RuntimeError("injected failure")
        return real(batch)
    monkeypatch.setattr(runner, "execute", execute)
    outs = llm.generate_ids(PROMPTS, GREEDY)
    assert outs[1].finish_reason == "error"
    assert [outs[0].output_token_ids, outs[2].output_token_ids] == [o.output_token_ids for o in alone]
    assert llm.booted.engine.blocks.num_free == llm.booted.engine.blocks.num_blocks


@pytest.mark.parametrize("field,value", [("top_k", 2**63), ("seed", 2**64), ("max_tokens", 2**40),
                                         ("temperature", float("inf")), ("temperature", float("nan")),
                                         ("stop_token_ids", (2**64,))])
def test_values_the_engine_cannot_represent_are_refused_and_named(field, value):
    with pytest.raises(UserError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_a_failure_in_one_requests_postprocessing_fails_only_that_request(llm, monkeypatch):
    """Stop checks and detokenization run per request too: one raising retires that request alone."""
    alone = llm.generate_ids([PROMPTS[0], PROMPTS[2]], GREEDY)
    engine = llm.booted.engine
    real = engine._stop_reason

    def stop_reason(seq, token):
        if seq.prompt_token_ids == PROMPTS[1] and len(seq.output_token_ids) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(seq, token)
    monkeypatch.setattr(engine, "_stop_reason", stop_reason)
    outs = llm.generate_ids(PROMPTS, GREEDY)
    assert outs[1].finish_reason == "error"
    assert [outs[0].output_token_ids, outs[2].output_token_ids] == [o.output_token_ids for o in alone]
    assert engine.blocks.num_free == engine.blocks.num_blocks
