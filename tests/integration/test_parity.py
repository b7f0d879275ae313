"""Parity with Hugging Face transformers on the same checkpoint, per family, in float32 with a float32 KV cache:
greedy token ids equal transformers' generate, and prompt logits agree within LOGIT_ATOL. The CPU default cache
(float16 for a float32 model) is checked against the same reference within F16_KV_ATOL."""
import pytest
import torch
import transformers

from tests.checkpoints import FAMILIES, write_checkpoint
from warmstart import LLM, SamplingParams
from warmstart.runner.batch import BatchItem

# Same math in a different order (SDPA kernels, packed batches): float32 rounding differences stay far below this.
LOGIT_ATOL = 2e-4
# K/V rounded to float16 (11-bit mantissa, relative error <= 2^-11) before attention reads them back.
F16_KV_ATOL = 5e-3
# K/V as int8 codes of a per-(token, head) scale: error up to max|row| / 254 per value.
INT8_KV_ATOL = 5e-2
PROMPTS = [[5, 17, 33, 100, 7], [9, 9, 9, 200, 300, 12, 44, 1, 2, 3, 4, 5], [42], list(range(3, 60))]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    d = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, layers=3)
    llm = LLM(str(d), kv_cache_memory=16 * 2**20, max_model_len=256, dtype="float32", kv_cache_dtype="float32",
              startup_plan="off")
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return llm, hf


def test_greedy_tokens_equal_transformers(pair):
    llm, hf = pair
    outs = llm.generate_ids(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert out.output_token_ids == ref


def engine_prompt_logits(llm, prompt):
    """Logits at every prompt position, through the paged-cache path (KV write + gather), in chunks of 16."""
    runner = llm.booted.runner
    blocks = list(range(llm.booted.ledger.num_kv_blocks))[: -(-len(prompt) // runner.block_size)]
    rows = []
    with torch.inference_mode():
        for start in range(0, len(prompt), 16):
            chunk = prompt[start:start + 16]
            item = BatchItem(0, chunk, start, blocks, True, SamplingParams(), len(prompt))
            ids, pos, meta = runner._prepare([item])
            from warmstart.runner.attention import PagedAttentionBackend
            attn = PagedAttentionBackend(runner.kv, runner.block_size)
            attn.meta = meta
            rows.append(runner.model.compute_logits(runner.forward(ids, pos, attn)))
    return torch.cat(rows)


def test_prompt_logits_match_transformers(pair):
    llm, hf = pair
    for prompt in PROMPTS:
        ours = engine_prompt_logits(llm, prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert ours.shape == ref.shape
        assert torch.allclose(ours, ref, atol=LOGIT_ATOL, rtol=0), (ours - ref).abs().max()


def test_logprobs_match_transformers(pair):
    llm, hf = pair
    prompt = PROMPTS[1]
    out = llm.generate_ids([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3,
                                                    prompt_logprobs=2))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + out.output_token_ids])).logits[0].float().log_softmax(-1)
    for j, lp in enumerate(out.prompt_logprobs):            # logprob of prompt token j+1 given its prefix
        assert lp.logprob == pytest.approx(ref[j, prompt[j + 1]].item(), abs=LOGIT_ATOL)
        assert [t for t, _ in lp.top] == ref[j].topk(2).indices.tolist()
    for k, lp in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + k]
        assert lp.logprob == pytest.approx(row[out.output_token_ids[k]].item(), abs=LOGIT_ATOL)
        assert lp.top[0][0] == out.output_token_ids[k]           # greedy picks the top token


def worst_prompt_logit_error(llm, hf) -> float:
    """The largest |engine - transformers| prompt logit over PROMPTS (prompts fed in chunks through the cache)."""
    worst = 0.0
    for prompt in PROMPTS:
        ours = engine_prompt_logits(llm, prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        worst = max(worst, (ours - ref).abs().max().item())
    return worst


def test_the_default_cpu_cache_is_float16_and_stays_close_to_transformers(pair):
    _, hf = pair
    llm = LLM(str(hf.name_or_path), kv_cache_memory=16 * 2**20, max_model_len=256, dtype="float32",
              startup_plan="off")
    assert llm.booted.runner.kv.dtype is torch.float16
    assert 0 < worst_prompt_logit_error(llm, hf) < F16_KV_ATOL      # not exact (the cache is rounded), but close


def test_int8_cache_holds_more_blocks_and_stays_close_to_transformers(pair):
    _, hf = pair
    kw = dict(kv_cache_memory=16 * 2**20, max_model_len=256, dtype="float32", startup_plan="off")
    f16, i8 = LLM(hf.name_or_path, **kw), LLM(hf.name_or_path, kv_cache_dtype="int8", **kw)
    d = i8.booted.runner.spec.head_dim
    assert i8.booted.runner.kv.dtype is torch.int8 and i8.booted.runner.kv.shape[-1] == d + 4
    assert i8.booted.runner.kv_block_bytes(16) * 2 * d == f16.booted.runner.kv_block_bytes(16) * (d + 4)
    # the same budget holds 2D / (D + 4) times float16's blocks (1.88x at the default model's D = 64)
    assert i8.booted.ledger.num_kv_blocks >= 0.99 * f16.booted.ledger.num_kv_blocks * 2 * d / (d + 4)
    assert 0 < worst_prompt_logit_error(i8, hf) < INT8_KV_ATOL
    # greedy: every token the engine picks is transformers' argmax given the same prefix, or within the
    # tolerance of it (a near-tie the cache's rounding may flip)
    outs = i8.generate_ids(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + out.output_token_ids])).logits[0, len(prompt) - 1:-1].float()
        margin = ref.max(-1).values - ref.gather(1, torch.tensor(out.output_token_ids)[:, None])[:, 0]
        assert (margin <= 2 * INT8_KV_ATOL).all(), margin.max()
