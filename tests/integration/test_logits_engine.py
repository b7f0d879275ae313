"""Structured outputs and sampling controls through the offline engine on a tiny random checkpoint: the grammar
guarantees valid output from a model that knows nothing, in a batch mixed with unconstrained requests."""
import json
import re

import pytest

from tests.checkpoints import write_checkpoint
from warmstart import LLM, SamplingParams
from warmstart.errors import UserError

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
    "size": {"enum": ["small", "large"]}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "ok", "size", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    ckpt = write_checkpoint(tmp_path_factory.mktemp("llama"), "llama", layers=2)
    return LLM(str(ckpt), kv_cache_memory=16 * 2**20, max_model_len=256, startup_plan="off")


def test_json_schema_output_is_valid_in_a_mixed_batch(llm):
    g = llm.compile_grammar("json", SCHEMA)
    free = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    alone = llm.generate("Hello", free)[0].output_token_ids
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=s, grammar=g) for s in range(4)]
    outs = llm.generate(["Hello"] * 5, params + [free])
    for o in outs[:4]:
        assert o.finish_reason == "stop", o.text
        obj = json.loads(o.text)
        assert set(obj) == {"name", "ok", "size", "n"} and obj["size"] in ("small", "large")
        assert isinstance(obj["ok"], bool) and 0 <= obj["n"] <= 999 and len(obj["name"]) <= 8
    assert outs[4].output_token_ids == alone           # the constrained rows leave the free one untouched


def test_regex_and_choice(llm):
    out = llm.generate("Hi", SamplingParams(max_tokens=20, temperature=1.0, seed=1,
                                            grammar=llm.compile_grammar("regex", r"[a-c]{3}-\d\d")))[0]
    assert re.fullmatch(r"[a-c]{3}-[0-9][0-9]", out.text), out.text
    out = llm.generate("Hi", SamplingParams(max_tokens=20, temperature=1.0, seed=2,
                                            grammar=llm.compile_grammar("choice", ["yes", "no", "maybe"])))[0]
    assert out.text in ("yes", "no", "maybe")


def test_regex_digit_and_word_classes_are_ascii(llm):
    """\\d and \\w mean ASCII, as in JSON Schema patterns and vLLM's regex backends: llguidance alone reads them as
    Unicode classes, and a GPU run of test_regex_and_choice produced 'aaa-𜳴１' (an outlined and a fullwidth
    digit)."""
    from warmstart.runner.grammar import ascii_classes
    assert ascii_classes(r"[a-c]{3}-\d\d") == "[a-c]{3}-[0-9][0-9]"
    assert ascii_classes(r"[\w-]+\D[^\d\s]\\d[]\d]") == r"[0-9A-Za-z_-]+[^0-9][^0-9\s]\\d[]0-9]"

    def accepts(kind, spec, text):
        m = llm.compile_grammar(kind, spec).new_matcher()
        return m.consume_tokens(llm.tokenizer.encode(text, add_special_tokens=False)) and not m.is_error()
    for spec in (r"\d\d", r"[\d]+", r"\w+"):
        assert accepts("regex", spec, "12")
        assert not accepts("regex", spec, "１２"), spec
    assert accepts("regex", r"\D", "x") and not accepts("regex", r"\D", "1")
    assert not accepts("json", {"type": "string", "pattern": r"^\d+$"}, '"１２"')   # llguidance's JSON: already ASCII


def test_bad_grammars_are_user_errors(llm):
    for kind, spec in (("json", {"type": "nope"}), ("regex", "[a-"), ("json", "{not json"), ("choice", [])):
        with pytest.raises(UserError):
            llm.compile_grammar(kind, spec)


def test_min_tokens_delays_eos(llm):
    eos = sorted(llm.booted.engine.eos_token_ids)[0]
    # A huge bias makes EOS the greedy choice at once; min_tokens holds it off for exactly 5 tokens.
    p = SamplingParams(max_tokens=20, temperature=0, logit_bias={eos: 100})
    assert llm.generate("Hi", p)[0].output_token_ids == [eos]
    out = llm.generate("Hi", SamplingParams(max_tokens=20, temperature=0, logit_bias={eos: 100}, min_tokens=5))[0]
    assert len(out.output_token_ids) == 6 and out.output_token_ids[-1] == eos


def test_include_stop_str_and_special_tokens(llm):
    base = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].text
    stop = base[3:5]
    cut = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))[0]
    kept = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop],
                                                include_stop_str_in_output=True))[0]
    assert kept.text == cut.text + stop and base.startswith(kept.text)
    special = llm.tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]
    p = dict(max_tokens=3, temperature=0, logit_bias={special: 100}, ignore_eos=True)
    assert llm.generate("Hi", SamplingParams(**p))[0].text == ""
    assert llm.generate("Hi", SamplingParams(**p, skip_special_tokens=False))[0].text == "<|im_start|>" * 3
