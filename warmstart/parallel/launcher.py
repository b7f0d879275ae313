"""Rank processes and the process group.

Rank 0 is the process that boots (`generate`, `serve`, `LLM(...)`): it launches ranks 1..N-1 itself as
`python -m warmstart.parallel.worker` subprocesses and joins them in a torch.distributed process group (gloo on CPU,
NCCL on CUDA) through the torchrun environment variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK).
The scheduler and engine run once, on rank 0; each step rank 0 broadcasts the Batch (broadcast_object_list), every
rank runs its shard's forward (two all-reduces per layer), and only rank 0 computes logits and samples.

Shutdown: rank 0 terminates its ranks at exit (atexit, SIGTERM, Ctrl-C: the ranks ignore SIGINT and wait for rank
0). A monitor thread on rank 0 notices a rank that died (by pid), stops the others and reports it; the engine's
next collective fails with RankFailure naming the rank. Each rank watches its parent and exits when it is gone, so
a SIGKILLed rank 0 leaves no orphans. Nothing here uses /dev/shm (gloo talks TCP on the loopback)."""
from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

from warmstart.errors import UserError

log = logging.getLogger("warmstart.parallel")

ENV_CONFIG = "WARMSTART_TP_CONFIG"


class RankFailure(RuntimeError):
    """A rank died or a collective failed: the engine cannot go on."""


def threads_per_rank(config) -> int:
    """--threads-per-rank (EngineConfig.threads under TP), else the cores split evenly."""
    from warmstart import threads
    if config.threads is not None:
        return config.threads
    return max(1, threads.available_cpus() // config.world_size)


def rank_env(addr: str, port: int, world_size: int, nthreads: int) -> dict[str, str]:
    """The environment every rank process starts with (the rank's own RANK/LOCAL_RANK are added per process):
    torchrun's rendezvous variables, its thread count and warmstart's OpenMP wait defaults (a user's own win), and
    a PYTHONPATH that imports this very warmstart (a source checkout included)."""
    from warmstart.threads import DEFAULT_SPIN_COUNT, DEFAULT_WAIT_POLICY
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, MASTER_ADDR=addr, MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
               OMP_NUM_THREADS=str(nthreads), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([pkg_root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.setdefault("OMP_WAIT_POLICY", DEFAULT_WAIT_POLICY)
    env.setdefault("GOMP_SPINCOUNT", str(DEFAULT_SPIN_COUNT))
    return env


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _backend(config) -> str:
    return "nccl" if config.device_kind == "cuda" else "gloo"


@dataclass
class RankGroup:
    rank: int
    world_size: int
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)   # rank -> process (rank 0 only)
    failure: str | None = None
    closed: bool = False
    on_failure: list = field(default_factory=list)                     # callbacks(message) when a rank dies

    # -- messages from rank 0 ----------------------------------------------------------------------------------
    def send(self, msg) -> None:
        import torch.distributed as dist
        try:
            dist.broadcast_object_list([msg], src=0)
        except Exception as e:
            raise self._failed(e) from None

    def recv(self):
        import torch.distributed as dist
        box = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj) -> list:
        import torch.distributed as dist
        out = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj)
        except Exception as e:
            raise self._failed(e) from None
        return out

    def _failed(self, e: Exception) -> RankFailure:
        self._poll()
        return RankFailure(self.failure or f"tensor-parallel collective failed on rank {self.rank}: {e}")

    # -- rank 0: processes --------------------------------------------------------------------------------------
    def _poll(self, wait: float = 0.0) -> None:
        """Fail the group if a rank process has exited; `wait`: seconds to keep looking for one."""
        deadline = time.monotonic() + wait
        while True:
            for r, p in self.procs.items():
                code = p.poll()
                if code is not None and not self.closed and self.failure is None:
                    how = f"signal {-code}" if code < 0 else f"exit code {code}"
                    self.fail(f"tensor-parallel rank {r} (pid {p.pid}) died ({how})")
            if self.failure is not None or time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def fail(self, reason: str) -> RankFailure:
        """The group cannot go on: record why (the first reason wins), stop every rank, tell the callbacks (the
        server exits on it), and return the error to raise."""
        if self.failure is None:
            self.failure = f"{reason}; stopping all {self.world_size} ranks"
            log.error("%s", self.failure)
            self.stop()
            for cb in list(self.on_failure):
                cb(self.failure)
        return RankFailure(self.failure)

    def _monitor(self) -> None:
        while not self.closed and self.failure is None:
            self._poll()
            time.sleep(0.2)

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate every rank process (SIGTERM, then SIGKILL) and reap it. Idempotent."""
        alive = [p for p in self.procs.values() if p.poll() is None]
        for p in alive:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in alive:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.rank == 0 and self.failure is None:
            try:
                self.send(("stop",))
            except Exception:
                pass
        self.stop()
        import torch.distributed as dist
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


_GROUP: RankGroup | None = None


def current() -> RankGroup | None:
    return _GROUP


def start(config) -> RankGroup:
    """Rank 0: launch ranks 1..N-1 and join the process group with them."""
    global _GROUP
    if _GROUP is not None and not _GROUP.closed:
        raise UserError("A tensor-parallel engine is already running in this process; close it first.")
    addr = config.master_addr
    port = config.master_port or _free_port(addr)
    nthreads = threads_per_rank(config)
    group = RankGroup(0, config.world_size)
    base = rank_env(addr, port, config.world_size, nthreads)
    payload = json.dumps(config.to_dict())
    local = config.world_size // config.nnodes        # this host runs ranks 0..local-1; other hosts tp-join
    for r in range(1, local):
        env = dict(base, RANK=str(r), LOCAL_RANK=str(r), **{ENV_CONFIG: payload})
        group.procs[r] = subprocess.Popen([sys.executable, "-m", "warmstart.parallel.worker"], env=env,
                                          stdin=subprocess.DEVNULL)
    log.info("tensor parallel: launched %d ranks (pids %s), rendezvous %s:%d, %d threads per rank",
             local - 1, [p.pid for p in group.procs.values()], addr, port, nthreads)
    if config.nnodes > 1:
        log.info("tensor parallel: waiting up to %.0f s for ranks %d..%d from %d other hosts: run `warmstart tp-join "
                 "--master-addr %s --master-port %d -tp %d --nnodes %d --node-rank K` on host K", config.tp_timeout,
                 local, config.world_size - 1, config.nnodes - 1, addr, port, config.world_size, config.nnodes)
    atexit.register(group.close)
    threading.Thread(target=group._monitor, name="warmstart-tp-monitor", daemon=True).start()
    _init(config, 0, addr, port, group, payload)
    _GROUP = group
    return group


def fetch_config(addr: str, port: int, world_size: int, timeout: float) -> dict:
    """A rank started on another host (`warmstart tp-join`) takes the engine config from rank 0's store: one
    source of truth, so every rank shards the same model the same way."""
    import torch.distributed as dist
    store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False)
    return json.loads(store.get("config").decode())


def join(config) -> RankGroup:
    """Ranks 1..N-1 (and a rank started by hand or by torchrun): join rank 0's group from the environment."""
    global _GROUP
    group = RankGroup(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    _init(config, group.rank, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), group)
    _GROUP = group
    return group


def _init(config, rank: int, addr: str, port: int, group: RankGroup, payload: str | None = None) -> None:
    """Rendezvous through a TCPStore (rank 0 hosts it), then the process group over it. Rank 0 waits for every
    rank to check in while watching their pids, so a rank that dies before joining fails the boot at once
    instead of after the timeout."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    timeout = timedelta(seconds=config.tp_timeout)
    try:
        store = dist.TCPStore(addr, port, config.world_size, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False)
        if rank == 0:
            store.set("config", payload or json.dumps(config.to_dict()))
            deadline = time.monotonic() + config.tp_timeout
            waiting = [f"joined/{r}" for r in range(1, config.world_size)]
            while not store.check(waiting):
                group._poll()
                if group.failure:
                    raise RankFailure(group.failure)
                if time.monotonic() > deadline:
                    raise RankFailure(f"tensor-parallel ranks did not join {addr}:{port} within "
                                      f"{config.tp_timeout:.0f} s")
                time.sleep(0.05)
        else:
            store.set(f"joined/{rank}", str(os.getpid()))
        dist.init_process_group(_backend(config), store=store, rank=rank, world_size=config.world_size,
                                timeout=timeout)
    except RankFailure:
        group.stop()
        raise
    except Exception as e:
        group.stop()
        raise RankFailure(group.failure or f"tensor-parallel rendezvous at {addr}:{port} failed on rank {rank}: "
                                           f"{e}") from None


def agree_blocks(group: RankGroup, ledger):
    """The KV block count every rank allocates: the minimum over ranks (every rank's scheduler-visible capacity
    must be the same, since rank 0's block tables address every rank's cache). Returns (ledger, blocks per rank)."""
    import dataclasses
    blocks = group.all_gather(ledger.num_kv_blocks)
    m = min(blocks)
    if len(set(blocks)) > 1:
        log.info("tensor parallel: ranks sized %s KV blocks; every rank allocates the minimum, %d", blocks, m)
    if m != ledger.num_kv_blocks:
        ledger = dataclasses.replace(ledger, num_kv_blocks=m, kv_cache_bytes=m * ledger.kv_block_bytes)
    return ledger, blocks


def install_signal_handlers() -> None:
    """Worker side: Ctrl-C in a terminal reaches every process of the foreground group; ranks leave the decision
    to rank 0 (which stops them), and exit on SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))


def watch_parent() -> None:
    """Worker side: exit when rank 0 is gone (SIGKILLed rank 0 cannot stop us). Polls the parent pid."""
    parent = os.getppid()

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)
    threading.Thread(target=watch, name="warmstart-tp-parent", daemon=True).start()
