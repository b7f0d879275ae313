"""The paged-attention path (decode and short chunks read K/V where they live) against the first version's
gather + SDPA path, kept as `ModelRunner.attention_reference`: greedy ids equal and logits within float32
rounding, across prefill, chunked prefill over a cached prefix, decode with mixed context lengths, and preemption."""
import pytest
import torch

from tests.checkpoints import write_checkpoint
from warmstart import LLM, SamplingParams, kernels
from warmstart.runner.attention import PAGED_MAX_Q, PagedAttentionBackend
from warmstart.runner.batch import BatchItem

LOGIT_ATOL = 2e-4   # same math in another order (fp32 accumulation in both paths)
PROMPTS = [[5, 17, 33, 100, 7], list(range(3, 90)), [42], [9] * 40, list(range(200, 230))]


def boot(d, **kw):
    return LLM(str(d), dtype="float32", startup_plan="off", max_model_len=256, **kw)


@pytest.fixture(scope="module", params=["llama", "llama-untied-hd", "qwen3"])
def ckpt(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, layers=2)


def run(llm, reference: bool, prompts=PROMPTS, n=20):
    llm.booted.runner.attention_reference = reference
    try:
        outs = llm.generate_ids(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    finally:
        llm.booted.runner.attention_reference = False
    return [o.output_token_ids for o in outs]


@pytest.mark.parametrize("chunk", [512, 7])            # whole prompts, and chunked prefill over a cached prefix
def test_greedy_ids_equal_reference(ckpt, chunk):
    llm = boot(ckpt, kv_cache_memory=16 * 2**20, max_num_batched_tokens=chunk)
    assert run(llm, reference=False) == run(llm, reference=True)


def test_preemption_with_paged_attention_equals_reference(ckpt):
    # 12 blocks of 16 tokens cannot hold all five sequences at once: the scheduler preempts and recomputes.
    small = LLM(str(ckpt), dtype="float32", kv_cache_dtype="float32", startup_plan="off", max_model_len=128,
                max_num_batched_tokens=64, kv_cache_memory=12 * 16 * small_block_bytes(ckpt))
    assert small.booted.ledger.num_kv_blocks == 12
    prompts = [p[:60] for p in PROMPTS]
    assert run(small, reference=False, prompts=prompts, n=30) == run(small, reference=True, prompts=prompts, n=30)


def small_block_bytes(d) -> int:
    from warmstart.models.spec import ModelSpec
    return ModelSpec.from_dir(d).kv_bytes_per_token * 4


def step_logits(llm, prompt: list[int], chunk: int, reference: bool) -> torch.Tensor:
    runner = llm.booted.runner
    runner.attention_reference = reference
    blocks = list(range(-(-len(prompt) // runner.block_size)))
    rows = []
    try:
        with torch.inference_mode():
            for start in range(0, len(prompt), chunk):
                part = prompt[start:start + chunk]
                ids, pos, meta = runner._prepare([BatchItem(0, part, start, blocks, True, SamplingParams(),
                                                            len(prompt))])
                from warmstart.runner.attention import PagedAttentionBackend
                attn = PagedAttentionBackend(runner.kv, runner.block_size)
                attn.meta = meta
                rows.append(runner.model.compute_logits(runner.forward(ids, pos, attn)))
    finally:
        runner.attention_reference = False
    return torch.cat(rows)


@pytest.mark.parametrize("chunk", [1, 5, PAGED_MAX_Q, 40])   # decode steps, short chunks (paged), long (gather)
def test_logits_match_reference(ckpt, chunk):
    llm = boot(ckpt, kv_cache_memory=16 * 2**20)
    prompt = PROMPTS[1]
    ours, ref = step_logits(llm, prompt, chunk, False), step_logits(llm, prompt, chunk, True)
    assert torch.allclose(ours, ref, atol=LOGIT_ATOL, rtol=0), (ours - ref).abs().max()


def test_mixed_batch_routes(ckpt):
    """One step holding a fresh prompt, a decode and a short chunk over a prefix uses all routes at once."""
    llm = boot(ckpt, kv_cache_memory=16 * 2**20)
    runner = llm.booted.runner
    items = [BatchItem(0, [5, 6, 7], 0, [0], True, SamplingParams(), 3),
             BatchItem(1, [8], 20, [1, 2], True, SamplingParams(), 10),
             BatchItem(2, [1, 2, 3, 4], 30, [3, 4, 5], True, SamplingParams(), 40)]
    _, _, meta = runner._prepare(items)
    assert [s.route for s in meta.seqs] == ["fresh", "paged", "paged"]
    assert meta.paged.rows.tolist() == [3, 4, 5, 6, 7]
    assert meta.paged.ctx_lens.tolist() == [21, 31, 32, 33, 34]


@pytest.mark.parametrize("kv_dtype", ["float16", "int8"])
def test_runner_cache_is_head_major_and_each_slot_holds_its_token(ckpt, kv_dtype, monkeypatch):
    """The runner's cache is the logical [2, L, blocks, bs, Hkv, row] over head-major memory (kernels.kv_blocks):
    each head's rows of a block side by side. After a prompt, the row at each prompt token's slot is that token's K
    (as the fresh route recomputes it and the cache rounds it), wherever the layout puts it."""
    llm = LLM(str(ckpt), dtype="float32", kv_cache_dtype=kv_dtype, startup_plan="off", max_model_len=128,
              kv_cache_memory=16 * 2**20)
    kv = llm.booted.runner.kv
    _, _, nb, bs, hkv, row = kv.shape
    assert kv.stride()[2:] == (hkv * bs * row, row, bs * row, 1)
    assert kv.untyped_storage().nbytes() == kv.numel() * kv.element_size()     # no gaps: the ledger's bytes
    written = {}
    call = PagedAttentionBackend.__call__

    def spy(self, layer, q, k, v):
        if layer == 0 and [s.route for s in self.meta.seqs] == ["fresh"]:
            written["k"], written["slots"] = k.clone(), self.meta.slot_mapping.clone()
        return call(self, layer, q, k, v)

    monkeypatch.setattr(PagedAttentionBackend, "__call__", spy)
    llm.generate_ids([list(range(3, 40))], SamplingParams(max_tokens=1, temperature=0))
    got = kernels.kv_rows_as(kernels.kv_slot_rows(kv[0, 0], written["slots"]), torch.float32)
    want = kernels.kv_rows_as(kernels.quantize_kv_rows(written["k"]), torch.float32) if kv_dtype == "int8" \
        else written["k"].to(torch.float16).float()
    assert torch.equal(got, want)
