"""Structured outputs' cost to the requests beside them: decode tokens/s of the unconstrained requests in a batch
where half the requests are JSON-schema constrained, against the same batch with none constrained, one run each.

Every request decodes exactly --tokens tokens (greedy, ignore_eos), so both batches keep the same size for every
step: the constrained half uses a schema whose one string field needs more characters than that (minLength), so
its grammar never completes and masks are computed on every step. Decode tokens/s = requests x (N - 1) / (time
for N tokens - time for 1 token), so prefill cancels out.
Usage: python benchmarks/structured.py [--model default|tiny|DIR] [--batch 16] [--tokens 64]"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "minLength": 4000},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
    "score": {"type": "number"}}, "required": ["title", "tags", "score"], "additionalProperties": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default", help="a model folder, 'default' (SmolLM2-135M) or 'tiny'")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from warmstart import LLM, SamplingParams
    if args.model == "tiny":
        from tests.checkpoints import write_checkpoint
        model_dir = write_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "llama", layers=4, hidden=256)
    elif args.model == "default":
        from warmstart.weights.gguf import default_model_dir
        model_dir = default_model_dir()
    else:
        model_dir = Path(args.model)
    llm = LLM(str(model_dir), dtype="float32", startup_plan="off", max_model_len=512, max_num_seqs=args.batch,
              max_num_batched_tokens=max(512, args.batch * 32))
    t0 = time.perf_counter()
    grammar = llm.compile_grammar("json", SCHEMA)
    compile_s = time.perf_counter() - t0
    chat = [llm.tokenizer.encode_chat([{"role": "user", "content": f"Describe item {i} as JSON."}])
            for i in range(args.batch)]
    half = args.batch // 2

    def params(n: int, constrained: bool) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, grammar=grammar if constrained else None)

    def run(n: int, mixed: bool) -> float:
        plist = [params(n, mixed and i >= half) for i in range(args.batch)]
        t = time.perf_counter()
        outs = llm.generate_ids(chat, plist)
        assert all(len(o.output_token_ids) == n for o in outs)
        return time.perf_counter() - t

    rates = {}
    for mixed in (False, True):
        run(2, mixed)                                                    # warm up
        t1, tn = run(1, mixed), run(args.tokens, mixed)
        rates[mixed] = half * (args.tokens - 1) / max(tn - t1, 1e-9)     # the unconstrained half only
        print(f"{'half' if mixed else 'none'} constrained: 1 token {t1:.2f} s, {args.tokens} tokens {tn:.2f} s",
              flush=True)
    sample = llm.generate_ids(chat[:1], [params(args.tokens, True)])[0].text
    slowdown = rates[False] / rates[True] - 1
    print(f"model {model_dir} | torch threads {torch.get_num_threads()} | batch {args.batch} "
          f"({half} constrained in the mixed run) | {args.tokens} tokens, greedy, float32")
    print(f"grammar compile {compile_s * 1e3:.1f} ms (first use includes the tokenizer's vocabulary index)")
    print(f"unconstrained decode tok/s: none constrained {rates[False]:.1f} | half constrained {rates[True]:.1f} | "
          f"slowdown {slowdown * 100:+.1f} % (goal <= 10 %)")
    print(f"a constrained output starts: {sample[:60]!r}")


if __name__ == "__main__":
    main()
