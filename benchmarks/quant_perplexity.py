"""Perplexity of the default model on a fixed text, per weight format (issue 8: the change against float weights,
reported, not asserted).

    python benchmarks/quant_perplexity.py

The reference is `--quantization none`: the GGUF's own values dequantized exactly to float32 (the original fp32
SmolLM2 is not available offline; the Q4_1 file is the model). Rows: the file's quantization on warmstart's compiled
kernel (int8 activations), the same on torch's kernels (bfloat16 activations), and int8 per row of the float
values; then the GGUF's own weights with each KV cache dtype (float32 exact, the default float16, int8 with a scale
per token and head: a prompt attends over the cache's rounded values, so prompt log-probabilities show the cache's
effect). Each is one boot in its own process; perplexity = exp(mean negative log-likelihood of every token after
the first)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined a screw "
    "press with movable metal type, oil-based ink and paper. Before that, books were copied by hand, which made them "
    "rare and expensive. Within fifty years printing shops had spread to more than two hundred cities in Europe, and "
    "millions of books had been printed. Cheaper books changed who could read and what they read: pamphlets, "
    "calendars and newspapers reached merchants and craftsmen as well as scholars. Science benefited because results "
    "could be copied exactly and compared across countries. Languages were standardized as printers chose one "
    "spelling over another. Governments and churches tried to control what was printed, with licenses and lists of "
    "banned books, but ideas travelled faster than the censors. Today the same questions about access, accuracy and "
    "control return with every new technology that makes copying cheaper, from the photocopier to the internet."
)


def perplexity(quantization: str, native: bool = True, kv_cache_dtype: str = "float32") -> tuple[float, int]:
    from warmstart import LLM, SamplingParams
    from warmstart.models import quant
    if not native:
        quant.native_kernel = lambda: False
    llm = LLM("default", dtype="float32", quantization=quantization, kv_cache_memory=2**28, max_model_len=1024,
              startup_plan="off", kv_cache_dtype=kv_cache_dtype)
    ids = llm.tokenizer.encode(TEXT)
    out = llm.generate_ids([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    nll = [-lp.logprob for lp in out.prompt_logprobs]
    return math.exp(sum(nll) / len(nll)), len(ids)


def main() -> int:
    import subprocess
    modes = [("none (exact float32 values), KV float32", "none", True, "float32"),
             ("GGUF native, compiled kernel, KV float32", "auto", True, "float32"),
             ("GGUF native, torch kernels, KV float32", "auto", False, "float32"),
             ("GGUF native, compiled kernel, KV float16 (default)", "auto", True, "auto"),
             ("GGUF native, compiled kernel, KV int8", "auto", True, "int8")]
    rows = []
    for label, q, native, kvd in modes:
        code = (f"import sys, json; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.quant_perplexity import "
                f"perplexity; print(json.dumps(perplexity({q!r}, {native}, {kvd!r})))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        if r.returncode != 0:
            print(f"{label}: failed: {r.stderr.strip().splitlines()[-1:]}")
            continue
        ppl, n = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append((label, ppl, n))
    base = rows[0][1] if rows else None
    print(f"\n| weights, KV cache | perplexity ({rows[0][2] if rows else '?'} tokens) | change vs float |\n|---|---|---|")
    for label, ppl, _ in rows:
        print(f"| {label} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
