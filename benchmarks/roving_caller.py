"""Issue 8, under load: an experiment on what a step's thread team could get on a busy host (benchmarks/
roving_caller.cpp says what it models and what it leaves out). Builds the C++ file with g++, then runs each mode
quiet and under busy loops on every core (benchmarks/cpu_load.py, as benchmarks/decode.py's load section),
separate processes alternated round by round, for two kinds of region: cache-resident work and work that streams
from memory (a batch-1 decode step reads ~96 MB of weights). Prints steps/s per mode, the slowdown of each mode's
loaded rate against the best quiet rate (issue 8's goal: <= 2x), and writes JSON.

    PYTHONPATH=. .venv/bin/python benchmarks/roving_caller.py [--rounds 2] [--seconds 4] [--out FILE]

The "rescue" mode was then built in the engine and did not deliver what this model predicts (no gain in the loaded
rate; the model has no Python between steps and assumes the engine gets half the CPU): docs/experiments/README.md.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_load import Load  # noqa: E402

HERE = Path(__file__).resolve().parent
MODES = ("one", "fixed", "fixed_rescue1000", "roving", "rescue1000")
# (floats per region, serial loop iterations per segment): cache-resident regions, and regions that stream
WORKLOADS = {"in cache (0.8 MB a region)": (100_000, 500), "from memory (3.2 MB a region)": (400_000, 500)}


def build(out_dir: Path) -> Path:
    exe = out_dir / "roving_caller"
    subprocess.run(["g++", "-O2", "-march=native", "-pthread", "-o", str(exe), str(HERE / "roving_caller.cpp")],
                   check=True)
    return exe


def rate(exe: Path, mode: str, seconds: float, work: tuple[int, int], chunks: int) -> float:
    r = subprocess.run([str(exe), mode, str(seconds), str(work[0]), str(work[1]), str(chunks)],
                       capture_output=True, text=True, check=True, timeout=seconds * 10 + 30)
    return float(r.stdout.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=4.0, help="per run")
    ap.add_argument("--chunks", type=int, default=8, help="chunks per region")
    ap.add_argument("--out", default=str(HERE / "results" / "roving_caller.json"))
    a = ap.parse_args()
    if shutil.which("g++") is None:
        print("roving_caller: skipped, no g++")
        return 0
    res: dict = {"rounds": a.rounds, "seconds": a.seconds, "chunks": a.chunks, "workloads": {}}
    with tempfile.TemporaryDirectory() as d:
        exe = build(Path(d))
        for name, work in WORKLOADS.items():
            runs = {m: {"quiet": [], "loaded": []} for m in MODES}
            for _ in range(a.rounds):
                for m in MODES:
                    runs[m]["quiet"].append(rate(exe, m, a.seconds, work, a.chunks))
                with Load(2):
                    for m in MODES:
                        runs[m]["loaded"].append(rate(exe, m, a.seconds, work, a.chunks))
            res["workloads"][name] = runs
    for name, runs in res["workloads"].items():
        med = {m: {k: statistics.median(v) for k, v in r.items()} for m, r in runs.items()}
        best_quiet = max(x["quiet"] for x in med.values())
        print(f"\n## {name}, {a.chunks} chunks a region, median of {a.rounds}\n"
              "| mode | quiet steps/s | loaded steps/s | best quiet / loaded |\n|---|---|---|---|")
        for m, x in med.items():
            print(f"| {m} | {x['quiet']:.1f} | {x['loaded']:.1f} | {best_quiet / x['loaded']:.2f}x |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
