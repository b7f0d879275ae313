"""Parity with Hugging Face transformers on the same checkpoint, per family, in float32:
greedy token ids equal transformers' generate, and prompt logits agree within LOGIT_ATOL."""
import pytest
import torch
import transformers

from tests.checkpoints import FAMILIES, write_checkpoint
from warmstart import LLM, SamplingParams
from warmstart.runner.batch import BatchItem

# Same math in a different order (SDPA kernels, packed batches): float32 rounding differences stay far below this.
LOGIT_ATOL = 2e-4
PROMPTS = [[5, 17, 33, 100, 7], [9, 9, 9, 200, 300, 12, 44, 1, 2, 3, 4, 5], [42], list(range(3, 60))]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    d = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, layers=3)
    llm = LLM(str(d), kv_cache_memory=16 * 2**20, max_model_len=256, dtype="float32", startup_plan="off")
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
