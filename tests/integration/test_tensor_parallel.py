"""Tensor parallel over torch.distributed (gloo, 2 ranks, 1 thread per rank): greedy parity with one device on
every family, per-rank plans, and shutdown with no orphans. Sized for a 2-core CI machine."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.checkpoints import write_checkpoint
from tests.integration.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [100, 3, 250, 17, 42, 42, 9]]
MAX_TOKENS = 12
NEAR_TIE = 1e-3        # a top-2 logprob margin below this may flip under another float summation order


def generate(model: Path, cache: Path, tp: int, quantization: str = "auto") -> tuple[list, dict]:
    """Greedy ids and the top-2 logprobs of every step, from a fresh process (rank 0) and its ranks."""
    code = f"""
import json, sys
from warmstart.llm import LLM
from warmstart.sampling_params import SamplingParams
llm = LLM({str(model)!r}, tensor_parallel_size={tp}, threads_per_rank=1, cache_dir={str(cache)!r},
          max_model_len=128, kv_cache_memory=4 * 2**20, quantization={quantization!r})
outs = llm.generate_ids({PROMPTS!r}, SamplingParams(max_tokens={MAX_TOKENS}, temperature=0, ignore_eos=True,
                                                      logprobs=2))
print(json.dumps({{"ids": [o.output_token_ids for o in outs],
                  "top": [[[list(t) for t in lp.top] for lp in o.logprobs] for o in outs],
                  "report": llm.report.to_dict()}}))
llm.close()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out, out["report"]


# (family, expected kv heads) — GQA with 1, 2 and 4 KV heads, tied and untied embeddings, qkv bias, qk-norm
@pytest.mark.parametrize("family", ["llama", "llama-untied-hd", "qwen2", "qwen3"])
def test_greedy_tp2_equals_tp1(tmp_path, family):
    model = write_checkpoint(tmp_path / "m", family)
    one, _ = generate(model, tmp_path / "c", 1)
    two, report = generate(model, tmp_path / "c", 2)
    tp = report["tensor_parallel"]
    assert tp["world_size"] == 2 and len(tp["ranks"]) == 2
    assert_same_greedy(one, two)


# Per-rank K of o_proj (2 heads x 32) and down_proj (256 / 2) are whole groups of 32, so int4 cuts cleanly.
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_greedy_tp2_equals_tp1(tmp_path, quantization):
    model = write_checkpoint(tmp_path / "m", "llama", hidden=128, intermediate=256, extra={"head_dim": 32})
    one, report1 = generate(model, tmp_path / "c", 1, quantization)
    two, report = generate(model, tmp_path / "c", 2, quantization)
    linears = report1["quantization"]["linears"]
    assert linears.get(quantization), report1["quantization"]         # the quantized path, not a float fallback
    for rank in report["tensor_parallel"]["ranks"]:                     # every rank binds quantized linears
        assert rank["quantization"]["linears"] == linears, rank["quantization"]
        assert rank["quantization"]["weight_bytes"] < report1["quantization"]["weight_bytes"]
    assert_same_greedy(one, two)


def assert_same_greedy(one: dict, two: dict) -> None:
    for p, (a, b) in enumerate(zip(one["ids"], two["ids"])):
        for step, (x, y) in enumerate(zip(a, b)):
            if x != y:
                # Show the near-tie instead of loosening the check: the reference's top-2 margin at the flip.
                (t1, l1), (t2, l2) = one["top"][p][step][:2]
                assert l1 - l2 < NEAR_TIE, (f"prompt {p} step {step}: TP=2 chose {y}, TP=1 chose {x} with a top-2 "
                                            f"margin {l1 - l2:.3g} (not a near-tie)")
                print(f"near-tie flip: prompt {p} step {step}, margin {l1 - l2:.3g}")
                break
        else:
            assert a == b


def test_refuses_what_cannot_divide(tmp_path):
    model = write_checkpoint(tmp_path / "m", "qwen2")           # 6 heads, 2 KV heads
    r = subprocess.run([sys.executable, "-m", "warmstart", "generate", str(model), "--prompt", "hi",
                        "--tensor-parallel-size", "4", "--cache-dir", str(tmp_path / "c")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "num_attention_heads 6 is not divisible by 4" in r.stderr
    r = subprocess.run([sys.executable, "-m", "warmstart", "generate", str(model), "--prompt", "hi",
                        "--tensor-parallel-size", "2", "--speculative-method", "ngram",
                        "--num-speculative-tokens", "2", "--cache-dir", str(tmp_path / "c")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "Speculative decoding" in r.stderr and "not supported with" in r.stderr, r.stderr


def probe(cache: Path, model: Path, **cfg) -> dict:
    cfg = {"model": str(model), "cache_dir": str(cache), "max_model_len": 128, "world_size": 2, "threads": 1, **cfg}
    r = subprocess.run([sys.executable, "-m", "tests.boot_probe", json.dumps(cfg), "1"], capture_output=True,
                       text=True, cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["stderr"] = r.stderr
    return out


def plans(report: dict) -> list[dict]:
    return [rank["plan"] for rank in report["tensor_parallel"]["ranks"]]


def test_per_rank_plans_miss_hit_and_min_blocks(tmp_path):
    model = write_checkpoint(tmp_path / "m", "qwen2")
    a = probe(tmp_path / "c", model, memory_utilization=0.02)["report"]
    assert [p["status"] for p in plans(a)] == ["miss", "miss"]
    assert all(p["saved"] for p in plans(a))
    assert len({p["path"] for p in plans(a)}) == 2                       # one plan file per rank
    # Blocks: every rank allocates the minimum over what the ranks sized.
    tp = a["tensor_parallel"]
    assert a["memory"]["num_kv_blocks"] == min(tp["kv_blocks_per_rank"]) == tp["kv_blocks"]
    assert [r["memory"]["num_kv_blocks"] for r in tp["ranks"]] == [tp["kv_blocks"]] * 2
    assert "rank agreement" in [s["name"] for s in a["steps"]]            # the step that waits for the slowest
    assert all(r["steps"] for r in tp["ranks"])                           # each rank's own steps and ledger
    b = probe(tmp_path / "c", model, memory_utilization=0.02)["report"]
    assert [p["status"] for p in plans(b)] == ["hit", "hit"], plans(b)
    assert "memory profile" in [s["name"] for s in b["tensor_parallel"]["ranks"][1]["steps"]]
    r = subprocess.run([sys.executable, "-m", "warmstart", "-q", "plan", "explain", str(model), "-tp", "2",
                        "--max-model-len", "128", "--memory-utilization", "0.02", "--cache-dir", str(tmp_path / "c")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stdout.count(": hit: ") == 2, r.stdout + r.stderr[-2000:]
    c = probe(tmp_path / "c", model, memory_utilization=0.03)
    for p in plans(c["report"]):
        assert p["status"] == "miss" and "memory_utilization 0.02 -> 0.03" in p["reasons"], p


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                        # a zombie is dead: its parent has not reaped it yet
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids, timeout=20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _serve(tmp_path, model):
    server = ServerProcess(model, "--tensor-parallel-size", "2", "--threads-per-rank", "1", "--max-model-len", "128",
                           "--kv-cache-memory", "4MiB", "--cache-dir", tmp_path / "c", log_path=tmp_path / "log")
    server.wait_ready(180)
    pids = httpx.get(f"{server.base_url}/startup", timeout=10).json()["tensor_parallel"]["worker_pids"]
    assert len(pids) == 1 and _alive(pids[0])
    return server, pids


def test_kill_one_rank_mid_serve_stops_everything(tmp_path):
    model = write_checkpoint(tmp_path / "m", "llama")
    shm_before = set(os.listdir("/dev/shm"))
    server, pids = _serve(tmp_path, model)
    body = {"model": "m", "prompt": "hello", "max_tokens": 64, "temperature": 0}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    os.kill(pids[0], signal.SIGKILL)
    try:                                     # mid-serve: a request in flight when the rank is gone
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    except httpx.TransportError:
        pass
    try:
        code = server.proc.wait(30)
    finally:
        server.terminate()
    log = server.log()
    assert code not in (0, None), log[-3000:]
    assert f"tensor-parallel rank 1 (pid {pids[0]}) died" in log, log[-3000:]
    assert _wait_gone([server.proc.pid, *pids]) == []
    assert set(os.listdir("/dev/shm")) - shm_before == set()
    assert not any(f":{server.port:04X} " in line for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                   if line.split()[3] == "0A")                          # nothing listens on the port any more


RANK0_FAULTS = """
import json, os, sys, time
from warmstart.llm import LLM
from warmstart.sampling_params import SamplingParams
POISON = [7, 7, 7, 7, 7, 7]
greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
llm = LLM(sys.argv[1], tensor_parallel_size=2, threads_per_rank=1, cache_dir=sys.argv[2], max_model_len=128,
          kv_cache_memory=4 * 2**20)
runner, prompts, out = llm.booted.runner, json.loads(sys.argv[3]), {}
ids = lambda outs: [o.output_token_ids for o in outs]
out["clean"] = ids(llm.generate_ids(prompts, greedy))
prepare = runner._prepare
def poisoned(items):
    if any(list(it.token_ids[:6]) == POISON for it in items):
        raise RuntimeError("injected: rank 0 could not prepare this request")
    return prepare(items)
runner._prepare = poisoned
outs = llm.generate_ids(prompts + [POISON], greedy)
out["with_poison"], out["poison_reason"] = ids(outs[:-1]), outs[-1].finish_reason
runner._prepare = prepare
out["after"] = ids(llm.generate_ids(prompts, greedy))
def broken(*args, **kwargs):
    raise RuntimeError("injected: rank 0's forward failed")
runner.forward = broken
t0 = time.monotonic()
try:
    llm.generate_ids(prompts, greedy)
    raised = None
except Exception as e:
    raised = f"{type(e).__name__}: {e}"
out["broken"] = {"seconds": time.monotonic() - t0, "raised": raised, "failure": runner.group.failure,
                 "pid": runner.group.procs[1].pid, "rank_exit": runner.group.procs[1].poll()}
print(json.dumps(out))
"""


def test_a_step_that_fails_on_rank0_never_leaves_the_ranks_behind(tmp_path):
    """Rank 0 failing a step must not desynchronize the ranks' collectives. Failing while preparing a request's
    inputs (before the ranks are sent the batch) fails that request alone, as on one device, and later steps
    give the same tokens; failing inside the forward (the ranks are then waiting at a collective) stops the
    whole group at once with the reason, instead of hanging or pairing one step's collectives with the next's."""
    model = write_checkpoint(tmp_path / "m", "llama")
    try:
        r = subprocess.run([sys.executable, "-c", RANK0_FAULTS, str(model), str(tmp_path / "c"), json.dumps(PROMPTS)],
                           capture_output=True, text=True, timeout=240, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"rank 0's engine hung after an injected failure: {(e.stderr or b'')[-3000:]!r}")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["poison_reason"] == "error"
    assert out["with_poison"] == out["clean"] and out["after"] == out["clean"]
    broken = out["broken"]
    assert broken["seconds"] < 60, broken
    assert "rank 0's forward failed (RuntimeError: injected" in broken["failure"], broken
    assert broken["failure"].endswith("stopping all 2 ranks"), broken
    assert broken["raised"] == f"RankFailure: {broken['failure']}", broken
    assert broken["rank_exit"] is not None and _wait_gone([broken["pid"]]) == []


def test_sigterm_and_sigkill_of_rank0_leave_no_ranks(tmp_path):
    model = write_checkpoint(tmp_path / "m", "llama")
    server, pids = _serve(tmp_path, model)
    assert server.terminate() == 0, server.log()[-3000:]                 # SIGTERM: graceful, exit 0
    assert _wait_gone(pids) == []
    server, pids = _serve(tmp_path, model)
    server.proc.kill()                                                   # SIGKILL rank 0: its ranks notice
    server.proc.wait()
    server.terminate()
    assert _wait_gone(pids, 10) == []


def test_per_rank_daemons_attach_and_one_rank_falls_back(tmp_path):
    import shutil
    from tests.integration.test_weight_daemon import short_dir
    model = write_checkpoint(tmp_path / "m", "qwen2")
    sock_dir = short_dir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sup = subprocess.Popen([sys.executable, "-m", "warmstart", "-q", "weights", "serve", str(model), "--device", "cpu",
                            "--dtype", "float32", "--socket-dir", str(sock_dir), "--tensor-parallel-size", "2"],
                           stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    ready = {}
    try:
        while len(ready) < 2:
            line = sup.stderr.readline()
            assert line, f"daemons exited ({sup.poll()})"
            if line.startswith("READY"):
                sock = line.split("socket=")[1].split()[0]
                ready[sock] = int(line.split("pid=")[1].split()[0])
        socks = sorted(ready)
        assert [Path(s).name for s in socks] == ["cpu-target.tp2r0.sock", "cpu-target.tp2r1.sock"]
        cfg = dict(dtype="float32", memory_utilization=0.02, weight_socket=str(sock_dir / "cpu-target.sock"))
        attached = probe(tmp_path / "c", model, load_format="daemon", **cfg)["report"]
        ranks = attached["tensor_parallel"]["ranks"]
        assert [r["weights"]["source"] for r in ranks] == ["daemon-zero-copy"] * 2
        for r, sock in zip(ranks, socks):                  # each rank charged by its own socket, and only by it
            assert [(c["socket"], c["role"]) for c in r["weights"]["charges"]] == [(sock, "target")], r["weights"]
            assert r["memory"]["weights_bytes"] == 0 and r["memory"]["external_weights_bytes"] > 0
        os.kill(ready[socks[1]], signal.SIGTERM)           # rank 1's daemon stops; rank 0's keeps serving
        assert _wait_gone([ready[socks[1]]]) == []
        mixed = probe(tmp_path / "c", model, load_format="daemon", **cfg)["report"]
        ranks = mixed["tensor_parallel"]["ranks"]
        assert ranks[0]["weights"]["source"] == "daemon-zero-copy"
        assert ranks[1]["weights"]["source"] == "disk" and ranks[1]["weights"]["fallback_reason"]
        assert ranks[1]["weights"]["charges"] == [] and ranks[1]["memory"]["external_weights_bytes"] == 0
    finally:
        sup.terminate()
        sup.wait(30)
        shutil.rmtree(sock_dir, ignore_errors=True)
    disk = probe(tmp_path / "c2", model, load_format="disk", **cfg)["report"]
    assert mixed["memory"]["num_kv_blocks"] == disk["memory"]["num_kv_blocks"] == attached["memory"]["num_kv_blocks"]


def test_two_process_groups_on_one_host_with_master_ports(tmp_path):
    """Two TP=2 engines side by side, each rendezvousing on its own --master-addr/--master-port (torchrun's
    MASTER_ADDR/MASTER_PORT, which their ranks receive): neither disturbs the other."""
    from tests.integration.server_process import free_port
    model = write_checkpoint(tmp_path / "m", "llama")
    ports = [free_port(), free_port()]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "warmstart", "generate", str(model), "--prompt", "Hello world",
                               "--max-tokens", "8", "-tp", "2", "--threads-per-rank", "1", "--master-addr",
                               "127.0.0.1", "--master-port", str(port), "--max-model-len", "128",
                               "--kv-cache-memory", "4MiB", "--cache-dir", str(tmp_path / f"c{i}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for i, port in enumerate(ports)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err), port in zip(procs, outs, ports):
        assert p.returncode == 0, err[-3000:]
        assert f"rendezvous 127.0.0.1:{port}" in err
    assert outs[0][0] == outs[1][0]


def test_ranks_of_a_second_host_join_with_tp_join(tmp_path):
    """Multi-host, on one host: `generate -tp 2 --nnodes 2` runs rank 0 only and hosts the rendezvous;
    `warmstart tp-join --node-rank 1` (what the second host runs) starts rank 1, which takes the engine config
    from rank 0's store. Same text as one device, and the joining node exits 0 when rank 0 is done."""
    from tests.integration.server_process import free_port
    model = write_checkpoint(tmp_path / "m", "llama")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    common = ["--prompt", "Hello world", "--max-tokens", "8", "--max-model-len", "128", "--kv-cache-memory", "4MiB"]
    joiner = subprocess.Popen([sys.executable, "-m", "warmstart", "tp-join", "--master-addr", "127.0.0.1",
                               "--master-port", str(port), "-tp", "2", "--nnodes", "2", "--node-rank", "1",
                               "--threads-per-rank", "1", "--timeout", "120"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        head = subprocess.run([sys.executable, "-m", "warmstart", "generate", str(model), *common, "-tp", "2",
                               "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "--threads-per-rank", "1", "--cache-dir", str(tmp_path / "c")],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        assert head.returncode == 0, head.stderr[-3000:]
        assert "launched 0 ranks" in head.stderr and "from 1 other hosts" in head.stderr
        _, jerr = joiner.communicate(timeout=60)
    finally:
        if joiner.poll() is None:
            joiner.kill()
            joiner.wait()
    assert joiner.returncode == 0, jerr[-3000:]
    assert "node 1 of 2 runs ranks 1..1" in jerr
    single = subprocess.run([sys.executable, "-m", "warmstart", "generate", str(model), *common,
                             "--cache-dir", str(tmp_path / "c1")], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    assert head.stdout == single.stdout


def test_nnodes_needs_an_address_the_other_hosts_can_reach(tmp_path):
    model = write_checkpoint(tmp_path / "m", "llama")
    r = subprocess.run([sys.executable, "-m", "warmstart", "generate", str(model), "--prompt", "x", "-tp", "2",
                        "--nnodes", "2"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "--nnodes > 1 needs an explicit --master-addr" in r.stderr
    r = subprocess.run([sys.executable, "-m", "warmstart", "tp-join", "--master-addr", "127.0.0.1", "--master-port",
                        "1", "-tp", "3", "--nnodes", "2", "--node-rank", "1"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "tp-join needs --nnodes >= 2 dividing" in r.stderr
