"""The engine's features on a CUDA GPU, each against the same engine without it (greedy ids equal), and the float
formats against transformers. Skipped where torch sees no GPU (CI never has one); run on a lent GPU with
tests/gpu/run.sh. CPU-only parts are checked to refuse or fall back clearly: quantized linears (warmstart's
integer kernels are CPU code) are served dequantized on a GPU."""
import os

import pytest
import torch

from tests.checkpoints import write_checkpoint, write_quantized_checkpoint
from warmstart import LLM, SamplingParams
from warmstart.errors import UserError

# WARMSTART_GPU_TEST_DEVICE=cpu runs the same checks on the CPU (to try the tests themselves without a GPU).
DEVICE = os.environ.get("WARMSTART_GPU_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[5, 17, 33, 100, 7], list(range(3, 90)), [42], [9] * 40, list(range(200, 230))]
BASE = dict(device=DEVICE, dtype="float32", startup_plan="off", max_model_len=256, kv_cache_memory=64 * 2**20)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gpu") / "llama", "llama", layers=2)


def greedy(llm: LLM, prompts=PROMPTS, n: int = 20) -> list[list[int]]:
    outs = llm.generate_ids(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [o.output_token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(ckpt):
    return greedy(LLM(str(ckpt), enable_prefix_caching=False, **BASE))


@pytest.mark.parametrize("variant", ["chunked", "prefix", "ngram", "draft", "kv_float16"])
def test_feature_on_gpu_equals_the_plain_run(ckpt, plain, variant, tmp_path):
    kw = {"chunked": dict(max_num_batched_tokens=7),
          "prefix": dict(enable_prefix_caching=True),
          "ngram": dict(speculative_method="ngram", num_speculative_tokens=3),
          "draft": dict(speculative_model=str(ckpt), num_speculative_tokens=3),
          "kv_float16": dict(kv_cache_dtype="float16")}[variant]
    llm = LLM(str(ckpt), **{**BASE, "cache_dir": tmp_path, **kw})
    assert llm.booted.runner.device.type == DEVICE
    if variant == "kv_float16":   # another cache dtype rounds K/V: compare with the same cache on the CPU
        cpu = LLM(str(ckpt), **{**BASE, "device": "cpu", "cache_dir": tmp_path, **kw})
        assert greedy(llm) == greedy(cpu)
        return
    assert greedy(llm) == plain
    if variant == "prefix":       # the second pass reads every prompt's full blocks from the cache
        outs = llm.generate_ids(PROMPTS, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        assert [o.output_token_ids for o in outs] == plain
        assert sum(o.num_cached_tokens for o in outs) > 0


def test_preemption_on_gpu_equals_the_plain_run(ckpt, tmp_path):
    from tests.integration.test_attention_paths import small_block_bytes
    block = 16 * small_block_bytes(ckpt)                           # a float32 cache's block
    small = LLM(str(ckpt), **{**BASE, "kv_cache_memory": 12 * block, "max_model_len": 128, "cache_dir": tmp_path,
                              "max_num_batched_tokens": 64, "kv_cache_dtype": "float32"})
    assert small.booted.ledger.num_kv_blocks == 12
    prompts = [p[:60] for p in PROMPTS]
    big = LLM(str(ckpt), **{**BASE, "cache_dir": tmp_path, "enable_prefix_caching": False})
    assert greedy(small, prompts, 30) == greedy(big, prompts, 30)


def test_bfloat16_on_gpu_follows_transformers(ckpt):
    """dtype auto is bfloat16 on a GPU; greedy ids equal transformers' bfloat16 except at a near-tie of its
    logits (bfloat16 rounds at 2^-8: the two implementations sum in other orders)."""
    import transformers
    llm = LLM(str(ckpt), **{**BASE, "dtype": "auto" if DEVICE == "cuda" else "bfloat16"})
    assert llm.booted.report.to_dict()["dtype"] == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(DEVICE).eval()
    n = 12
    for prompt, ours in zip(PROMPTS, greedy(llm, n=n)):
        out = hf.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        ref = out.sequences[0, len(prompt):].tolist()
        for i, (a, b) in enumerate(zip(ours, ref)):
            if a != b:
                top2 = out.scores[i][0].float().topk(2).values
                assert top2[0] - top2[1] <= 0.1, (prompt, i, a, b, top2)
                break


def test_quantized_checkpoint_is_served_dequantized_on_gpu(ckpt, tmp_path):
    q = write_quantized_checkpoint(ckpt, tmp_path / "q", "int4")
    none = LLM(str(q), **{**BASE, "quantization": "none"})
    cpu = LLM(str(q), **{**BASE, "device": "cpu", "quantization": "none"})
    assert greedy(none) == greedy(cpu)
    if DEVICE == "cuda":                            # auto: dequantized once at load, as quantization none
        auto = LLM(str(q), **BASE)
        assert not any("Quant" in type(m).__name__ for m in auto.booted.runner.model.modules())
        assert greedy(auto) == greedy(none)
        with pytest.raises(UserError, match="CPU kernels only"):
            LLM(str(ckpt), **{**BASE, "quantization": "int8"})
