"""The weight daemon with real processes, sockets and memfds: the KV/token invariant across disk, zero-copy, copy
and dtype-mismatch fallback (SEEDS.md §2), fallback policy and reason codes, ownership of the socket, daemon
death, concurrent and crashing engines, hostile peers, read-only mappings, and digest parity with the disk path."""
from __future__ import annotations

import json
import mmap
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch

from tests.checkpoints import write_checkpoint
from warmstart.config import EngineConfig
from warmstart.errors import UserError
from warmstart.weights import protocol as P
from warmstart.weights.charges import ExternalCharges
from warmstart.weights.client import DaemonSession
from warmstart.weights.loader import load_tensors, weights_nbytes
from warmstart.weights.manifest import build_cache_key, tensor_digest
from warmstart.weights.source import load_weights

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
CPU = torch.device("cpu")


class Daemon:
    """`warmstart weights serve` as a subprocess; ready when it prints READY on stderr."""

    def __init__(self, ckpt: Path, socket_dir: Path, *args: str):
        self.socket_dir = Path(socket_dir)
        self.proc = subprocess.Popen([sys.executable, "-m", "warmstart", "-q", "weights", "serve", str(ckpt),
                                      "--socket-dir", str(socket_dir), "--device", "cpu", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
                                     cwd=ROOT)
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if line.startswith("READY"):
                self._ready.set()

    def wait_ready(self, timeout: float = 90) -> "Daemon":
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.1):
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.lines)
        return self

    @property
    def socket(self) -> Path:
        ready = next(line for line in self.lines if line.startswith("READY"))
        return Path(ready.split("socket=")[1].split()[0])

    def status(self) -> dict:
        with DaemonSession(self.socket) as s:
            s.open()
            return s.request({"type": "status"})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(15)


def short_dir() -> Path:
    # Unix socket paths must fit in 107 bytes; pytest's tmp_path can be longer than that.
    return Path(tempfile.mkdtemp(prefix="ws", dir="/tmp"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "llama", "llama")


@pytest.fixture(scope="module")
def daemons(ckpt):
    """A float32 target daemon and a bfloat16 one (the canonical mismatch), each in its own socket dir."""
    dirs = [short_dir(), short_dir()]
    f32, bf16 = Daemon(ckpt, dirs[0], "--dtype", "float32"), Daemon(ckpt, dirs[1], "--dtype", "bfloat16")
    f32.wait_ready(), bf16.wait_ready()
    yield {"f32": f32, "bf16": bf16}
    for d in (f32, bf16):
        d.stop()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sockdir():
    d = short_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def cfg(ckpt: Path, **kw) -> EngineConfig:
    return EngineConfig(model=str(ckpt), dtype="float32", **kw)


def generate(ckpt: Path, report: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "warmstart", "-q", "generate", str(ckpt), "--prompt",
                             "The quick brown fox", "--max-tokens", "12", "--dtype", "float32",
                             "--memory-utilization", "0.02", "--startup-plan", "off", "--max-model-len", "256",
                             "--cache-dir", str(report.parent / "cache"), "--report", str(report), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)


# --------------------------------------------------------------------------------------------- the invariant
def test_kv_and_tokens_identical_for_disk_zero_copy_copy_and_dtype_fallback(ckpt, daemons, tmp_path):
    f32, bf16 = str(daemons["f32"].socket), str(daemons["bf16"].socket)
    runs = {"disk": ["--load-format", "disk"],
            "zero_copy": ["--load-format", "daemon", "--weight-socket", f32],
            "copy": ["--load-format", "daemon", "--weight-socket", f32, "--weight-mode", "copy"],
            "fallback": ["--load-format", "daemon", "--weight-socket", bf16]}
    # All four boot at once: two of them attach to the same daemon concurrently.
    procs = {name: generate(ckpt, tmp_path / f"{name}.json", *args) for name, args in runs.items()}
    reports = {}
    for name, p in procs.items():
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, f"{name}: {err}"
        reports[name] = json.loads((tmp_path / f"{name}.json").read_text())
    disk = reports["disk"]["memory"]
    w = disk["weights_bytes"]
    assert w == weights_nbytes(load_tensors(ckpt, torch.float32, progress=False)) > 0
    for name, r in reports.items():
        assert (r["memory"]["kv_cache_bytes"], r["memory"]["num_kv_blocks"]) == \
            (disk["kv_cache_bytes"], disk["num_kv_blocks"]), name
        assert r["memory"]["weights_bytes"] + r["memory"]["external_weights_bytes"] == w, name
        assert r["outputs"] == reports["disk"]["outputs"], name
    assert reports["disk"]["weights"] == {"source": "disk", "fallback_reason": None, "charges": []}
    zc = reports["zero_copy"]
    assert zc["weights"] == {"source": "daemon-zero-copy", "fallback_reason": None,
                             "charges": [{"socket": f32, "role": "target", "bytes": w}]}
    assert (zc["memory"]["weights_bytes"], zc["memory"]["external_weights_bytes"]) == (0, w)
    assert reports["copy"]["weights"] == {"source": "daemon-copy", "fallback_reason": None, "charges": []}
    fb = reports["fallback"]["weights"]
    assert fb["source"] == "disk" and fb["charges"] == []
    assert fb["fallback_reason"].startswith("key_mismatch: dtype (daemon 'bfloat16', engine 'float32')")
    assert len(reports["disk"]["outputs"][0]["output_token_ids"]) == 12


# --------------------------------------------------------------------------------------------- fallback policy
def test_load_format_auto_daemon_disk(ckpt, daemons, sockdir, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(sockdir))          # discovery looks in $XDG_RUNTIME_DIR/warmstart
    auto = load_weights(ckpt, torch.float32, CPU, config=cfg(ckpt, load_format="auto"))
    assert (auto.source, auto.fallback_reason, auto.charges.entries()) == ("disk", None, [])
    absent = load_weights(ckpt, torch.float32, CPU, config=cfg(ckpt, load_format="daemon"))
    assert absent.source == "disk" and absent.fallback_reason.startswith("daemon_absent")
    assert absent.owned_bytes == auto.owned_bytes and absent.charges.total_bytes == 0
    with pytest.raises(UserError, match=r"warmstart weights serve .* --dtype float32 --role target"):
        load_weights(ckpt, torch.float32, CPU, config=cfg(ckpt, load_format="daemon", weight_fallback=False))
    with pytest.raises(UserError, match="draft"):
        load_weights(ckpt, torch.float32, CPU, role="draft",
                     config=cfg(ckpt, load_format="daemon", weight_fallback=False))
    # --load-format disk never touches a daemon, even one that serves exactly this
    f32 = daemons["f32"]
    before = f32.status()["deliveries"]
    disk = load_weights(ckpt, torch.float32, CPU, config=cfg(ckpt, load_format="disk", weight_socket=str(f32.socket)))
    assert disk.source == "disk" and f32.status()["deliveries"] == before
    # auto discovers the daemon in the socket dir
    d = Daemon(ckpt, sockdir / "warmstart", "--dtype", "float32").wait_ready()
    try:
        found = load_weights(ckpt, torch.float32, CPU, config=cfg(ckpt, load_format="auto"))
        assert found.source == "daemon-zero-copy" and found.owned_bytes == 0
        assert found.charges.entries() == [{"socket": str(d.socket), "role": "target",
                                            "bytes": auto.owned_bytes}]
    finally:
        d.stop()


def test_dtype_mismatch_falls_back_or_fails_clearly(ckpt, daemons):
    sock = str(daemons["bf16"].socket)
    charges = ExternalCharges()
    got = load_weights(ckpt, torch.float32, CPU, config=cfg(ckpt, load_format="daemon", weight_socket=sock),
                       charges=charges)
    assert got.source == "disk" and got.fallback_reason.startswith("key_mismatch: dtype")
    assert charges.entries() == [] and got.owned_bytes == weights_nbytes(got.tensors)
    with pytest.raises(UserError) as e:
        load_weights(ckpt, torch.float32, CPU,
                     config=cfg(ckpt, load_format="daemon", weight_socket=sock, weight_fallback=False))
    msg = str(e.value)
    assert "bfloat16" in msg and "float32" in msg and "--weight-fallback on" in msg and "\n" not in msg
    assert f"warmstart weights stop --socket {sock}" in msg


def test_partial_fallback_and_two_roles_on_one_socket(ckpt, daemons, sockdir):
    f32 = str(daemons["f32"].socket)
    draft = Daemon(ckpt, sockdir, "--dtype", "bfloat16", "--role", "draft").wait_ready()
    try:
        charges = ExternalCharges()
        target = load_weights(ckpt, torch.float32, CPU, role="target", charges=charges,
                              config=cfg(ckpt, load_format="daemon", weight_socket=f32))
        d = load_weights(ckpt, torch.float32, CPU, role="draft", charges=charges,
                         config=cfg(ckpt, load_format="daemon", weight_socket=str(draft.socket)))
        w = weights_nbytes(d.tensors)
        assert target.source == "daemon-zero-copy" and d.source == "disk"
        assert d.fallback_reason.startswith("key_mismatch: dtype")
        assert charges.entries() == [{"socket": f32, "role": "target", "bytes": w}]
        assert target.owned_bytes + d.owned_bytes + charges.total_bytes == 2 * w
        # a draft resolving to the target's socket: one charge, and its fallback leaves the target's intact
        same = load_weights(ckpt, torch.float32, CPU, role="draft", charges=charges,
                            config=cfg(ckpt, load_format="daemon", weight_socket=f32))
        assert same.source == "disk" and same.fallback_reason.startswith("key_mismatch: role")
        assert charges.entries() == [{"socket": f32, "role": "target", "bytes": w}]
    finally:
        draft.stop()


# --------------------------------------------------------------------------------------------- ownership
def test_second_daemon_fails_fast_naming_the_holder(ckpt, daemons):
    first = daemons["f32"]
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "warmstart", "weights", "serve", str(ckpt), "--socket-dir",
                        str(first.socket_dir), "--device", "cpu", "--dtype", "float32"], capture_output=True,
                       text=True, env=ENV, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and f"PID {first.proc.pid}" in r.stderr and "READY" not in r.stderr
    assert time.monotonic() - t0 < 30
    assert first.status()["pid"] == first.proc.pid          # the first one is untouched and still serving


def test_sigkill_mid_serve_keeps_tokens_then_fallback_then_restart(ckpt, sockdir, tmp_path):
    from warmstart.llm import LLM
    from warmstart.sampling_params import SamplingParams
    kw = dict(kv_cache_memory=4 * 2**20, max_model_len=256, dtype="float32", startup_plan="off",
              cache_dir=tmp_path / "cache")
    greedy = SamplingParams(max_tokens=10, temperature=0)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    want = [o.output_token_ids for o in LLM(str(ckpt), load_format="disk", **kw).generate(prompts, greedy)]
    d = Daemon(ckpt, sockdir, "--dtype", "float32").wait_ready()
    sock = str(d.socket)
    try:
        llm = LLM(str(ckpt), load_format="daemon", weight_socket=sock, **kw)
        assert llm.report.weights.source == "daemon-zero-copy"
        model = llm.booted.runner.model
        assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
        assert [o.output_token_ids for o in llm.generate(prompts, greedy)] == want
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        assert [o.output_token_ids for o in llm.generate(prompts, greedy)] == want   # memfd mappings survive
        assert os.path.exists(sock)                          # stale; no engine may remove it
        nxt = LLM(str(ckpt), load_format="auto", weight_socket=sock, **kw)
        assert nxt.report.weights.source == "disk"
        assert nxt.report.weights.fallback_reason.startswith("daemon_unreachable")
        assert nxt.report.weights.charges == ()
        assert os.path.exists(sock)
        d = Daemon(ckpt, sockdir, "--dtype", "float32").wait_ready()   # the new lock owner clears the stale socket
        again = LLM(str(ckpt), load_format="auto", weight_socket=sock, **kw)
        assert again.report.weights.source == "daemon-zero-copy"
        assert [o.output_token_ids for o in again.generate(prompts, greedy)] == want
        assert [o.output_token_ids for o in llm.generate(prompts, greedy)] == want
    finally:
        d.stop()


def test_cli_status_and_stop(ckpt, sockdir):
    d = Daemon(ckpt, sockdir, "--dtype", "float32").wait_ready()
    try:
        r = subprocess.run([sys.executable, "-m", "warmstart", "weights", "status", "--socket-dir", str(sockdir),
                            "--json"], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=60)
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout.splitlines()[0])
        assert st["pid"] == d.proc.pid and st["key"]["dtype"] == "float32" and st["transport"] == "memfd"
        r = subprocess.run([sys.executable, "-m", "warmstart", "weights", "stop", "--socket-dir", str(sockdir),
                            "--device", "cpu"], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=60)
        assert r.returncode == 0 and f"PID {d.proc.pid}" in r.stdout, r.stderr
        assert d.proc.wait(10) == 0 and not d.socket.exists()
    finally:
        d.stop()


# --------------------------------------------------------------------------------------------- concurrency
ATTACH_AND_DIE = """
import os, signal, sys, torch
from pathlib import Path
from warmstart.weights.client import DaemonSession
from warmstart.weights.manifest import CacheKey
with DaemonSession(Path(sys.argv[1])) as s:
    hello = s.open()
    if sys.argv[2] == "mid":       # ask for the weights, then die without reading the reply
        from warmstart.weights import protocol as P
        P.send_message(s.sock, {"type": "attach", "key": hello.key.to_dict(), "mode": "zero_copy"})
    else:
        att = s.attach(hello.key, "zero_copy", torch.device("cpu"))
        float(att.tensors["model.norm.weight"].sum())
    if sys.argv[2] == "write":
        print("ATTACHED", flush=True)
        att.tensors["model.embed_tokens.weight"].add_(1.0)
        print("WROTE", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _fds(pid: int) -> int:
    time.sleep(0.3)                # let the daemon close the connection our last status request used
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_concurrent_attach_and_crashing_engines_leak_nothing(ckpt, daemons):
    d = daemons["f32"]
    key = build_cache_key(ckpt, torch.float32, "target", "cpu")
    before = d.status()            # earlier tests in this process may hold zero-copy leases: those stay
    base_fds, base = _fds(d.proc.pid), before["deliveries"]
    n, results, barrier = 8, [], threading.Barrier(8)

    def attach(i: int) -> None:
        barrier.wait()
        with DaemonSession(d.socket) as s:
            s.open()
            att = s.attach(key, "copy", CPU)
            results.append({k: tensor_digest(t) for k, t in att.tensors.items()})

    threads = [threading.Thread(target=attach, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == n and all(r == results[0] for r in results)
    for how in ("after", "mid"):
        r = subprocess.run([sys.executable, "-c", ATTACH_AND_DIE, str(d.socket), how], env=ENV, cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == -signal.SIGKILL, r.stderr
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        st = d.status()
        if st["leases"] == before["leases"] and _fds(d.proc.pid) == base_fds:
            break
    assert st["leases"] == before["leases"] and _fds(d.proc.pid) == base_fds
    assert st["connections"] == before["connections"]
    assert st["deliveries"] == base + n + 2 and d.proc.poll() is None


# --------------------------------------------------------------------------------------------- hostile peers
def test_bad_peers_get_errors_and_the_daemon_stays_up(ckpt, daemons, sockdir):
    d = daemons["f32"]
    hello = P.encode(P.hello())
    cases = [
        ("too_large", struct.pack(">I", P.MAX_MESSAGE + 1)),                    # refused before reading a byte
        ("bad_message", struct.pack(">I", 12) + os.urandom(12)),                # not msgpack
        ("bad_message", struct.pack(">I", 4) + msgpack.packb(msgpack.ExtType(1, b"xy"))),   # extension type
        ("bad_message", P.encode({"type": "status"})),                          # no hello first
        ("proto_mismatch", P.encode({**P.hello(), "proto": 999})),
        ("bad_message", hello + P.encode({"type": "attach", "key": {"dtype": 1}, "mode": "copy"})),
    ]
    for code, payload in cases:
        replies = []
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(d.socket))
            s.sendall(payload)
            try:
                while True:
                    replies.append(P.recv_message(s)[0])
            except P.ProtocolError:                   # the daemon closed this connection after its error
                pass
        assert replies and replies[-1]["type"] == "error" and replies[-1]["code"] == code, (code, replies)
        assert d.status()["pid"] == d.proc.pid
    # a symlink to a real daemon is not trusted: fallback with a reason, never a connection
    link = sockdir / "link.sock"
    link.symlink_to(d.socket)
    got = load_weights(ckpt, torch.float32, CPU, config=cfg(ckpt, load_format="daemon", weight_socket=str(link)))
    assert got.source == "disk" and got.fallback_reason.startswith("socket_untrusted")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another uid")
def test_peer_with_another_uid_is_refused(ckpt, sockdir):
    d = Daemon(ckpt, sockdir, "--dtype", "float32").wait_ready()
    try:
        os.chmod(sockdir, 0o711)
        os.chmod(d.socket, 0o666)                # only the SO_PEERCRED check stands in the way now
        # The daemon checks credentials before reading anything, so the peer only listens: sending first could
        # turn the daemon's close-with-unread-data into a reset that hides its error reply.
        code = ("import os, socket, sys\nos.setgid(65534); os.setuid(65534)\ns = socket.socket(socket.AF_UNIX)\n"
                "s.settimeout(10); s.connect(sys.argv[1])\n"
                "data = b''\nwhile True:\n    b = s.recv(4096)\n    if not b: break\n    data += b\n"
                "sys.stdout.write(data.hex())")
        r = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(d.socket)], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, r.stderr
        reply = P.decode(bytes.fromhex(r.stdout)[4:]) if r.stdout else {}
        assert reply.get("type") == "error" and reply.get("code") == "peer_uid"
        assert d.status()["pid"] == d.proc.pid
    finally:
        d.stop()


# --------------------------------------------------------------------------------------------- read-only, parity
def test_write_to_a_served_weight_faults_and_corrupts_nothing(ckpt, daemons):
    d = daemons["f32"]
    r = subprocess.run([sys.executable, "-c", ATTACH_AND_DIE, str(d.socket), "write"], env=ENV, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGSEGV and "ATTACHED" in r.stdout and "WROTE" not in r.stdout, r.stderr
    with DaemonSession(d.socket) as s:                   # the descriptors themselves refuse every kind of write
        hello = s.open()
        P.send_message(s.sock, {"type": "attach", "key": hello.key.to_dict(), "mode": "copy"})
        reply, fds = P.recv_message(s.sock, P.MAX_FDS)
        try:
            size = reply["manifest"]["region_sizes"][0]
            with pytest.raises(PermissionError):
                mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(fds[0], b"x", 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fds[0], 0)
        finally:
            P._close_all(fds)
    with DaemonSession(d.socket) as s:                   # and the bytes still hash to the manifest
        hello = s.open()
        s.attach(hello.key, "copy", CPU, verify=True)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_served_digests_equal_disk_loaded_digests(ckpt, daemons, dtype):
    torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    disk = load_tensors(ckpt, torch_dtype, progress=False)
    with DaemonSession(daemons[dtype].socket) as s:
        hello = s.open()
        att = s.attach(build_cache_key(ckpt, torch_dtype, "target", "cpu"), "copy", CPU, verify=True)
    assert hello.weight_bytes == weights_nbytes(disk)
    entries = {e.name: e for e in att.manifest.entries}
    assert set(entries) == set(disk)
    for name, t in disk.items():
        e = entries[name]
        assert e.digest == tensor_digest(t) == tensor_digest(att.tensors[name]), name
        assert (e.shape, e.stride, e.dtype) == (tuple(t.shape), t.stride(), str(t.dtype).removeprefix("torch."))


def test_cuda_watchdog_fail_stops_when_the_daemon_dies():
    """The CUDA fail-stop needs no GPU to test: a pidfd watchdog on a stand-in daemon that dies unreaped (a
    zombie, which a kill(pid, 0) check would still call alive)."""
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    code = ("import sys, time\nfrom pathlib import Path\nfrom warmstart.weights.client import DaemonWatchdog\n"
            "DaemonWatchdog(int(sys.argv[1]), Path('/run/w.sock'))\nprint('WATCHING', flush=True)\ntime.sleep(60)")
    engine = subprocess.Popen([sys.executable, "-c", code, str(stand_in.pid)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        assert engine.stdout.readline().strip() == "WATCHING"
        t0 = time.monotonic()
        stand_in.kill()                                  # not reaped until the end of the test
        assert engine.wait(10) == 75
        assert time.monotonic() - t0 < 2.0
        assert f"the weight daemon (PID {stand_in.pid}" in engine.stderr.read()
    finally:
        engine.kill()
        stand_in.wait()


def test_quantized_daemon_attach_equals_disk(ckpt, sockdir, tmp_path):
    """An int4 daemon serves the kernel-ready quantized tensors: zero-copy attach gives the disk boot's weight bytes,
    KV blocks and tokens; an engine asking for another quantization falls back to disk with key_mismatch."""
    d = Daemon(ckpt, sockdir, "--dtype", "float32", "--quantization", "int4").wait_ready()
    try:
        sock = str(d.socket)
        runs = {"disk": ["--load-format", "disk", "--quantization", "int4"],
                "zero_copy": ["--load-format", "daemon", "--weight-socket", sock, "--quantization", "int4"],
                "other": ["--load-format", "daemon", "--weight-socket", sock, "--quantization", "int8"]}
        reports, texts = {}, {}
        for name, args in runs.items():
            p = generate(ckpt, tmp_path / f"{name}.json", *args)
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, f"{name}: {err}"
            reports[name], texts[name] = json.loads((tmp_path / f"{name}.json").read_text()), out
    finally:
        d.stop()
    disk, zc = reports["disk"], reports["zero_copy"]
    assert zc["weights"]["source"] == "daemon-zero-copy"
    assert zc["quantization"]["weight_bytes"] == disk["quantization"]["weight_bytes"] < \
        weights_nbytes(load_tensors(ckpt, torch.float32, progress=False))
    assert zc["memory"]["external_weights_bytes"] == disk["memory"]["weights_bytes"]
    assert (zc["memory"]["num_kv_blocks"], zc["memory"]["kv_cache_bytes"]) == \
        (disk["memory"]["num_kv_blocks"], disk["memory"]["kv_cache_bytes"])
    assert zc["outputs"] == disk["outputs"] and texts["zero_copy"] == texts["disk"]
    assert "post_processing" in reports["other"]["weights"]["fallback_reason"] or \
        "key" in reports["other"]["weights"]["fallback_reason"]
