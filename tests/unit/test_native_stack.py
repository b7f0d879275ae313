"""The compiled decoder stack (kernels/csrc/decoder_stack.cpp, models/native.py) against the Python layer loop it
replaces for paged steps: it makes the same kernel calls in the same order, so logits must be bit-identical, for
decode steps and short chunks over a cached prefix, for fused (quantized) and separate (float) projections, with
and without biases, in float32 and bfloat16. Models it cannot run (per-head q/k norms, float16) must keep the
Python path."""
import pytest
import torch

from tests.checkpoints import write_checkpoint
from warmstart import LLM, SamplingParams, kernels
from warmstart.models import native
from warmstart.runner.attention import PAGED_MAX_Q, PagedAttentionBackend
from warmstart.runner.batch import BatchItem

pytestmark = pytest.mark.skipif(kernels.native_stack() is None or not kernels.has_qlinear(),
                                reason=f"decoder stack not built: {kernels.STACK_UNAVAILABLE_REASON}")
PROMPT = list(range(3, 70))


class Counting:
    """Stands in for the compiled Stack and counts the calls that reach it."""

    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def forward(self, *args):
        self.calls += 1
        return self.stack.forward(*args)


def boot(d, quantization, kv_cache_dtype="auto", dtype="float32"):
    return LLM(str(d), dtype=dtype, quantization=quantization, startup_plan="off", max_model_len=256,
               kv_cache_memory=16 * 2**20, kv_cache_dtype=kv_cache_dtype)


def step_logits(llm, prompt, chunk, stack):
    """Logits of every prompt position, fed `chunk` tokens per step through the runner, with the body's stack
    set to `stack` (None: the Python loop)."""
    runner = llm.booted.runner
    native.set_stack(runner.model.model, stack)
    blocks = list(range(-(-len(prompt) // runner.block_size)))
    rows = []
    with torch.inference_mode():
        for start in range(0, len(prompt), chunk):
            ids, pos, meta = runner._prepare([BatchItem(0, prompt[start:start + chunk], start, blocks, True,
                                                        SamplingParams(), len(prompt))])
            attn = PagedAttentionBackend(runner.kv, runner.block_size)
            attn.meta = meta
            rows.append(runner.model.compute_logits(runner.forward(ids, pos, attn)))
    return torch.cat(rows)


@pytest.fixture(scope="module", params=["llama", "qwen2"])       # tied, no bias; untied with q/k/v biases
def ckpt(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, layers=2)


@pytest.mark.parametrize("quantization,kv_cache_dtype,dtype", [
    ("none", "auto", "float32"), ("int8", "auto", "float32"), ("int4", "auto", "float32"),
    ("int4", "float32", "float32"), ("int4", "int8", "float32"),
    ("none", "auto", "bfloat16"), ("none", "int8", "bfloat16"), ("none", "float16", "bfloat16")])
@pytest.mark.parametrize("chunk", [1, 5, PAGED_MAX_Q])
def test_logits_bit_identical_to_the_python_loop(ckpt, quantization, kv_cache_dtype, dtype, chunk):
    llm = boot(ckpt, quantization, kv_cache_dtype, dtype)
    body = llm.booted.runner.model.model
    stack = native.build(body)
    assert stack is not None, "an eligible model must get the compiled stack"
    counting = Counting(stack)
    ours = step_logits(llm, PROMPT, chunk, counting)
    ref = step_logits(llm, PROMPT, chunk, None)
    steps = -(-len(PROMPT) // chunk)
    # the first chunk has nothing cached (the fresh route, Python); every later one is paged
    assert counting.calls == steps - 1
    assert torch.equal(ours, ref), (ours - ref).abs().max()


def test_engine_greedy_ids_equal_with_and_without_the_stack(ckpt, monkeypatch):
    prompts = [PROMPT, [5, 17, 33], list(range(100, 140))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ours = [o.output_token_ids for o in boot(ckpt, "int4").generate_ids(prompts, params)]
    monkeypatch.setenv(native.DISABLED_ENV, "1")
    llm = boot(ckpt, "int4")
    ref = [o.output_token_ids for o in llm.generate_ids(prompts, params)]
    assert native.stack_for(llm.booted.runner.model.model) is None
    assert ours == ref


def test_engine_greedy_ids_equal_with_and_without_the_stack_in_bfloat16(ckpt, monkeypatch):
    prompts = [PROMPT, [5, 17, 33], list(range(100, 140))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = boot(ckpt, "none", dtype="bfloat16")
    ours = [o.output_token_ids for o in llm.generate_ids(prompts, params)]
    assert native.stack_for(llm.booted.runner.model.model) is not None
    monkeypatch.setenv(native.DISABLED_ENV, "1")
    llm = boot(ckpt, "none", dtype="bfloat16")
    ref = [o.output_token_ids for o in llm.generate_ids(prompts, params)]
    assert native.stack_for(llm.booted.runner.model.model) is None
    assert ours == ref


def test_per_head_qk_norm_and_float16_keep_the_python_loop(tmp_path, ckpt):
    assert native.build(boot(ckpt, "none", dtype="float16").booted.runner.model.model) is None
    llm = boot(write_checkpoint(tmp_path, "qwen3", layers=2), "none")
    assert native.build(llm.booted.runner.model.model) is None
    out = llm.generate_ids([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].output_token_ids) == 4
