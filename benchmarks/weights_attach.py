"""Weight daemon attach vs disk load, as ratios against baselines measured in the same run.

For a ~1 GiB checkpoint written here (and the default model, if it is installed):
  * `python -c "import torch"`: the floor no boot can go under;
  * disk load (`load_tensors`, the engine's disk path) vs zero-copy attach vs copy attach, each timed to "tensors
    ready" and to "every page touched" (page cache warm; the disk load also with its pages dropped);
  * restart-to-first-token: `warmstart generate --max-tokens 1` with --load-format daemon vs disk, whole process.

    .venv/bin/python benchmarks/weights_attach.py [--size-gib 1.0] [--repeat 3] [--workdir /tmp/warmstart-bench]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}

import torch  # noqa: E402

from warmstart.weights.client import DaemonSession  # noqa: E402
from warmstart.weights.loader import checkpoint_files, load_tensors, weights_nbytes  # noqa: E402
from warmstart.weights.manifest import build_cache_key  # noqa: E402


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def touch(tensors: dict[str, torch.Tensor]) -> None:
    """Fault in every page: read one element per 4 KiB."""
    for t in tensors.values():
        flat = t.reshape(-1)
        step = max(1, 4096 // t.element_size())
        float(flat[::step].sum())


def drop_page_cache(model_dir: Path) -> None:
    for f in checkpoint_files(model_dir):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def write_model(workdir: Path, size_gib: float) -> Path:
    out = workdir / f"llama-{size_gib:g}gib"
    if (out / "config.json").is_file():
        return out
    from tests.checkpoints import write_checkpoint
    layer_bytes = 4 * (4 * 1024 * 1024 // 4 * 3 + 3 * 1024 * (2 * 1024 + 32))   # q,o full; k,v half; gated MLP
    layers = max(1, round(size_gib * 2**30 / layer_bytes))
    return write_checkpoint(out, "llama", layers=layers, hidden=1024, max_position=1024)


class Daemon:
    def __init__(self, model_dir: Path, socket_dir: Path, dtype: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "warmstart", "-q", "weights", "serve", str(model_dir),
                                      "--socket-dir", str(socket_dir), "--device", "cpu", "--dtype", dtype],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=ENV)
        for line in self.proc.stderr:
            if line.startswith("READY"):
                self.socket = Path(line.split("socket=")[1].split()[0])
                self.ready_s = float(line.split("seconds=")[1])
                return
        raise RuntimeError(f"daemon for {model_dir} did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def attach(socket: Path, key, mode: str, fault: bool) -> None:
    with DaemonSession(socket) as s:
        s.open()
        att = s.attach(key, mode, torch.device("cpu"))
        if fault:
            touch(att.tensors)
        s.detach()                 # a benchmark attaches many times: let each lease go with its mapping
    del att


def bench_loads(model_dir: Path, daemon: Daemon, dtype: torch.dtype, repeat: int) -> dict:
    key = build_cache_key(model_dir, dtype, "target", "cpu")
    r = {"weight_bytes": weights_nbytes(load_tensors(model_dir, dtype, progress=False))}
    r["disk_ready_s"] = median_time(lambda: load_tensors(model_dir, dtype, progress=False), repeat)
    r["disk_touched_s"] = median_time(lambda: touch(load_tensors(model_dir, dtype, progress=False)), repeat)

    def cold():
        drop_page_cache(model_dir)
        touch(load_tensors(model_dir, dtype, progress=False))
    r["disk_cold_touched_s"] = median_time(cold, repeat)
    r["zero_copy_ready_s"] = median_time(lambda: attach(daemon.socket, key, "zero_copy", False), repeat)
    r["zero_copy_touched_s"] = median_time(lambda: attach(daemon.socket, key, "zero_copy", True), repeat)
    r["copy_ready_s"] = median_time(lambda: attach(daemon.socket, key, "copy", False), repeat)
    r["daemon_ready_s"] = daemon.ready_s
    return r


def first_token(model_dir: Path, dtype: str, socket: Path, repeat: int) -> dict[str, dict[str, float]]:
    """Whole `warmstart generate --max-tokens 1` processes, disk and attach interleaved (the host is noisy):
    median wall seconds and median seconds per startup step, for each."""
    runs: dict[str, list[dict]] = {"disk": [], "attach": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeat):
            for name, fmt in (("disk", ["--load-format", "disk"]),
                              ("attach", ["--load-format", "daemon", "--weight-socket", str(socket),
                                          "--weight-fallback", "off"])):
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "warmstart", "-q", "generate", str(model_dir), "--prompt",
                                "Hi", "--max-tokens", "1", "--dtype", dtype, "--startup-plan", "off",
                                "--max-model-len", "256", "--max-num-batched-tokens", "64", "--kv-cache-memory",
                                "64MiB", "--cache-dir", tmp, "--report", f"{tmp}/r.json", *fmt], check=True,
                               env=ENV, stdout=subprocess.DEVNULL)
                steps = {s["name"]: s["seconds"] for s in json.loads(Path(f"{tmp}/r.json").read_text())["steps"]}
                runs[name].append({"wall": time.perf_counter() - t0, **steps})
    return {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/warmstart-bench")
    ap.add_argument("--no-default-model", action="store_true")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    floor = median_time(lambda: subprocess.run([sys.executable, "-c", "import torch"], check=True), args.repeat)
    print(f"floor: python -c 'import torch' = {floor:.3f} s")
    models = [("synthetic", write_model(workdir, args.size_gib))]
    if not args.no_default_model:
        try:
            from warmstart.weights.gguf import default_model_dir
            models.append(("default", default_model_dir()))
        except Exception as e:  # the default model is optional here
            print(f"default model skipped: {e}")
    results = {"floor_import_torch_s": floor, "models": {}}
    socket_dir = Path(tempfile.mkdtemp(prefix="wsb", dir="/tmp"))
    for label, model_dir in models:
        for dtype in ("float32", "bfloat16"):
            daemon = Daemon(model_dir, socket_dir, dtype)
            try:
                r = bench_loads(model_dir, daemon, getattr(torch, dtype), args.repeat)
                if dtype == "float32":
                    r["first_token"] = first_token(model_dir, dtype, daemon.socket, args.repeat)
            finally:
                daemon.stop()
            results["models"][f"{label}/{dtype}"] = r
            gib = r["weight_bytes"] / 2**30
            print(f"\n{label} {model_dir.name} {dtype} ({gib:.2f} GiB), medians of {args.repeat}:")
            print(f"  disk load (warm cache)     ready {r['disk_ready_s']*1e3:9.1f} ms   all pages touched "
                  f"{r['disk_touched_s']*1e3:9.1f} ms   (cold cache, touched {r['disk_cold_touched_s']*1e3:.1f} ms)")
            print(f"  zero-copy attach           ready {r['zero_copy_ready_s']*1e3:9.1f} ms   all pages touched "
                  f"{r['zero_copy_touched_s']*1e3:9.1f} ms")
            print(f"  copy attach                ready {r['copy_ready_s']*1e3:9.1f} ms")
            print(f"  ratios: attach/disk ready {r['zero_copy_ready_s']/r['disk_ready_s']:.3f}, touched "
                  f"{r['zero_copy_touched_s']/r['disk_touched_s']:.3f}, vs cold disk "
                  f"{r['zero_copy_touched_s']/r['disk_cold_touched_s']:.3f}; copy/disk touched "
                  f"{r['copy_ready_s']/r['disk_touched_s']:.3f}; attach/import-torch "
                  f"{r['zero_copy_ready_s']/floor:.4f}")
            if "first_token" in r:
                disk, att = r["first_token"]["disk"], r["first_token"]["attach"]
                print(f"  restart-to-first-token (whole process): attach {att['wall']:.2f} s vs cold boot from disk "
                      f"{disk['wall']:.2f} s = ratio {att['wall']/disk['wall']:.3f}; floor/cold boot "
                      f"{floor/disk['wall']:.2f}")
                print("    step medians, attach vs disk: " + ", ".join(
                    f"{k} {att[k]:.2f}/{disk[k]:.2f}" for k in disk if k != "wall"))
    import shutil
    shutil.rmtree(socket_dir, ignore_errors=True)    # the daemons are gone; only their lock files remain
    (workdir / "weights_attach.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {workdir / 'weights_attach.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
