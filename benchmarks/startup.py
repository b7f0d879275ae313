"""Cold boot (plan miss: profile + save) vs plan-hit boot, step by step, as a ratio; `import torch` as the floor.

Each boot is a fresh `python -m warmstart generate` process; the figure is the startup report's wall time from
process start to ready. Usage: python benchmarks/startup.py [--model DIR|default|tiny] [--repeats 3] [flags...]"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def boot(model: str, cache: Path, extra: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "warmstart", "-q", "generate", model, "--prompt", "Hello", "--max-tokens", "1",
               "--cache-dir", str(cache), "--report", f.name, *extra]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        return json.loads(Path(f.name).read_text())


def floor_seconds() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--repeats", type=int, default=3)
    args, extra = ap.parse_known_args()
    model = args.model
    if model == "tiny":
        sys.path.insert(0, str(ROOT))
        from tests.checkpoints import write_checkpoint
        model = str(write_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "llama", layers=4, hidden=256))
    elif model == "default":
        sys.path.insert(0, str(ROOT))
        from warmstart.weights.gguf import default_model_dir
        model = str(default_model_dir())
    cold, hit = [], []
    for _ in range(args.repeats):
        cache = Path(tempfile.mkdtemp())
        cold.append(boot(model, cache, extra))
        hit.append(boot(model, cache, extra))
        assert cold[-1]["plan"]["status"] == "miss" and hit[-1]["plan"]["status"] == "hit", hit[-1]["plan"]
        assert cold[-1]["memory"]["num_kv_blocks"] == hit[-1]["memory"]["num_kv_blocks"]
    floors = [floor_seconds() for _ in range(args.repeats)]
    med = statistics.median
    print(f"model {model} | {args.repeats} repeats, medians | extra flags {extra or 'none'}")
    print(f"{'step':<16} {'cold (miss)':>12} {'plan hit':>10}")
    for i, step in enumerate(cold[0]["steps"]):
        name = step["name"]
        c = med(r["steps"][i]["seconds"] for r in cold)
        h = med(r["steps"][i]["seconds"] for r in hit)
        print(f"{name:<16} {c:>11.3f}s {h:>9.3f}s")
    c, h, fl = med(r["wall_seconds"] for r in cold), med(r["wall_seconds"] for r in hit), med(floors)
    print(f"{'wall to ready':<16} {c:>11.3f}s {h:>9.3f}s")
    print(f"python -c 'import torch' floor: {fl:.3f}s")
    print(f"plan hit / cold = {h / c:.2f}  (cold is {c / h:.2f}x slower); hit above the import floor: {h - fl:.3f}s")


if __name__ == "__main__":
    main()
