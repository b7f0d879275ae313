import pytest

from warmstart.config import EngineConfig, parse_bytes
from warmstart.errors import UserError
from warmstart.sampling_params import SamplingParams


@pytest.mark.parametrize("text,value", [("256MiB", 256 * 2**20), ("2GiB", 2 * 2**30), ("1.5G", 1_500_000_000),
                                        ("4096", 4096), ("10kb", 10_000), (" 3 mib ", 3 * 2**20)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "abc", "12XB", "-5", "1e9"])
def test_parse_bytes_rejects(text):
    with pytest.raises(UserError, match="byte size"):
        parse_bytes(text)


@pytest.mark.parametrize("kw,match", [
    (dict(memory_utilization=0), "memory-utilization"), (dict(memory_utilization=1.5), "memory-utilization"),
    (dict(kv_cache_memory=0), "kv-cache-memory"), (dict(block_size=12), "block-size"),
    (dict(max_num_seqs=0), "max-num-seqs"), (dict(dtype="int8"), "dtype"), (dict(startup_plan="x"), "startup-plan"),
])
def test_config_rejects(kw, match):
    with pytest.raises(UserError, match=match):
        EngineConfig(model="m", **kw)


def test_config_is_frozen_and_replace_makes_new():
    c = EngineConfig(model="m", memory_utilization=0.3)
    with pytest.raises(Exception):
        c.memory_utilization = 0.5
    d = c.replace(memory_utilization=0.12)
    assert c.memory_utilization == 0.3 and d.memory_utilization == 0.12


@pytest.mark.parametrize("kw", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_p=1.5),
                                dict(min_p=2), dict(top_k=-1), dict(logprobs=21), dict(stop=("",))])
def test_sampling_params_reject(kw):
    with pytest.raises(UserError):
        SamplingParams(**kw)
