"""Speculative decoding on the default model (SmolLM2-135M-Instruct), every ratio measured in one run (issue 10).

    python benchmarks/speculative.py [--new-tokens 64] [--rounds 2] [--k 4] [--draft-layers 4]
                                     [--out benchmarks/results/speculative.json] [--device cpu]

Proposers: (a) the model as its own draft (the acceptance upper bound), (b) a draft made of the model's first
--draft-layers layers plus its final norm and head (written once as a checkpoint next to the default model's
import), (c) n-gram prompt lookup on a prompt that repeats its input ("rewrite this code with one change").
Each is compared with the same model without speculation on the same prompts, at batch 1 and 8, greedy.
decode tok/s = B*(N-1)/(tN - t1): t1 is the best of two 1-token runs, tN one N-token run, so prefill cancels out.
Engines are booted once each in this process and measured interleaved, round by round (a noisy neighbour hits all
of them alike); speedups are per round, then the median."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CODE = '''def moving_average(values, window):
    """Return the moving average of values over a window."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
CHAT = ["Explain why the sky is blue in a few sentences.", "Write a short poem about the sea.",
        "What are three tips for learning a new language?", "Describe how a bicycle works.",
        "Give me a recipe for pancakes.", "Why do cats purr?", "Summarize the plot of Romeo and Juliet.",
        "What is the difference between weather and climate?"]
REWRITE = "Rewrite this code with one change: rename the variable total to running_sum.\n\n" + CODE


def draft_checkpoint(layers: int) -> Path:
    """The default model's first `layers` decoder layers + final norm + (tied) head, as a checkpoint folder."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file
    from warmstart.weights.gguf import default_model_dir
    src = default_model_dir()
    out = src.parent / f"{src.name}-first{layers}"
    if (out / "model.safetensors").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json", ".warmstart-import.json"):
            shutil.copy(f, tmp / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    keep = {}
    with safe_open(src / "model.safetensors", "pt") as f:
        for k in f.keys():
            if ".layers." in k and int(k.split(".layers.")[1].split(".")[0]) >= layers:
                continue
            keep[k] = f.get_tensor(k)
    save_file(keep, tmp / "model.safetensors")
    tmp.rename(out)
    return out


def boot(name: str, args, **spec):
    from warmstart import LLM
    t0 = time.perf_counter()
    llm = LLM("default", quantization=args.quantization, kv_cache_memory=512 * 2**20, max_model_len=1024,
              startup_plan="off", max_num_seqs=16, device=args.device, **spec)
    print(f"booted {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return llm


def rate(llm, prompts, n: int) -> dict:
    from warmstart import SamplingParams

    def run(k):
        t0 = time.perf_counter()
        llm.generate_ids(prompts, SamplingParams(max_tokens=k, temperature=0, ignore_eos=True))
        return time.perf_counter() - t0
    run(2)                                           # warm-up
    t1 = min(run(1) for _ in range(2))
    before = llm.booted.engine.spec_stats.to_dict()
    tn = run(n)
    after = llm.booted.engine.spec_stats.to_dict()
    prop = after["proposals"] - before["proposals"]
    acc = after["accepted_tokens"] - before["accepted_tokens"]
    steps = after["verify_steps"] - before["verify_steps"]
    committed = after["committed_tokens"] - before["committed_tokens"]
    return {"tok_s": len(prompts) * (n - 1) / max(tn - t1, 1e-9), "t1": t1, "tn": tn,
            "acceptance": acc / prop if prop else None,
            "tokens_per_forward": committed / steps if steps else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--quantization", default="auto", help="auto keeps the default model's int4/int8 import")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speculative.json"))
    a = ap.parse_args()
    from warmstart.weights.gguf import default_model_dir
    small = draft_checkpoint(a.draft_layers)
    engines = {
        "baseline": boot("baseline", a),
        "self-draft": boot("self-draft", a, speculative_model=str(default_model_dir()), num_speculative_tokens=a.k),
        f"first-{a.draft_layers}-layers": boot("small draft", a, speculative_model=str(small),
                                               num_speculative_tokens=a.k),
        "ngram": boot("ngram", a, speculative_method="ngram", num_speculative_tokens=a.k),
    }
    tok = engines["baseline"].tokenizer
    chat = [tok.encode_chat([{"role": "user", "content": c}]) for c in CHAT]
    rewrite = tok.encode_chat([{"role": "user", "content": REWRITE}])
    # (a), (b) on chat prompts; (c) on the rewrite prompt; each against the baseline on the same prompts.
    cases = [("self-draft", "chat"), (f"first-{a.draft_layers}-layers", "chat"), ("ngram", "rewrite")]
    batches = [int(b) for b in a.batches.split(",")]
    rows: dict = {}
    for r in range(a.rounds):
        for b in batches:
            sets = {"chat": chat[:b] if b <= len(chat) else (chat * b)[:b], "rewrite": [rewrite] * b}
            base = {p: rate(engines["baseline"], sets[p], a.new_tokens) for p in ("chat", "rewrite")}
            for name, p in cases:
                got = rate(engines[name], sets[p], a.new_tokens)
                row = rows.setdefault((name, p, b), {"base": [], "spec": [], "speedup": [], "acceptance": [],
                                                     "tokens_per_forward": []})
                row["base"].append(base[p]["tok_s"])
                row["spec"].append(got["tok_s"])
                row["speedup"].append(got["tok_s"] / base[p]["tok_s"])
                row["acceptance"].append(got["acceptance"] or 0.0)
                row["tokens_per_forward"].append(got["tokens_per_forward"] or 0.0)
                print(f"round {r} {name:>16} {p:>7} B={b}: {got['tok_s']:7.1f} tok/s vs {base[p]['tok_s']:7.1f} "
                      f"(x{got['tok_s'] / base[p]['tok_s']:.2f}), acceptance {got['acceptance'] or 0:.2f}",
                      flush=True)
    med = statistics.median
    table = [{"proposer": n, "prompt": p, "batch": b, "k": a.k, "baseline_tok_s": round(med(v["base"]), 1),
              "spec_tok_s": round(med(v["spec"]), 1), "speedup": round(med(v["speedup"]), 3),
              "acceptance_rate": round(med(v["acceptance"]), 3),
              "tokens_per_target_forward": round(med(v["tokens_per_forward"]), 2)}
             for (n, p, b), v in rows.items()]
    print("\n| proposer | prompt | batch | K | baseline tok/s | spec tok/s | speedup | acceptance | tokens/fwd |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in table:
        print(f"| {t['proposer']} | {t['prompt']} | {t['batch']} | {t['k']} | {t['baseline_tok_s']} | "
              f"{t['spec_tok_s']} | {t['speedup']} | {t['acceptance_rate']} | {t['tokens_per_target_forward']} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "rows": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
