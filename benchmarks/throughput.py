"""Decode throughput: warmstart vs HF transformers `generate`, measured in the same run, reported as a ratio.

Decode tokens/s = batch x (N - 1) / (time to generate N tokens - time to generate 1 token), so prefill cancels out.
Usage: python benchmarks/throughput.py [--model DIR|default|tiny] [--batches 1 32] [--tokens 64] [--threads N]
       [--quantization auto|none|int8|int4]"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_rate(run, batch: int, tokens: int) -> float:
    run(1)                                                    # warm caches and kernels
    t1 = min(timed(lambda: run(1)) for _ in range(2))
    tn = timed(lambda: run(tokens))
    return batch * (tokens - 1) / max(tn - t1, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny", help="a model folder, 'default' (SmolLM2-135M) or 'tiny'")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--quantization", default="auto", help="warmstart's --quantization (auto: a GGUF import's own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from hf_model import hf_float_model
    from warmstart import LLM, SamplingParams
    if args.model == "tiny":
        from tests.checkpoints import write_checkpoint
        model_dir = write_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "llama", layers=4, hidden=256)
    elif args.model == "default":
        from warmstart.weights.gguf import default_model_dir
        model_dir = default_model_dir()
    else:
        model_dir = Path(args.model)
    llm = LLM(str(model_dir), dtype="float32", quantization=args.quantization, startup_plan="off", max_model_len=512,
              max_num_seqs=max(args.batches), max_num_batched_tokens=max(512, max(args.batches) * args.prompt_len))
    hf = hf_float_model(model_dir, torch.float32)
    print(f"model {model_dir} | torch threads {torch.get_num_threads()} | {args.tokens} new tokens, "
          f"prompt {args.prompt_len} tokens, greedy, float32 activations | warmstart linears: "
          f"{llm.report.to_dict()['quantization']['linears'] or 'float32'} | transformers: float32 (quantized "
          "linears, if any, dequantized: the same weights)")
    print(f"{'batch':>5}  {'warmstart tok/s':>16}  {'transformers tok/s':>18}  {'ratio':>6}")
    for b in args.batches:
        prompts = [[(7 * i + j) % 200 + 3 for j in range(args.prompt_len)] for i in range(b)]

        def ours(n):
            llm.generate_ids(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))

        ids = torch.tensor(prompts)

        def theirs(n):
            with torch.no_grad():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)

        w, h = decode_rate(ours, b, args.tokens), decode_rate(theirs, b, args.tokens)
        print(f"{b:>5}  {w:>16.1f}  {h:>18.1f}  {w / h:>6.2f}")


if __name__ == "__main__":
    main()
